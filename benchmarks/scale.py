"""Scale benchmark: N peers in one process on 127.0.0.1 run the collaborative step.

Every peer is a real ``swarm`` peer: a DHT node (real UDP, signed datagrams)
and TCP connections on one port. In each step every peer refreshes its
progress once through the trainer's own ``ProgressTracker`` (past
``directory_size`` peers: the aggregation tree for the totals, a sampled
directory of records by name) and does what the trainer does for the grid as
a round begins (``GridSchedule``: the grid of this epoch, known ahead; the
proposal for a later epoch and the read of the next one). Each peer's samples
grow at its own rate from the start, so the true total at any moment is known.
"grid agreed" is the share of peers whose grid for the step is the most
common one (100%: everyone computes the same group keys).

Then all peers average at once, as the trainer's gradient averager does
(``_begin_matchmaking`` and ``_finish_averaging``): an ``Averager`` with the
run's default ``AveragerConfig``, its matchmaking time and averaging timeout
from a ``RoundTiming`` per peer, the agreed grid, ``find_group`` with the
peers the progress reading expects, ``average`` (a few floats per peer, each
peer's values its index, so every average is checked against the mean of its
contributors) and the round settled into the timing. ``--no-averaging``
skips it; ``--average-from 3`` starts it with the third step. The grids of
epochs 0 and 1 are proposed as the peers join (``GridSchedule.cold_start``,
sized from each node's routing table), as the trainer's peers do; printed
before the steps: the nodes' size estimates and the grids agreed.

The clock is virtual by default (``--clock real``: the machine's): time moves
only when every peer waits for a timer, so the CPU that the N peers share
here costs none of their deadlines, as if each peer had a CPU of its own.
Between steps the peers compute ``--compute`` seconds (virtual: free).
A peer refreshes its progress once per step by default; the trainer's
tracker refreshes every ``progress_interval`` while its peer computes, and
``--refreshes K`` does that: K refreshes per peer and step, an interval
apart, the step's view from the last, its traffic and times from all K.

What a peer counts after a cold start. Every peer of a new run refreshes at
once, so a peer's first view holds what was published before its read: the
first ``--concurrency`` refreshes in flight (32) count each other alone. The
tree then carries each record up a level per refresh (a summary is written
from what its writer read), so every peer counts every peer after ``depth +
1`` = 3 refreshes. The least informed peer's count at refreshes 1, 2, 3: 256
peers 12.5%, 80.5%, 99.6% (the mean peer: 41%, 92%, 99.8%); 1,024 peers 3.1%,
44.7%, 99.8%, then 100% (the same before the routing fix of ``dht._routing``:
3.1%, 43.8%, 99.8%). That is the tree's convergence, not lost records: the
trainer's tracker refreshes every ``progress_interval`` (1 s) while its peer
computes, so it is a run's first ~3 s, not its first steps; with ``--refreshes
3`` at 256 peers the least informed peer counts 99.6% at step 1 (380 kB per
peer for the three refreshes). A run's first step, which ends on the samples
counted, may overshoot its target by those seconds' samples.

Printed per swarm size and step (the targets are judged on the last step,
after the tree has converged): the share of live peers and of samples that
the *least informed* peer counts, the DHT datagrams and bytes each peer sent
per step (requests and replies, all nodes' counters divided by N) and the
share of them signed rather than MAC'd (``dht._sessions``), the step's real
wall time, and the CPU time the process (all N peers) spent on it, also per
peer. With ``--baseline``, the same peers also run the old protocol (every
peer writes and reads the one key ``{run_id}.progress``) for comparison.
Then per step of averaging: the share of live peers in a group of at least 2,
the groups and their sizes, the peers whose values came back averaged over at
least 2 peers (and wrong ones, never expected), the matchmaking time (the last
peer's) and the round's (the clock's seconds) and its real seconds, the DHT
and TCP bytes each peer sent for it, the inbound connections refused for a
limit.

    python benchmarks/scale.py                      # 256 peers, 4 steps
    python benchmarks/scale.py --peers 256 1024 --steps 5
    python benchmarks/scale.py --peers 1024 --steps 10 --average-from 3
    python benchmarks/scale.py --peers 128 --baseline --no-averaging
    python benchmarks/scale.py --peers 64 --steps 3 --signature-cache 1  # ~no cache

Targets (issue 19): every live peer counted by every peer (at most 1% under);
bytes per peer per step at 1,024 peers no more than 2x those at 256; every
live peer in a group (and averaged) in every step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import trio
import trio.testing

import dht._records
from averaging import (
    Averager,
    AveragerConfig,
    GridAgreement,
    GridSchedule,
    Group,
    MoshpitGrid,
    StepResult,
)
from averaging._grid import choose, parse_proposals
from dht import DHTConfig, DHTNode
from dht._aio import open_asyncio_loop
from swarm import (
    AsyncPeer,
    ConnectionConfig,
    Identity,
    PeerConfig,
    WallClock,
    open_peer,
    system_clock,
)
from trainer import (
    PeerProgress,
    ProgressTracker,
    Reading,
    RoundTiming,
    TrackerConfig,
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
    #: the step's averaging round (None: not run, ``--no-averaging``)
    averaging: Averaging | None = None


@dataclass
class Averaging:
    """One step's averaging round across the swarm (the trainer's path: the
    agreed grid, adapted matchmaking time, ``Averager.find_group`` with the
    reading's expected peers, then ``Averager.average``)."""

    #: the share of live peers that were in a group of at least 2
    in_group: float
    groups: int
    #: group sizes: smallest, median, largest (0 without groups)
    size_min: int
    size_median: float
    size_max: int
    #: peers whose tensors came back averaged over at least 2 peers' values
    averaged: int
    #: peers whose average is not the mean of the contributors' values
    wrong: int
    #: seconds from the round's start to the last peer's group (or giving up)
    matchmaking_seconds: float
    #: the whole round (matchmaking and all-reduce), seconds
    round_seconds: float
    #: the round's real seconds (with ``--clock virtual``: the CPU time of all
    #: peers in this process, which the virtual clock does not count)
    real_seconds: float
    dht_bytes_per_peer: float
    tcp_bytes_per_peer: float
    #: inbound connections refused for a limit, summed over peers
    refused: int
    #: file descriptors the process holds after the round (sockets, mostly)
    open_files: int


