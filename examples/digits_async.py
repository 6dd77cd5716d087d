"""Collaborative training inside one ``trio.run``: ``open_peer`` and the
``AsyncCollaborativeOptimizer``.

Runs ``--peers`` peers (default 2) of one swarm in this process on
127.0.0.1, each training the digits task for ``--max-epochs`` global steps,
then prints each peer's test accuracy::

    .venv/bin/python examples/digits_async.py --peers 2 --max-epochs 5

Each peer's forward and backward pass runs in a worker thread
(``trio.to_thread.run_sync``), as the optimizer's own tensor work does, so the
peer's event loop keeps answering the DHT and the all-reduce meanwhile. One
peer per process is the same code with ``initial_peers`` of another machine.
"""

from __future__ import annotations

import argparse
import sys

import torch
import trio

from averaging import AveragerConfig, MatchmakingConfig
from swarm import AsyncPeer, Identity, PeerConfig, open_peer
from trainer import AsyncCollaborativeOptimizer, CollaborativeConfig, load_task


async def train_one(
    peer: AsyncPeer, seed: int, peers: int, epochs: int, config: CollaborativeConfig
) -> float:
    """Train one peer of the swarm for ``epochs`` global steps; its test accuracy."""
    task = load_task("digits")
    model, inner, scheduler = task.build(seed=0)  # every peer: the same initial weights
    batches = task.batches(seed, 32)  # this peer's data order

    def forward_backward() -> tuple[torch.Tensor, int]:
        loss, samples = task.loss(model, next(batches))
        loss.backward()
        return loss.detach(), samples

    async with AsyncCollaborativeOptimizer.open(
        peer,
        run_id="digits-async",
        model=model,
        optimizer=inner,
        scheduler=scheduler,
        target_batch_size=128,
        batch_size_per_step=32,
        config=config,
    ) as opt:
        await opt.wait_for_peers(peers, timeout=60.0)  # start together
        while opt.epoch < epochs:
            loss, samples = await trio.to_thread.run_sync(forward_backward)
            await opt.step(samples, loss=loss)  # True when the swarm took a global step
            opt.zero_grad()
        return task.run_evaluation(model)["accuracy"]


async def main_async(peers: int, epochs: int) -> list[float]:
    config = CollaborativeConfig(
        averaging=AveragerConfig(
            matchmaking=MatchmakingConfig(matchmaking_time=1.0, poll_interval=0.2)
        ),
        progress_interval=0.5,
    )
    accuracies = [0.0] * peers
    async with open_peer(Identity.from_seed(b"\x01" * 32), PeerConfig(host="127.0.0.1")) as first:
        others = PeerConfig(host="127.0.0.1", initial_peers=(first.address,))

        async def run(i: int) -> None:
            if i == 0:
                accuracies[0] = await train_one(first, 0, peers, epochs, config)
                return
            async with open_peer(Identity.from_seed(bytes([i + 1]) * 32), others) as peer:
                accuracies[i] = await train_one(peer, i, peers, epochs, config)

        async with trio.open_nursery() as nursery:
            for i in range(peers):
                nursery.start_soon(run, i)
    return accuracies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Several async peers train the digits task.")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=5, help="global steps to train")
    args = parser.parse_args(argv)
    if args.peers < 1 or args.max_epochs < 1:
        parser.error("--peers and --max-epochs must be at least 1")
    torch.set_num_threads(1)  # the model is tiny: more threads only add overhead
    for i, accuracy in enumerate(trio.run(main_async, args.peers, args.max_epochs)):
        print(f"peer {i}: test accuracy {accuracy:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
