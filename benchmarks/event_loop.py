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
"""

from __future__ import annotations

import argparse
import math
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--steps", type=int, default=5, help="global steps")
    parser.add_argument("--accumulation", type=int, default=2, help="batches per global step")
    parser.add_argument("--tick", type=float, default=0.01, help="watchdog period (s)")
    args = parser.parse_args()

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

    def summary(values: list[float]) -> str:
        ordered = sorted(values) or [math.nan]
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return f"max {1e3 * ordered[-1]:8.1f} ms   p99 {1e3 * p99:8.1f} ms   ({len(values)} ticks)"

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
    print(f"trio timer lateness, idle:     {summary(idle)}")
    print(f"trio timer lateness, training: {summary(late)}")


if __name__ == "__main__":
    main()
