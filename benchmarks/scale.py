"""Scale benchmark: N peers in one process on 127.0.0.1 run the progress protocol.

Every peer is a real DHT node (real UDP, signed datagrams). In each step every
peer refreshes its progress once through the trainer's own ``ProgressTracker``
(past ``directory_size`` peers: the aggregation tree for the totals, a sampled
directory of records by name) and does what the trainer does for the grid as
a round begins (``GridSchedule``: the grid of this epoch, known ahead; the
proposal for a later epoch and the read of the next one). Each peer's samples
grow at its own rate from the start, so the true total at any moment is known.
"grid agreed" is the share of peers whose grid for the step is the most
common one (100%: everyone computes the same group keys).

Printed per swarm size and step (the targets are judged on the last step,
after the tree has converged): the share of live peers and of samples that
the *least informed* peer counts, the DHT datagrams and bytes each peer sent per step (requests and
replies, all nodes' counters divided by N) and the share of them signed
rather than MAC'd (``dht._sessions``), the step's wall time, and the CPU time
the process (all N peers) spent on it, also per peer. With
``--baseline``, the same peers also run the old protocol (every peer writes
and reads the one key ``{run_id}.progress``) for comparison.

    python benchmarks/scale.py                      # 256 peers, 4 steps
    python benchmarks/scale.py --peers 256 1024 --steps 5
    python benchmarks/scale.py --peers 128 --baseline
    python benchmarks/scale.py --peers 64 --steps 3 --signature-cache 1  # ~no cache

Targets (issue 19): every live peer counted by every peer (at most 1% under);
bytes per peer per step at 1,024 peers no more than 2x those at 256.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import trio

import dht._records
from averaging import GridAgreement, GridSchedule
from dht import DHTConfig, DHTNode, open_dht_node
from dht._aio import open_asyncio_loop
from swarm import Identity
from trainer import (
    PeerProgress,
    ProgressTracker,
    TrackerConfig,
    estimate,
    parse_progress,
    progress_key,
)

TTL = 600.0


@dataclass
class Row:
    protocol: str
    peers: int
    steps: int
    min_peer_share: float
    mean_peer_share: float
    min_sample_share: float
    datagrams_per_peer_step: float
    bytes_per_peer_step: float
    #: the share of the step's datagrams that were signed, not MAC'd
    signed_share: float
    step_seconds: float
    #: CPU seconds of the whole process (all N peers) for the step
    cpu_seconds: float
    grid_agreed: float


async def _start(
    nursery: trio.Nursery, n: int, rng: random.Random, config: DHTConfig
) -> list[DHTNode]:
    nodes: list[DHTNode] = []

    async def run(initial: list[str], seed: bytes, task_status: trio.TaskStatus[DHTNode]) -> None:
        async with open_dht_node(
            Identity.from_seed(seed), host="127.0.0.1", initial_peers=initial, config=config
        ) as node:
            task_status.started(node)
            await trio.sleep_forever()

    for i in range(n):
        initial = [nodes[rng.randrange(i)].address] if i else []
        nodes.append(await nursery.start(run, initial, rng.randbytes(32)))
    return nodes


def _traffic(nodes: list[DHTNode]) -> tuple[int, int, int]:
    """Datagrams, bytes and signed datagrams all nodes have sent."""
    stats = [node.stats() for node in nodes]
    return (
        sum(s.sent_datagrams for s in stats),
        sum(s.sent_bytes for s in stats),
        sum(s.signed_datagrams for s in stats),
    )


async def _run(n: int, args: argparse.Namespace) -> list[Row]:
    rng = random.Random(args.seed)
    config = DHTConfig(rpc_timeout=1.0, bootstrap_timeout=30.0)
    rows = []
    async with open_asyncio_loop(), trio.open_nursery() as nursery:
        started = time.perf_counter()
        nodes = await _start(nursery, n, rng, config)
        print(f"{n} peers up in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        rates = [rng.uniform(5.0, 50.0) for _ in range(n)]
        t0 = nodes[0].now()
        config = TrackerConfig(progress_interval=1.0, progress_ttl=TTL)
        trackers = []
        for i, node in enumerate(nodes):

            def record(node: DHTNode = node, rate: float = rates[i]) -> PeerProgress:
                now = node.now()
                return PeerProgress(node.peer_id, 0, int(rate * (now - t0)), rate, now)

            trackers.append(
                ProgressTracker(
                    node, node.peer_id, "scale", record=record, target_batch_size=1, config=config
                )
            )
        agreement = GridAgreement("scale", target_group_size=16)
        schedules = [GridSchedule(agreement, node.peer_id) for node in nodes]
        limiter = trio.CapacityLimiter(args.concurrency)
        protocols = ["tree"] + (["single key"] if args.baseline else [])
        for protocol in protocols:
            #: per peer: peers counted, and samples counted as a share of the true total
            views: list[tuple[int, float]] = [(0, 0.0)] * n
            agreed: list[Any] = [None] * n
            for step in range(args.steps):

                async def refresh(
                    i: int,
                    step: int = step,
                    protocol: str = protocol,
                    views: list[tuple[int, float]] = views,
                    agreed: list[Any] = agreed,
                ) -> None:
                    async with limiter:
                        node = nodes[i]
                        now = node.now()
                        mine = PeerProgress(
                            node.peer_id, 0, int(rates[i] * (now - t0)), rates[i], now
                        )
                        if protocol == "tree":
                            reading = await trackers[i].refresh()
                            at = node.now()
                            counted = reading.swarm.samples
                            views[i] = (reading.swarm.num_peers, counted / (sum(rates) * (at - t0)))
                            schedule = schedules[i]
                            agreed[i] = await schedule.grid(node, step, timeout=1.0)
                            await schedule.prepare(node, step, reading.swarm.num_peers)
                        else:
                            await node.store(
                                progress_key("scale"),
                                mine.to_value(),
                                now + TTL,
                                subkey=f"[owner:{node.peer_id.hex()}]",
                            )
                            records = parse_progress(await node.get(progress_key("scale")))
                            at = node.now()
                            swarm = estimate(records, now=at, target_batch_size=1, stale_after=TTL)
                            views[i] = (swarm.num_peers, swarm.samples / (sum(rates) * (at - t0)))

                before = _traffic(nodes)
                started = time.perf_counter()
                cpu_started = time.process_time()
                async with trio.open_nursery() as inner:
                    for i in range(n):
                        inner.start_soon(refresh, i)
                seconds = time.perf_counter() - started
                cpu = time.process_time() - cpu_started
                after = _traffic(nodes)
                first = [g for g in agreed if g is not None]
                common = max(first, key=first.count) if first else None
                row = Row(
                    protocol,
                    n,
                    step + 1,
                    min(v[0] for v in views) / n,
                    sum(v[0] for v in views) / n / n,
                    min(v[1] for v in views),
                    (after[0] - before[0]) / n,
                    (after[1] - before[1]) / n,
                    (after[2] - before[2]) / max(1, after[0] - before[0]),
                    seconds,
                    cpu,
                    (sum(g == common for g in first) / n) if first else 0.0,
                )
                rows.append(row)
                print(
                    f"  [{protocol}] step {step + 1}: {row.min_peer_share:.1%} of peers counted "
                    f"by the least informed peer, {row.datagrams_per_peer_step:.0f} datagrams and "
                    f"{row.bytes_per_peer_step / 1000:.1f} kB per peer "
                    f"({row.signed_share:.0%} signed), {seconds:.0f}s "
                    f"({cpu / n * 1000:.0f} ms CPU per peer)",
                    file=sys.stderr,
                )
        nursery.cancel_scope.cancel()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32, help="refreshes in flight")
    parser.add_argument("--baseline", action="store_true", help="also run the single-key protocol")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--signature-cache",
        type=int,
        default=dht._records.SIGNATURES.capacity,
        help="verified record signatures remembered (1: about none, the control)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)
    dht._records.SIGNATURES = dht._records.SignatureCache(args.signature_cache)
    rows: list[Row] = []
    for n in args.peers:
        rows += trio.run(_run, n, args)
    cache = dht._records.SIGNATURES
    print(
        f"record signatures: {cache.misses} verified, {cache.hits} from the cache "
        f"(capacity {cache.capacity})",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return
    print(
        f"{'protocol':<12}{'peers':>6}{'step':>5}{'min peers':>10}{'mean':>8}{'min samples':>12}"
        f"{'dgrams/peer/step':>18}{'kB/peer/step':>14}{'signed':>8}{'step s':>8}{'CPU s':>8}"
        f"{'CPU ms/peer':>12}{'grid agreed':>12}"
    )
    for r in rows:
        print(
            f"{r.protocol:<12}{r.peers:>6}{r.steps:>5}{r.min_peer_share:>10.1%}"
            f"{r.mean_peer_share:>8.1%}{r.min_sample_share:>12.1%}"
            f"{r.datagrams_per_peer_step:>18.0f}{r.bytes_per_peer_step / 1000:>14.1f}"
            f"{r.signed_share:>8.0%}"
            f"{r.step_seconds:>8.0f}{r.cpu_seconds:>8.0f}{r.cpu_seconds / r.peers * 1000:>12.0f}"
            f"{r.grid_agreed:>12.0%}"
        )
    tree = {r.peers: r for r in rows if r.protocol == "tree"}
    if 256 in tree and 1024 in tree:
        ratio = tree[1024].bytes_per_peer_step / tree[256].bytes_per_peer_step
        verdict = "PASS" if ratio <= 2 else "MISS"
        print(f"{verdict}  bytes per peer per step, 1024 vs 256: {ratio:.2f}x <= 2x")
    for r in tree.values():
        ok = r.min_peer_share >= 0.99 and r.min_sample_share >= 0.99
        verdict = "PASS" if ok else "MISS"
        print(f"{verdict}  {r.peers} peers: every peer counts >= 99% of peers and samples")


if __name__ == "__main__":
    main()
