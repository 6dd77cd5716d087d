"""Compression benchmark: bytes on the wire against accuracy, digits, 4 peers.

Four peers train the digits task in this process (each with its own trio thread
and training thread, on 127.0.0.1), once per method, all from the same initial
weights, for the same number of epochs (global steps, DESIGN.md):

- dense, float16, 8-bit, 4-bit: gradient averaging with that all-reduce codec
  (``AveragerConfig(codec=...)``); an epoch is ``--target-batch-size`` samples
  of the swarm or more (peers compute on until they learn that the target
  was reached, which on this tiny model is many batches);
- ARC-Top-K with EF21M (rho 0.1 and 0.2): gradient averaging in two rounds,
  row sketches then the selected rows (``ArcTopK``, float16 on the wire, its
  default), epochs as for dense; the first epoch is its dense warm-up;
- DiLoCo with H = 10 and 50: an epoch is one outer step, H local steps of
  ``--batch-size`` on every peer, then float16 pseudo-gradients averaged once.

So the rows differ in the data behind an epoch: the table also shows the
samples each peer computed and the bytes per 1,000 of them. Bytes are what
each peer's TCP connections sent (handshakes, matchmaking and framing
included: ``Connections.bytes_sent``), averaged over the peers; the DHT's UDP
traffic is not counted. Wall time is the training time of the slowest peer;
accuracy the mean final test accuracy of the peers.

    python benchmarks/compression.py                    # all methods, 200 epochs (~15 min)
    python benchmarks/compression.py --epochs 20        # early training only
    python benchmarks/compression.py --json             # JSON on stdout, table on stderr
    python benchmarks/compression.py --hidden 1024      # a 76,810-parameter MLP

Accuracy is compared where dense has converged: 200 epochs by default (dense
reaches 0.98 by about epoch 50 and stays there). Error feedback catches up
with what compression left out over many steps, so early on the compressed
methods trail: ``--epochs 20`` shows that cost (ARC-Top-K rho 0.1 is then
several points behind dense), which matters to short runs.

Two byte counts. *Gradient bytes* are what the all-reduce carries as
gradient data, computed exactly from the shapes and the codec (and, for
ARC-Top-K, its dense warm-up step and its sketches): the measure the targets
name. *TCP bytes* (the table) are everything each peer's connections sent:
on top of the gradient, each all-reduce costs a peer about 2 kB (streams,
headers, authenticated framing) and each epoch its matchmaking, which do not
shrink with the codec. On the 9,610-parameter default model these weigh
heavily (ARC-Top-K runs two all-reduces per step); ``--hidden`` widens the
model to let the gradient dominate.

Targets, against dense measured in the same run: 8-bit within 0.5 accuracy
points at a quarter of the bytes; ARC-Top-K (rho 0.1) within 1 point at a
tenth of the gradient bytes or less. An 8-bit codec sends 8 of float32's 32
bits per value, plus here one float32 scale per 4,096 values: 25.02% of the
gradient bytes, a quarter plus the scales, which no codec with a scale per
block can undercut; its TCP bytes approach that share as the model grows.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, TextIO

import torch

from averaging import FLOAT16, UINT4, UINT8, AllReduceConfig, AveragerConfig, MatchmakingConfig
from dht import DHTConfig
from swarm import Identity, Peer, PeerConfig
from trainer import ArcTopK, CollaborativeConfig, DiLoCo, make_digits_task
from trainer._loop import TrainingConfig, TrainingReport, train

#: The configuration every method starts from (timeouts sized for loopback).
BASE = CollaborativeConfig(
    averaging=AveragerConfig(
        matchmaking=MatchmakingConfig(
            target_group_size=8,
            min_group_size=2,
            matchmaking_time=2.0,
            request_timeout=1.0,
            poll_interval=0.1,
        ),
        allreduce=AllReduceConfig(sender_timeout=2.0, reducer_timeout=4.0, round_timeout=10.0),
    ),
    averaging_timeout=15.0,
    progress_interval=0.2,
    progress_ttl=10.0,
    state_averaging_interval=0,
    load_state_timeout=10.0,
)


def _codec(codec: Any) -> Callable[[CollaborativeConfig], CollaborativeConfig]:
    return lambda base: replace(base, averaging=replace(base.averaging, codec=codec))


def _diloco(local_steps: int) -> Callable[[CollaborativeConfig], CollaborativeConfig]:
    return lambda base: replace(base, diloco=DiLoCo(local_steps=local_steps))


#: (name, config from BASE). A method is one line here.
METHODS: list[tuple[str, Callable[[CollaborativeConfig], CollaborativeConfig]]] = [
    ("dense", lambda base: base),
    ("float16", _codec(FLOAT16)),
    ("8-bit", _codec(UINT8)),
    ("4-bit", _codec(UINT4)),
    ("arc-topk-0.1", lambda base: replace(base, gradient_compression=ArcTopK(rho=0.1))),
    ("arc-topk-0.2", lambda base: replace(base, gradient_compression=ArcTopK(rho=0.2))),
    ("diloco-h10", _diloco(10)),
    ("diloco-h50", _diloco(50)),
]


@dataclass
class Result:
    method: str
    bytes_per_peer_epoch: float
    wall_s: float
    accuracy: float
    #: epochs run (outer steps for DiLoCo) and samples computed per peer
    steps: int = 0
    samples_per_peer: float = 0.0

    def public(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "bytes_per_peer_epoch": self.bytes_per_peer_epoch,
            "wall_s": self.wall_s,
            "accuracy": self.accuracy,
        }


def _run(name: str, config: CollaborativeConfig, args: argparse.Namespace, run: int) -> Result:
    task = make_digits_task(hidden=args.hidden)
    reports: list[TrainingReport | None] = [None] * args.peers
    errors: list[BaseException] = []
    with ExitStack() as stack:
        peers: list[Peer] = []
        for i in range(args.peers):
            initial = (peers[0].address,) if peers else ()
            peer_config = PeerConfig(
                initial_peers=initial, dht=DHTConfig(rpc_timeout=0.5, bootstrap_timeout=5.0)
            )
            seed = bytes([run * 16 + i + 1]) * 32
            peers.append(stack.enter_context(Peer(Identity.from_seed(seed), peer_config)))
        sent_before = [p.async_peer.connections.bytes_sent for p in peers]
        training = TrainingConfig(
            run_id=f"compression-{name}",
            target_batch_size=args.target_batch_size,
            batch_size=args.batch_size,
            max_epochs=args.epochs,
            eval_every=0,
            model_seed=0,
            min_peers=args.peers,
            load_state=False,  # same initial weights everywhere: no downloads to count
            optimizer=config,
        )

        def work(i: int) -> None:
            try:
                reports[i] = train(peers[i], task, replace(training, data_seed=i))
            except BaseException as e:  # reported below, after every thread is joined
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(args.peers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        sent = [
            p.async_peer.connections.bytes_sent - b for p, b in zip(peers, sent_before, strict=True)
        ]
    done = [r for r in reports if r is not None]
    return Result(
        method=name,
        bytes_per_peer_epoch=statistics.mean(sent) / args.epochs,
        wall_s=max(r.wall_seconds for r in done),
        accuracy=statistics.mean(r.metrics.get("accuracy", float("nan")) for r in done),
        steps=min(r.epochs for r in done),
        samples_per_peer=statistics.mean(r.samples for r in done),
    )


def gradient_share(method: str, shapes: list[tuple[int, ...]], epochs: int) -> float | None:
    """Gradient bytes of ``method`` over ``epochs`` global steps, as a share of
    dense float32's, from the shapes: what its all-reduces carry as values
    (codec scales included, stream and frame headers not). None for DiLoCo,
    whose epochs are outer steps of H local ones."""
    elements = sum(math.prod(shape) for shape in shapes)
    config = dict(METHODS)[method](BASE)
    if config.diloco is not None:
        return None
    compression = config.gradient_compression
    if isinstance(compression, ArcTopK):
        warm = min(compression.warmup_steps, epochs)
        # The warm-up steps are dense, in the compressor's codec.
        warm_bytes = compression.codec.payload_size(elements)
        total = warm * warm_bytes + (epochs - warm) * compression.payload_bytes(shapes)
        return total / (epochs * 4 * elements)
    return config.averaging.codec.payload_size(elements) / (4 * elements)


def _verdicts(results: list[Result], hidden: int, epochs: int) -> list[str]:
    dense = next((r for r in results if r.method == "dense"), None)
    if dense is None:
        return []
    model, _, _ = make_digits_task(hidden=hidden).build(seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    shares = {r.method: gradient_share(r.method, shapes, epochs) for r in results}
    lines = ["gradient bytes (from the shapes and codecs; see the docstring), share of dense:"]
    for method, share in shares.items():
        if share is not None:
            lines.append(f"      {method:<12} {share:7.2%}  (1/{1 / share:.3f})")
    targets = [("8-bit", 0.005, 4), ("arc-topk-0.1", 0.01, 10)]
    for method, points, factor in targets:
        row = next((r for r in results if r.method == method), None)
        if row is None:
            continue
        share = shares[method]
        assert share is not None
        tcp = dense.bytes_per_peer_epoch / max(1.0, row.bytes_per_peer_epoch)
        drop = dense.accuracy - row.accuracy
        ok = drop <= points and share <= 1 / factor
        lines.append(
            f"{'PASS' if ok else 'MISS'}  {method}: accuracy within {points * 100:g} points of "
            f"dense ({-drop * 100:+.2f}) at 1/{factor} of its gradient bytes or less "
            f"(1/{1 / share:.3f}; TCP bytes 1/{tcp:.2f})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--target-batch-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--hidden",
        type=int,
        default=128,
        help="width of the digits MLP (128: the task itself, 9,610 parameters); wider makes "
        "the gradient outweigh the fixed bytes of each round (matchmaking, framing)",
    )
    parser.add_argument(
        "--methods", nargs="+", default=[name for name, _ in METHODS], metavar="NAME"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    factories = dict(METHODS)
    unknown = [m for m in args.methods if m not in factories]
    if unknown:
        parser.error(f"unknown methods {unknown}: choose from {list(factories)}")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    results = [
        _run(name, factories[name](BASE), args, run) for run, name in enumerate(args.methods)
    ]
    out = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps([r.public() for r in results]))
    _table(results, args, time.monotonic() - started, out)


def _table(results: list[Result], args: argparse.Namespace, seconds: float, out: TextIO) -> None:
    print(
        f"digits (hidden {args.hidden}), {args.peers} peers in one process, "
        f"target batch {args.target_batch_size}, local batch {args.batch_size}, "
        f"{args.epochs} epochs, {os.cpu_count()} cores "
        f"({seconds:.0f}s)",
        file=out,
    )
    dense = next((r for r in results if r.method == "dense"), results[0])
    print(
        f"{'method':<12} {'epochs':>6} {'samples/peer':>12} {'bytes/peer/epoch':>16} "
        f"{'vs dense':>8} {'bytes/1k samples':>16} {'wall s':>7} {'accuracy':>8}",
        file=out,
    )
    for r in results:
        ratio = r.bytes_per_peer_epoch / max(1.0, dense.bytes_per_peer_epoch)
        per_sample = r.bytes_per_peer_epoch * r.steps / max(1.0, r.samples_per_peer) * 1000
        print(
            f"{r.method:<12} {r.steps:>6} {r.samples_per_peer:>12.0f} "
            f"{r.bytes_per_peer_epoch:>16,.0f} {ratio:>8.3f} {per_sample:>16,.0f} "
            f"{r.wall_s:>7.1f} {r.accuracy:>8.3f}",
            file=out,
        )
    for line in _verdicts(results, args.hidden, args.epochs):
        print(line, file=out)


if __name__ == "__main__":
    main()
