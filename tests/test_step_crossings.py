"""A ``step()`` that does not end a global step never waits on the peer's trio
thread; one that does waits on it once (the coordinator's whole global step)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import torch
from trainer_harness import FAST, TEST_DHT

from swarm import Identity, Peer, PeerConfig
from trainer import CollaborativeOptimizer, load_task

T = TypeVar("T")


class CrossingPeer(Peer):
    """The real sync peer, counting the calls that wait on its trio thread."""

    crossings = 0

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        self.crossings += 1
        return super().run(fn, *args)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        self.crossings += 1
        return super().run_sync(fn, *args)


def test_only_the_step_that_ends_an_epoch_crosses_into_trio() -> None:
    torch.manual_seed(0)
    task = load_task("digits")
    model, inner, _ = task.build(seed=0)
    batches = task.batches(0, 32)
    with CrossingPeer(Identity.from_seed(b"\x07" * 32), PeerConfig(dht=TEST_DHT)) as peer:
        opt = CollaborativeOptimizer(
            peer,
            run_id="crossings",
            params=model.parameters(),
            optimizer=inner,
            target_batch_size=10 * 32,
            batch_size_per_step=32,
            config=FAST,
        )
        with opt:
            for epoch in range(3):
                for i in range(10):
                    loss, size = task.loss(model, next(batches))
                    loss.backward()
                    before = peer.crossings
                    stepped = opt.step(size, loss=loss.detach())
                    opt.zero_grad()
                    assert stepped == (i == 9), (epoch, i)
                    if stepped:
                        assert peer.crossings - before <= 1, (epoch, i, peer.crossings - before)
                    else:
                        assert peer.crossings == before, (epoch, i)
                assert opt.epoch == epoch + 1
