"""Event-loop latency of a peer while its training thread takes global steps.

A watchdog on the peer's trio thread sleeps ``--tick`` seconds over and over
and records how late each wake-up is. Meanwhile the training thread trains an
MLP of ``--params`` parameters (default 50M, Adam) alone: every
``--accumulation`` batches is one global step, whose inner optimizer step
(and any checkpoint capture) must not run on the trio thread, or the DHT's
replies and the all-reduce's streams wait for it. Reported: the largest and
the 99th-percentile lateness during training, against the same watchdog with
the training thread idle (the baseline of the same run).

    python benchmarks/event_loop.py                 # 50M parameters, 5 global steps
    python benchmarks/event_loop.py --params 5e6 --steps 3

With ``--allreduce CODEC`` it measures the all-reduce instead: ``--peers``
members on 127.0.0.1, all on the watchdog's event loop, average ``--params``
float32 values ``--steps`` times with that codec (none, float16, uint8,
uint4), whose encoding and decoding must not run on the event loop.

    python benchmarks/event_loop.py --allreduce uint8 --params 25e6 --steps 3
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from contextlib import AsyncExitStack
from functools import partial


def _summary(values: list[float]) -> str:
    ordered = sorted(values) or [math.nan]
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"max {1e3 * ordered[-1]:8.1f} ms   p99 {1e3 * p99:8.1f} ms   ({len(values)} ticks)"


def allreduce(args: argparse.Namespace) -> None:
    """``--allreduce``: the members' rounds share the watchdog's event loop."""
    import torch
    import trio

    from averaging import (
        FLOAT16,
        NONE,
        UINT4,
        UINT8,
        AllReduceConfig,
        Group,
        GroupMember,
        MemberMode,
        all_reduce,
    )
    from swarm import Identity, open_connections

    codecs = {"none": NONE, "float16": FLOAT16, "uint8": UINT8, "uint4": UINT4}
    codec = codecs[args.allreduce]
    size = int(args.params)
    config = AllReduceConfig(sender_timeout=300.0, reducer_timeout=600.0, round_timeout=1200.0)
    idle: list[float] = []
    busy: list[float] = []

    async def watchdog(late: list[list[float]]) -> None:
        while True:
            due = trio.current_time() + args.tick
            await trio.sleep_until(due)
            late[0].append(trio.current_time() - due)

    async def run() -> float:
        async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
            nets = [
                await stack.enter_async_context(
                    open_connections(Identity.from_seed(bytes([i + 1]) * 32))
                )
                for i in range(args.peers)
            ]
            members = tuple(
                GroupMember(net.peer_id, "127.0.0.1", net.port, 1.0, MemberMode.NODE)
                for net in nets
            )
            seeds = [torch.Generator().manual_seed(i) for i in range(len(nets))]
            vectors = [torch.randn(size, generator=seed) for seed in seeds]
            recording = [idle]
            nursery.start_soon(watchdog, recording)
            await trio.sleep(2.0)
            recording[0] = busy
            started = trio.current_time()
            for step in range(args.steps):
                group_id = f"event-loop-{step}".encode()
                async with trio.open_nursery() as rounds:
                    for i, net in enumerate(nets):
                        group = Group(group_id, members, i)
                        average = partial(all_reduce, codec=codec, config=config)
                        rounds.start_soon(average, net, group, [vectors[i]])
            seconds = trio.current_time() - started
            nursery.cancel_scope.cancel()
        return seconds

    seconds = trio.run(run)
    print(
        f"{args.peers} members, {size / 1e6:.1f}M float32, codec {args.allreduce}:"
        f" {args.steps} all-reduce rounds in {seconds:.1f}s"
    )
    print(f"trio timer lateness, idle:        {_summary(idle)}")
    print(f"trio timer lateness, all-reduce:  {_summary(busy)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--steps", type=int, default=5, help="global steps")
    parser.add_argument("--accumulation", type=int, default=2, help="batches per global step")
    parser.add_argument("--tick", type=float, default=0.01, help="watchdog period (s)")
    parser.add_argument("--allreduce", metavar="CODEC", help="measure all-reduce rounds instead")
    parser.add_argument("--peers", type=int, default=3, help="members of each all-reduce")
    args = parser.parse_args()
    if args.allreduce is not None:
        allreduce(args)
        return

    import torch
    import trio

    from swarm import Identity, Peer, PeerConfig
    from trainer import CollaborativeOptimizer

    width = 2048
    layers = max(1, round(args.params / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    count = sum(p.numel() for p in model.parameters())
    late: list[float] = []
    recording = threading.Event()

    async def watchdog(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            due = trio.current_time() + args.tick
            await trio.sleep_until(due)
            if recording.is_set():
                late.append(trio.current_time() - due)

    with Peer(Identity.from_seed(b"\x01" * 32), PeerConfig()) as peer:
        scope = peer.run(peer.async_peer.start_service, watchdog)
        recording.set()
        time.sleep(2.0)
        recording.clear()
        idle = list(late)
        late.clear()
        opt = CollaborativeOptimizer(
            peer,
            run_id="event-loop",
            params=model.parameters(),
            optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
            target_batch_size=8 * args.accumulation,
            batch_size_per_step=8,
        )
        x = torch.randn(8, width)
        with opt:
            recording.set()
            started = time.monotonic()
            for _ in range(1000 * args.steps):
                if opt.epoch >= args.steps:
                    break
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            seconds = time.monotonic() - started
            recording.clear()
        peer.run_sync(scope.cancel)
    print(f"{count / 1e6:.1f}M parameters, Adam, {args.steps} global steps in {seconds:.1f}s")
    print(f"trio timer lateness, idle:     {_summary(idle)}")
    print(f"trio timer lateness, training: {_summary(late)}")


if __name__ == "__main__":
    main()
