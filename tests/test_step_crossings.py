"""A ``step()`` that does not end a global step never waits on the peer's trio
thread; one that does waits on it once (the coordinator's whole global step)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
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


def test_a_peer_alone_crosses_no_more_once_its_reading_ages_epochs_behind() -> None:
    """A peer alone takes global steps in the training thread on one fresh
    reading, several in a row when its steps take milliseconds; when that
    reading then ages past a progress interval before the tracker's next one
    (a loaded machine: the refresh is late), a batch that does not end a step
    still does not wait on the trio thread."""
    torch.manual_seed(0)
    task = load_task("digits")
    model, inner, _ = task.build(seed=0)
    batches = task.batches(0, 32)
    # the tracker reads once a minute: every step below goes by one reading
    config = replace(FAST, progress_interval=60.0, progress_ttl=300.0)
    with CrossingPeer(Identity.from_seed(b"\x08" * 32), PeerConfig(dht=TEST_DHT)) as peer:
        opt = CollaborativeOptimizer(
            peer,
            run_id="aged-reading",
            params=model.parameters(),
            optimizer=inner,
            target_batch_size=2 * 32,
            batch_size_per_step=32,
            config=config,
        )
        with opt:

            def batch() -> bool:
                loss, size = task.loss(model, next(batches))
                loss.backward()
                stepped = opt.step(size)
                opt.zero_grad()
                return stepped

            for _ in range(8):  # bounded: two batches a step
                if opt.epoch >= 3:
                    break
                batch()
            core = opt._core
            reading = core._reading
            assert opt.epoch == 3 and reading is not None and reading.epoch <= 1
            core._progress.reading = replace(reading, time=reading.time - 120.0)  # aged
            before = peer.crossings
            assert not batch()
            assert peer.crossings == before