async def _start(
    nursery: trio.Nursery, n: int, rng: random.Random, config: PeerConfig, clock: WallClock
) -> list[AsyncPeer]:
    """``n`` real peers (DHT node and TCP connections on one port each)."""
    peers: list[AsyncPeer] = []

    async def run(
        initial: tuple[str, ...], seed: bytes, task_status: trio.TaskStatus[AsyncPeer]
    ) -> None:
        peer_config = replace(config, initial_peers=initial)
        async with open_peer(Identity.from_seed(seed), peer_config, clock=clock) as peer:
            task_status.started(peer)
            await trio.sleep_forever()

    for i in range(n):
        initial = (peers[rng.randrange(i)].address,) if i else ()
        peers.append(await nursery.start(run, initial, rng.randbytes(32)))
    return peers


def _raise_open_files(n: int) -> None:
    """Each peer holds a listening TCP socket, a UDP socket and both ends of
    its connections to group-mates (all peers live in this process): allow
    a few dozen descriptors per peer, raising the hard limit if allowed."""
    wanted = 64 * n + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(wanted, hard), max(wanted, hard)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        print(f"open files limited to {hard} (wanted {wanted})", file=sys.stderr)


def _traffic(nodes: list[DHTNode]) -> tuple[int, int, int]:
    """Datagrams, bytes and signed datagrams all nodes have sent."""
    stats = [node.stats() for node in nodes]
    return (
        sum(s.sent_datagrams for s in stats),
        sum(s.sent_bytes for s in stats),
        sum(s.signed_datagrams for s in stats),
    )


#: the averaged tensor of each peer: a few floats, all equal to the peer's index
VALUES = 4


def _make_averager(peer: AsyncPeer, config: AveragerConfig, grid: MoshpitGrid) -> Averager:
    """The averager as the trainer makes its gradient averager
    (``_make_grad_averager``): the run's averaging config, the default grid
    until an agreed one is known."""
    return Averager(peer, [torch.zeros(VALUES)], prefix="scale.grads", config=config, grid=grid)


