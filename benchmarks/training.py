"""Training benchmark: the digits task with 1, 2 and 4 peers at one target batch size.

Each peer is its own process on 127.0.0.1 (as on real machines; threads would
share one interpreter lock). For each swarm size it reports the wall time per
epoch (one global step), the share of wall time the peers spent averaging and
waiting for the swarm, the samples each global step averaged (the summed weight
of the group that averaged it: the samples of the peers whose data is in the
average; the promise is the target batch, give or take one local batch per
peer), how many steps a peer took alone (no group formed: its own samples
only, not counted as a global step) and the test accuracy after a fixed
number of epochs.
The single peer is the baseline measured in the same run: it never averages.

    python benchmarks/training.py                      # 1, 2, 4 peers, 20 epochs
    python benchmarks/training.py --peers 1 4 --epochs 20 --json
    python benchmarks/training.py --peers 2 4 --epochs 8 --fixed-timing  # no RoundTiming
    python benchmarks/training.py --cli-defaults --peers 1 2 4 8 --epochs 40

``--cli-defaults`` trains with exactly what ``swarm train`` uses when given no
options (its target batch, matchmaking time, averaging timeout and state
averaging; ``--target-batch-size`` is ignored), evaluates after every epoch
and adds the time each swarm took until its peers' mean accuracy first
reached 90%.

Target: averaging and waiting below 15% of wall time with 4 peers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Result:
    peers: int
    epoch_s: float
    averaging_share: float
    accuracy: float
    #: samples per global step (the summed weight of each group that
    #: averaged, over its contributors): mean and largest
    samples_mean: float
    samples_max: int
    #: peer-steps taken alone (no group, or no other contributor)
    alone: int = 0
    #: seconds from the start until the peers' mean accuracy first reached
    #: 90% (``--cli-defaults``; None: never, or not evaluated each epoch)
    to_90: float | None = None


def _worker(args: argparse.Namespace) -> None:
    """One peer: join (or start) the swarm, train, print a JSON report."""
    import torch

    from swarm import Identity, Peer, PeerConfig
    from trainer import load_task
    from trainer._loop import train

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    training = _as_the_cli(args) if args.cli_defaults else _benchmark_settings(args)
    initial = (args.initial_peer,) if args.initial_peer else ()
    peer_config = PeerConfig(initial_peers=initial)
    with Peer(Identity.from_seed(bytes([args.index + 1]) * 32), peer_config) as peer:
        print(json.dumps({"address": peer.address}), flush=True)
        if args.index == 0 and args.peers > 1:
            sys.stdin.readline()  # wait until every peer has joined: start together
        #: epoch -> [this peer's samples, group id (hex), contributors (hex)]
        samples: dict[int, list[Any]] = {}
        #: epoch -> [seconds since this peer's training started, accuracy]
        accuracy: dict[int, list[float]] = {}
        started: list[float] = []

        def on_epoch(opt: Any, report: Any) -> None:
            _record_step(opt, samples)
            if training.eval_every == 1:
                seconds = time.monotonic() - started[0]
                accuracy[opt.epoch] = [seconds, report.metrics.get("accuracy", float("nan"))]

        report = train(
            peer,
            load_task("digits"),
            training,
            on_start=lambda _opt: started.append(time.monotonic()),
            on_epoch=on_epoch,
        )
        _print_report(report, peer, samples, accuracy)


def _benchmark_settings(args: argparse.Namespace) -> Any:
    """The benchmark's own settings: short timeouts, no state averaging."""
    from averaging import AllReduceConfig, AveragerConfig, MatchmakingConfig
    from trainer import CollaborativeConfig
    from trainer._loop import TrainingConfig

    config = CollaborativeConfig(
        averaging=AveragerConfig(
            matchmaking=MatchmakingConfig(
                target_group_size=16, matchmaking_time=2.0, request_timeout=1.0, poll_interval=0.1
            ),
            allreduce=AllReduceConfig(sender_timeout=2.0, reducer_timeout=4.0, round_timeout=10.0),
        ),
        averaging_timeout=15.0,
        progress_interval=0.2,
        progress_ttl=10.0,
        state_averaging_interval=0,
        load_state_timeout=10.0,
        adaptive_timing=not args.fixed_timing,
    )
    return TrainingConfig(
        run_id="bench",
        target_batch_size=args.target_batch_size,
        batch_size=args.batch_size,
        max_epochs=args.epochs,
        eval_every=0,
        data_seed=args.index,
        optimizer=config,
        # start together: a peer that began before the others joined
        # trained its first steps alone (each a whole target batch),
        # which at a few epochs was most of what was measured
        min_peers=args.peers,
        min_peers_timeout=60.0,
        load_state=False,  # every peer starts from the same weights
    )


