"""``AsyncCollaborativeOptimizer``: several peers train in one ``trio.run`` on
virtual time (``async_trainer_harness.held_clock``)."""

from __future__ import annotations

import itertools

import pytest
import torch
import trio
import trio.testing
from async_trainer_harness import held_clock
from peer_harness import open_peers, trio_wall_clock
from trainer_harness import FAST

from swarm import AsyncPeer, PeerID
from trainer import AsyncCollaborativeOptimizer, load_task

EPOCHS = 8
PEERS = 3


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    return held_clock(monkeypatch)


async def test_three_async_optimizers_train_digits_together(clock: trio.testing.MockClock) -> None:
    """Three peers that start together take every global step together: each
    step averages all three peers' data, and after each step every pair of
    them holds identical parameters (every pair is checked)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    task = load_task("digits")
    #: epoch -> peer -> (the step's contributors, the parameters after it)
    after: dict[int, dict[PeerID, tuple[frozenset[PeerID], list[torch.Tensor]]]] = {}
    accuracy: dict[PeerID, float] = {}

    async def train(peer: AsyncPeer, seed: int) -> None:
        model, inner, _ = task.build(seed=0)  # the same initial weights everywhere
        batches = task.batches(100 + seed, 32)
        async with AsyncCollaborativeOptimizer.open(
            peer,
            run_id="async-digits",
            params=model.parameters(),
            optimizer=inner,
            target_batch_size=192,
            batch_size_per_step=32,
            config=FAST,
        ) as opt:
            assert await opt.wait_for_peers(PEERS, timeout=60.0)
            for _ in range(EPOCHS * 20):  # bounded: ~2 batches per peer per step
                if opt.epoch >= EPOCHS:
                    break
                # the user's compute, on this thread: no virtual time passes
                loss, size = task.loss(model, next(batches))
                loss.backward()
                stepped = await opt.step(size, loss=loss.detach())
                opt.zero_grad()
                if stepped:
                    step = opt.last_step
                    assert step is not None
                    params = [p.detach().clone() for p in opt.params]
                    after.setdefault(opt.epoch, {})[peer.peer_id] = (step.contributors, params)
            assert opt.epoch == EPOCHS
            accuracy[peer.peer_id] = task.run_evaluation(model)["accuracy"]

    async with open_peers(PEERS, seed=3, clock=trio_wall_clock) as peers:
        everyone = frozenset(p.peer_id for p in peers.alive)
        async with trio.open_nursery() as nursery:
            for i, peer in enumerate(peers.alive):
                nursery.start_soon(train, peer, i)

    assert len(accuracy) == PEERS
    assert sorted(after) == list(range(1, EPOCHS + 1))
    for epoch, by_peer in after.items():
        assert set(by_peer) == everyone, epoch
        for contributors, _ in by_peer.values():
            assert contributors == everyone, (epoch, contributors)
        for (a, (_, pa)), (b, (_, pb)) in itertools.combinations(by_peer.items(), 2):
            for x, y in zip(pa, pb, strict=True):
                assert torch.equal(x, y), f"epoch {epoch}: {a.short()} and {b.short()} differ"
    assert min(accuracy.values()) > 0.5, accuracy  # it trains (8 steps of 192 samples)