async def _average_once(
    averager: Averager, timing: RoundTiming, reading: Reading, grid: MoshpitGrid, step: int
) -> tuple[StepResult | None, Group | None, float]:
    """One peer's averaging round as the trainer runs it (``_begin_matchmaking``
    and ``_finish_averaging``): the adapted matchmaking time, the agreed grid,
    matchmaking with the peers the reading expects, the all-reduce within the
    adapted averaging timeout, and the timing settled. Returns the result
    (None: no group, or the all-reduce timed out), the group and the seconds
    matchmaking took."""
    size = max(1, reading.swarm.num_peers)
    matchmaking = averager.config.matchmaking
    averager.set_matchmaking_time(timing.matchmaking_time(size))
    averager.set_grid(grid)
    started = trio.current_time()
    group: Group | None = None
    with trio.move_on_after(matchmaking.bound + 1.0):
        group = await averager.find_group(round=step, expected_peers=reading.waits_for)
    matched = trio.current_time() - started
    result: StepResult | None = None
    took: float | None = None
    if group is not None:
        began = trio.current_time()
        with trio.move_on_after(timing.averaging_timeout(size)):
            result = await averager.average(group, 1.0)
            took = trio.current_time() - began
    expected = reading.waits_for
    count = len(expected) if isinstance(expected, frozenset) else expected
    wanted = min(count, matchmaking.target_group_size)
    timing.settle(group, took, wanted=wanted, one_group=grid.dimensions == 1, swarm_size=size)
    if group is None:
        averager.skip("no group formed in time")
    elif result is None:
        averager.skip("timed out during the all-reduce")
    return result, group, matched


def _wrong(result: StepResult, averager: Averager, index: dict[bytes, int]) -> bool:
    """Whether the averaged values differ from the mean of the contributors'
    (each peer's values are its index, all weights 1)."""
    contributors = [index[bytes(p)] for p in result.contributors]
    mean = sum(contributors) / len(contributors)
    return not torch.allclose(averager.tensors[0], torch.full((VALUES,), mean), rtol=1e-5)