def _as_the_cli(args: argparse.Namespace) -> Any:
    """``--cli-defaults``: what ``swarm train`` with no options trains with
    (its parser and config builders), evaluated after every epoch."""
    from swarm.cli import _collaborative_config, build_parser
    from trainer._loop import TrainingConfig

    cli = build_parser().parse_args(["train"])
    return TrainingConfig(
        run_id="bench",
        target_batch_size=cli.target_batch_size,
        batch_size=cli.batch_size,
        max_epochs=args.epochs,
        eval_every=1,
        data_seed=args.index,
        optimizer=_collaborative_config(cli),
        min_peers=args.peers,
        min_peers_timeout=60.0,
        load_state=False,
    )


def _record_step(opt: Any, samples: dict[int, list[Any]]) -> None:
    """This peer's samples, group id and contributors of its last global step."""
    step = opt.last_step
    if step is not None:
        averaging = step.averaging
        group = None if averaging is None else averaging.group_id
        samples[step.epoch] = [
            step.samples,
            None if group is None else group.hex(),
            sorted(bytes(p).hex() for p in step.contributors),
        ]


def _print_report(
    report: Any, peer: Any, samples: dict[int, list[Any]], accuracy: dict[int, list[float]]
) -> None:
    print(
        json.dumps(
            {
                "wall_s": report.wall_seconds,
                "averaging_s": report.averaging_seconds,
                "epochs": report.epochs,
                "accuracy": report.metrics.get("accuracy", float("nan")),
                "peer_id": bytes(peer.peer_id).hex(),
                "samples": samples,
                "by_epoch": accuracy,
            }
        ),
        flush=True,
    )