async def _average_step(
    peers: list[AsyncPeer],
    averagers: list[Averager],
    timings: list[RoundTiming],
    readings: list[Reading],
    grids: list[MoshpitGrid],
    step: int,
) -> Averaging:
    """Every peer's averaging round of ``step`` at once, and what it did."""
    n = len(peers)
    index = {bytes(p.peer_id): i for i, p in enumerate(peers)}
    outcomes: list[tuple[StepResult | None, Group | None, float]] = [(None, None, 0.0)] * n

    async def one(i: int) -> None:
        averagers[i].tensors[0].fill_(float(i))
        outcomes[i] = await _average_once(averagers[i], timings[i], readings[i], grids[i], step)

    dht_before = _traffic([p.dht for p in peers])[1]
    tcp_before = sum(p.connections.bytes_sent for p in peers)
    started, real = trio.current_time(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    seconds = trio.current_time() - started
    real = time.perf_counter() - real
    groups = {g.group_id: g.size for _, g, _ in outcomes if g is not None}
    sizes = sorted(groups.values())
    averaged = [
        (i, r) for i, (r, _, _) in enumerate(outcomes) if r is not None and len(r.contributors) >= 2
    ]
    return Averaging(
        in_group=sum(g is not None and g.size >= 2 for _, g, _ in outcomes) / n,
        groups=len(groups),
        size_min=sizes[0] if sizes else 0,
        size_median=statistics.median(sizes) if sizes else 0.0,
        size_max=sizes[-1] if sizes else 0,
        averaged=len(averaged),
        wrong=sum(_wrong(r, averagers[i], index) for i, r in averaged),
        matchmaking_seconds=max(m for _, _, m in outcomes),
        round_seconds=seconds,
        real_seconds=real,
        dht_bytes_per_peer=(_traffic([p.dht for p in peers])[1] - dht_before) / n,
        tcp_bytes_per_peer=(sum(p.connections.bytes_sent for p in peers) - tcp_before) / n,
        refused=sum(p.connections.refused_inbound for p in peers),
        open_files=len(os.listdir("/proc/self/fd")),
    )


async def _refresh_between(
    trackers: list[ProgressTracker],
    limiter: trio.CapacityLimiter,
    rounds: int,
    config: TrackerConfig,
) -> None:
    """``rounds`` progress refreshes of every peer, ``progress_interval`` apart,
    before the step's own (``--refreshes``): the trainer's tracker refreshes
    every interval while its peer computes, not once per step."""

    async def one(tracker: ProgressTracker) -> None:
        async with limiter:
            await tracker.refresh()

    for _ in range(rounds):
        async with trio.open_nursery() as nursery:
            for tracker in trackers:
                nursery.start_soon(one, tracker)
        await trio.sleep(config.progress_interval)


def _trio_wall_clock() -> float:
    """A wall clock that follows trio's (``--clock virtual``): DHT expirations
    and matchmaking deadlines move with the virtual time."""
    return 1_700_000_000.0 + trio.current_time()


async def _run(n: int, args: argparse.Namespace) -> list[Row]:
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    # every peer dials from 127.0.0.1: the per-address inbound limit (meant
    # for one host opening many connections) would count the whole swarm.
    # A connection idle for 20 s (a compute phase and more) closes: Moshpit
    # changes group-mates every step, and here each connection holds two of
    # the process's descriptors (both ends)
    peer_config = PeerConfig(
        dht=DHTConfig(rpc_timeout=1.0, bootstrap_timeout=30.0),
        connections=ConnectionConfig(max_connections_per_address=256, idle_timeout=20.0),
    )
    rows = []
    async with open_asyncio_loop(), trio.open_nursery() as nursery:
        started = time.perf_counter()
        clock = _trio_wall_clock if args.clock == "virtual" else system_clock
        peers = await _start(nursery, n, rng, peer_config, clock)
        nodes = [peer.dht for peer in peers]
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
        averaging = AveragerConfig()
        agreement = GridAgreement(
            "scale", target_group_size=max(2, averaging.matchmaking.target_group_size)
        )
        schedules = [GridSchedule(agreement, node.peer_id) for node in nodes]
        # as the trainer's peers join: the grids of epochs 0 and 1, proposed at once
        estimates = sorted(node.size_estimate() for node in nodes)
        cold = 0

        async def cold_start(i: int) -> None:
            nonlocal cold
            async with limiter:
                stored = await schedules[i].cold_start(nodes[i], 0, nodes[i].size_estimate())
                cold += stored

        limiter = trio.CapacityLimiter(args.concurrency)
        async with trio.open_nursery() as inner:
            for i in range(n):
                inner.start_soon(cold_start, i)
        first = [
            choose(parse_proposals(await nodes[0].get(agreement.key(e))), e)
            for e in range(agreement.ahead)
        ]
        print(
            f"DHT size estimates min/median/max {estimates[0]}/{estimates[n // 2]}/"
            f"{estimates[-1]}; {cold} cold-start grid proposals; grids of epochs 0-1 "
            f"{', '.join('none' if g is None else f'{g.size}^{g.dimensions}' for g in first)}",
            file=sys.stderr,
        )
        # the peers compute a while before their first record: samples to count
        # (with the virtual clock, no time passes otherwise)
        await trio.sleep(config.progress_interval)
        averagers = [_make_averager(peer, averaging, agreement.default) for peer in peers]
        # the trainer's defaults: averaging_timeout 60 s, matchmaking_lead 1 s
        timings = [
            RoundTiming.for_rounds(
                averaging.matchmaking,
                averaging_timeout=60.0,
                matchmaking_lead=1.0,
                progress_interval=config.progress_interval,
            )
            for _ in peers
        ]
        readings: list[Reading | None] = [None] * n
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
                            reading = readings[i] = await trackers[i].refresh()
                            at = node.now()
                            counted = reading.swarm.samples
                            views[i] = (reading.swarm.num_peers, counted / (sum(rates) * (at - t0)))
                            schedule = schedules[i]
                            # within the trainer's bound (``_agreed_grid``)
                            timeout = averaging.matchmaking.request_timeout
                            agreed[i] = await schedule.grid(node, step, timeout=timeout)
                            # the trainer's estimate (``_grid_estimate``)
                            estimate = max(reading.swarm.num_peers, node.size_estimate())
                            await schedule.prepare(node, step, estimate)
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

                # the peers compute between global steps
                await trio.sleep(args.compute)
                before = _traffic(nodes)
                started = time.perf_counter()
                cpu_started = time.process_time()
                if protocol == "tree":
                    await _refresh_between(trackers, limiter, args.refreshes - 1, config)
                async with trio.open_nursery() as inner:
                    for i in range(n):
                        inner.start_soon(refresh, i)
                seconds = time.perf_counter() - started
                cpu = time.process_time() - cpu_started
                after = _traffic(nodes)
                first = [g for g in agreed if g is not None]
                common = max(first, key=first.count) if first else None
                round_ = None
                if protocol == "tree" and args.averaging and step + 1 >= args.average_from:
                    known = [r for r in readings if r is not None]
                    assert len(known) == n, "every peer has read its progress this step"
                    round_ = await _average_step(peers, averagers, timings, known, agreed, step)
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
                    round_,
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
                if round_ is not None:
                    print(
                        f"  [averaging] step {step + 1}: {round_.in_group:.1%} in a group, "
                        f"{round_.groups} groups of {round_.size_min}/{round_.size_median:g}/"
                        f"{round_.size_max}, {round_.averaged} averaged ({round_.wrong} wrong), "
                        f"matchmaking {round_.matchmaking_seconds:.1f}s, round "
                        f"{round_.round_seconds:.1f}s, {round_.dht_bytes_per_peer / 1000:.1f} kB "
                        f"DHT and {round_.tcp_bytes_per_peer / 1000:.1f} kB TCP per peer, "
                        f"{round_.open_files} files open",
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
    parser.add_argument(
        "--clock",
        choices=["virtual", "real"],
        default="virtual",
        help="virtual (default): timeouts count idle time only, not the CPU all peers share",
    )
    parser.add_argument(
        "--compute",
        type=float,
        default=10.0,
        help="seconds each peer computes before each step (virtual: they cost nothing)",
    )
    parser.add_argument(
        "--average-from",
        type=int,
        default=1,
        metavar="STEP",
        help="the first step that averages (1: from the cold start's grid on)",
    )
    parser.add_argument(
        "--no-averaging",
        dest="averaging",
        action="store_false",
        help="skip each step's averaging round (matchmaking and all-reduce)",
    )
    parser.add_argument(
        "--refreshes",
        type=int,
        default=1,
        help="progress refreshes per peer and step, a progress interval apart, the step's "
        "view from the last (the trainer's tracker refreshes every interval)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--signature-cache",
        type=int,
        default=dht._records.SIGNATURES.capacity,
        help="verified record signatures remembered (1: about none, the control)",
    )
    args = parser.parse_args()
    if args.refreshes < 1:
        parser.error("--refreshes must be at least 1")
    logging.basicConfig(level=logging.CRITICAL)
    dht._records.SIGNATURES = dht._records.SignatureCache(args.signature_cache)
    _raise_open_files(max(args.peers))
    rows: list[Row] = []
    for n in args.peers:
        # virtual: time moves only when every peer waits for a timer (idle
        # for 50 ms of real time), so the process's CPU, shared by all N
        # peers, costs none of it: each peer's deadlines run as if it had a
        # CPU of its own, as a volunteer does
        clock = trio.testing.MockClock(autojump_threshold=0.05) if args.clock == "virtual" else None
        rows += trio.run(_run, n, args, clock=clock)
    cache = dht._records.SIGNATURES
    print(
        f"record signatures: {cache.misses} verified, {cache.hits} from the cache "
        f"(capacity {cache.capacity})",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return
    _print_tables(rows)


def _print_tables(rows: list[Row]) -> None:
    """The progress table and the averaging table, with the targets' verdicts."""
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
    _print_averaging([r for r in rows if r.averaging is not None])


def _print_averaging(rows: list[Row]) -> None:
    """The averaging round of each step, and whether every live peer was in a
    group of at least 2 in every step (issue 19's target)."""
    if not rows:
        return
    print(
        f"{'peers':>6}{'step':>5}{'in group':>10}{'groups':>8}{'size min/med/max':>18}"
        f"{'averaged':>10}{'wrong':>7}{'match s':>9}{'round s':>9}{'real s':>8}{'DHT kB/peer':>13}"
        f"{'TCP kB/peer':>13}{'refused':>9}"
    )
    for r in rows:
        a = r.averaging
        assert a is not None
        sizes = f"{a.size_min}/{a.size_median:g}/{a.size_max}"
        print(
            f"{r.peers:>6}{r.steps:>5}{a.in_group:>10.1%}{a.groups:>8}{sizes:>18}"
            f"{a.averaged:>10}{a.wrong:>7}{a.matchmaking_seconds:>9.1f}{a.round_seconds:>9.1f}"
            f"{a.real_seconds:>8.0f}"
            f"{a.dht_bytes_per_peer / 1000:>13.1f}{a.tcp_bytes_per_peer / 1000:>13.1f}"
            f"{a.refused:>9}"
        )
    for n in sorted({r.peers for r in rows}):
        mine = [r.averaging for r in rows if r.peers == n and r.averaging is not None]
        ok = all(a.in_group == 1.0 and a.averaged == n for a in mine)
        worst = min(a.in_group for a in mine)
        verdict = "PASS" if ok and not any(a.wrong for a in mine) else "MISS"
        print(
            f"{verdict}  {n} peers: every live peer in a group and averaged in every step "
            f"(worst step: {worst:.1%} in a group)"
        )


if __name__ == "__main__":
    main()