def _time_to(reports: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the peers' mean accuracy after an epoch first reached
    ``target`` (the slowest peer's time to that epoch), if it did."""
    epochs = set.intersection(*(set(r["by_epoch"]) for r in reports)) if reports else set()
    for epoch in sorted(epochs, key=int):
        if statistics.mean(r["by_epoch"][epoch][1] for r in reports) >= target:
            return max(r["by_epoch"][epoch][0] for r in reports)
    return None


def _run_swarm(n: int, args: argparse.Namespace) -> Result:
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--peers",
        str(n),
        "--epochs",
        str(args.epochs),
        "--target-batch-size",
        str(args.target_batch_size),
        "--batch-size",
        str(args.batch_size),
        *(["--fixed-timing"] if args.fixed_timing else []),
        *(["--cli-defaults"] if args.cli_defaults else []),
    ]
    procs: list[subprocess.Popen[str]] = []
    try:
        first = subprocess.Popen(
            [*base, "--index", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        procs.append(first)
        assert first.stdout is not None and first.stdin is not None
        address = json.loads(first.stdout.readline())["address"]
        for i in range(1, n):
            p = subprocess.Popen(
                [*base, "--index", str(i), "--initial-peer", address],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(p)
            assert p.stdout is not None
            json.loads(p.stdout.readline())
        if n > 1:
            first.stdin.write("go\n")
            first.stdin.flush()
        reports = []
        for p in procs:
            assert p.stdout is not None
            reports.append(json.loads(p.stdout.readline()))
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    wall = statistics.mean(r["wall_s"] for r in reports)
    averaging = statistics.mean(r["averaging_s"] for r in reports)
    epochs = min(r["epochs"] for r in reports)
    steps, alone = _group_weights(reports, alone_is_global=n == 1)
    steps = steps or [0]
    return Result(
        n,
        wall / max(1, epochs),
        averaging / wall,
        statistics.mean(r["accuracy"] for r in reports),
        statistics.mean(steps),
        max(steps),
        alone,
        _time_to(reports, 0.9),
    )


def _group_weights(
    reports: list[dict[str, Any]], *, alone_is_global: bool
) -> tuple[list[int], int]:
    """The summed weight of every group that averaged a global step (the
    samples of its contributors, each counted once), and how many peer-steps
    were taken alone. In a swarm of several peers a step taken alone is no
    global step (the sum of such peers' samples would be a batch nobody
    averaged); a single peer's steps are (``alone_is_global``)."""
    by_peer = {r["peer_id"]: r["samples"] for r in reports}
    groups: dict[tuple[str, str], int] = {}
    alone = 0
    for r in reports:
        for epoch, (count, group, contributors) in r["samples"].items():
            if group is None or len(contributors) < 2:
                alone += 1
                if alone_is_global:
                    groups[(epoch, r["peer_id"])] = count
                continue
            # members may see different contributors (a failed part): the
            # largest view is the group's weight in some element of the average
            weight = sum(by_peer[c][epoch][0] for c in contributors if epoch in by_peer.get(c, {}))
            groups[(epoch, group)] = max(weight, groups.get((epoch, group), 0))
    return list(groups.values()), alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--target-batch-size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--fixed-timing",
        action="store_true",
        help="the configured matchmaking time and averaging timeout, not adapted (RoundTiming)",
    )
    parser.add_argument(
        "--cli-defaults",
        action="store_true",
        help="train as `swarm train` with no options; evaluate every epoch (time to 90%%)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if isinstance(args.peers, list):
            args.peers = args.peers[0]
        _worker(args)
        return
    started = time.monotonic()
    results = [_run_swarm(n, args) for n in args.peers]
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
        return
    target, local = args.target_batch_size, args.batch_size
    if args.cli_defaults:
        from swarm.cli import build_parser

        cli = build_parser().parse_args(["train"])
        target, local = cli.target_batch_size, cli.batch_size or "the task's"
    print(
        f"digits, target batch {target}, local batch {local}, {args.epochs} epochs,"
        f"{' swarm train defaults,' if args.cli_defaults else ''}"
        f" {os.cpu_count()} cores ({time.monotonic() - started:.0f}s)"
    )
    print(
        f"{'peers':>5}  {'s/epoch':>8}  {'averaging+waiting':>17}  {'accuracy':>8}"
        f"  {'samples/step (mean, max)':>24}  {'alone':>5}  {'to 90%':>7}"
    )
    for r in results:
        ratio = r.samples_mean / target
        to_90 = "-" if r.to_90 is None else f"{r.to_90:.1f}s"
        print(
            f"{r.peers:>5}  {r.epoch_s:>8.3f}  {r.averaging_share:>17.1%}  {r.accuracy:>8.3f}"
            f"  {r.samples_mean:>9.0f} ({ratio:.2f}x) {r.samples_max:>6}  {r.alone:>5}"
            f"  {to_90:>7}"
        )
    largest = max(results, key=lambda r: r.peers)
    verdict = "PASS" if largest.averaging_share < 0.15 else "MISS"
    print(
        f"{verdict}  averaging+waiting with {largest.peers} peers < 15% "
        f"({largest.averaging_share:.1%})"
    )


if __name__ == "__main__":
    main()
