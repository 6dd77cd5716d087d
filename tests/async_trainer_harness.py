"""Many ``AsyncCollaborativeOptimizer`` peers in one ``trio.run`` on virtual time.

``train_together`` runs a few peers of one digits run there and records every
global step; the multi-peer tests of the trainer, DiLoCo, ARC-Top-K/EF21M and
DropCompute use it.

``held_clock`` is a ``MockClock`` that jumps to the next timer once the whole
process has been idle for 50 ms (every peer lives in this process and their
packets are on loopback, so idleness means everyone waits for a timer), and
that stands still while any worker thread of ``trio.to_thread.run_sync`` runs:
the optimizer's tensor work (accumulating, the inner step, staging, state
averaging's chunks) takes no virtual time, so a peer computing on a loaded
machine never misses a deadline that its compute would not miss in real time.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pytest
import torch
import trio
import trio.testing
from peer_harness import Peers, open_peers, trio_wall_clock

from swarm import AsyncPeer, PeerID, SwarmError
from trainer import AsyncCollaborativeOptimizer, CollaborativeConfig, GlobalStep, Task, load_task

T = TypeVar("T")

#: real seconds of idleness after which virtual time jumps to the next timer
IDLE = 0.05
#: the run ``train_together`` trains and a ``newcomer`` joins
RUN_ID = "digits-together"
S = TypeVar("S")


def held_clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """A clock for the test's trio run (return it from a fixture: pytest-trio
    uses a fixture that is a clock) whose autojump is held while any
    ``trio.to_thread.run_sync`` of the run computes."""
    clock = trio.testing.MockClock(autojump_threshold=IDLE)
    real = trio.to_thread.run_sync
    computing = 0

    async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        nonlocal computing
        computing += 1
        clock.autojump_threshold = math.inf
        try:
            return await real(fn, *args, **kwargs)
        finally:
            computing -= 1
            if computing == 0:
                clock.autojump_threshold = IDLE

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    return clock


@dataclass
class Together:
    """What a run of ``train_together`` did: for each peer, each global step it
    took and the tensors ``record`` copied right after it."""

    #: the peers, in the order of ``tasks`` and ``on_step``'s index
    peer_ids: list[PeerID]
    #: epoch -> peer -> (that peer's ``GlobalStep`` of the epoch, its tensors after it)
    after: dict[int, dict[PeerID, tuple[GlobalStep, list[torch.Tensor]]]] = field(
        default_factory=dict
    )
    accuracy: dict[PeerID, float] = field(default_factory=dict)
    #: peers killed during the run (``Peers.kill``) -> what their optimizer raised
    lost: dict[PeerID, SwarmError] = field(default_factory=dict)
    #: peer -> calls of ``step`` (micro-batches, or DiLoCo's local steps)
    local_steps: dict[PeerID, int] = field(default_factory=dict)
    #: epoch -> set once the first peer took that epoch's global step
    reached: defaultdict[int, trio.Event] = field(default_factory=lambda: defaultdict(trio.Event))

    @property
    def everyone(self) -> frozenset[PeerID]:
        return frozenset(self.peer_ids)

    def assert_every_step_taken_together(self, epochs: int) -> None:
        """Every peer took every global step with everyone's data in it, and
        after each step every pair of peers held identical tensors (every pair
        is compared, none is skipped)."""
        assert sorted(self.after) == list(range(1, epochs + 1))
        for epoch, by_peer in self.after.items():
            assert set(by_peer) == self.everyone, epoch
            for step, _ in by_peer.values():
                assert step.contributors == self.everyone, (epoch, step.contributors)
            for (a, (_, ta)), (b, (_, tb)) in itertools.combinations(by_peer.items(), 2):
                for x, y in zip(ta, tb, strict=True):
                    assert torch.equal(x, y), f"epoch {epoch}: {a.short()} and {b.short()} differ"


def parameters(opt: AsyncCollaborativeOptimizer) -> list[torch.Tensor]:
    """The parameters and the mode's shared tensors (DiLoCo's outer momentum,
    EF21M's shared estimate), copied: what peers that averaged together share."""
    tensors = [p.detach().clone() for p in opt.params]
    tensors += [t.detach().clone() for t in opt._strategy.state_tensors()]
    return tensors


async def train_together(
    config: CollaborativeConfig,
    *,
    epochs: int,
    peers: int = 3,
    clients: int = 0,
    seed: int = 3,
    run_id: str = RUN_ID,
    tasks: Sequence[Task[Any]] | None = None,
    compute_clocks: Sequence[Callable[[], float]] | None = None,
    on_step: Callable[[int, AsyncCollaborativeOptimizer], None] | None = None,
    meanwhile: Callable[[Peers, Together], Awaitable[None]] | None = None,
) -> Together:
    """``peers`` peers (and ``clients`` more in client mode, last) train
    digits (or ``tasks``) from the same initial weights
    in this ``trio.run`` (use ``held_clock``), each on its own data, with a
    target batch of 192 in micro-batches of 32, until each took ``epochs``
    global steps (``tasks`` and ``compute_clocks``: each peer's own, e.g. to
    charge its micro-batches to a virtual clock for DropCompute).
    ``on_step(i, opt)`` runs after each global step of peer ``i``;
    ``meanwhile(peers, together)`` runs beside the training (e.g. a newcomer
    that joins once ``together.reached[epoch]`` is set)."""
    tasks = tasks or [load_task("digits")] * (peers + clients)
    torch.manual_seed(0)
    torch.set_num_threads(1)

    async def train(i: int, peer: AsyncPeer, running: Peers, together: Together) -> None:
        try:
            await train_one(i, peer, together)
        except SwarmError as e:
            if peer in running.alive:
                raise
            together.lost[peer.peer_id] = e  # killed: its optimizer says it is closed

    async def train_one(i: int, peer: AsyncPeer, together: Together) -> None:
        task = tasks[i]
        model, inner, _ = task.build(seed=0)  # the same initial weights everywhere
        batches = task.batches(100 + i, 32)
        clock = time.monotonic if compute_clocks is None else compute_clocks[i]
        async with AsyncCollaborativeOptimizer.open(
            peer,
            run_id=run_id,
            params=model.parameters(),
            optimizer=inner,
            target_batch_size=192,
            batch_size_per_step=32,
            config=config,
            compute_clock=clock,
        ) as opt:
            assert await opt.wait_for_peers(peers + clients, timeout=60.0)
            calls = 0
            for _ in range(epochs * 40):  # bounded: a few micro-batches per global step
                if opt.epoch >= epochs:
                    break
                # the user's compute, on this thread: no virtual time passes
                loss, size = task.loss(model, next(batches))
                loss.backward()
                stepped = await opt.step(size, loss=loss.detach())
                opt.zero_grad()
                calls += 1
                if stepped:
                    assert opt.last_step is not None
                    by_peer = together.after.setdefault(opt.epoch, {})
                    by_peer[peer.peer_id] = (opt.last_step, parameters(opt))
                    if on_step is not None:
                        on_step(i, opt)
                    together.reached[opt.epoch].set()
            assert opt.epoch == epochs
            together.local_steps[peer.peer_id] = calls
            together.accuracy[peer.peer_id] = task.run_evaluation(model)["accuracy"]

    async with open_peers(peers, seed=seed, clock=trio_wall_clock) as running:
        for _ in range(clients):
            await running.add(client_mode=True)
        trainers = list(running.alive)
        together = Together(peer_ids=[p.peer_id for p in trainers])
        async with trio.open_nursery() as nursery:
            for i, peer in enumerate(trainers):
                nursery.start_soon(train, i, peer, running, together)
            if meanwhile is not None:
                nursery.start_soon(meanwhile, running, together)
    assert len(together.accuracy) + len(together.lost) == peers + clients
    return together


class Snapshots(Generic[S]):
    """What ``take(opt)`` copied right after each global step of each peer of
    ``train_together`` (pass ``on_step``), by (epoch, peer)."""

    def __init__(self, take: Callable[[AsyncCollaborativeOptimizer], S]) -> None:
        self._take = take
        self._taken: dict[tuple[int, PeerID], S] = {}
        self._events: defaultdict[tuple[int, PeerID], trio.Event] = defaultdict(trio.Event)

    def on_step(self, i: int, opt: AsyncCollaborativeOptimizer) -> None:
        key = (opt.epoch, opt.peer.peer_id)
        self._taken[key] = self._take(opt)
        self._events[key].set()

    async def of(self, epoch: int, peer: PeerID) -> S:
        """``peer``'s snapshot of ``epoch``, once it took it (a donor may donate
        the state of a step before its own ``step`` call returned)."""
        with trio.fail_after(30):
            await self._events[(epoch, peer)].wait()
        return self._taken[(epoch, peer)]


@asynccontextmanager
async def newcomer(
    peers: Peers, config: CollaborativeConfig, *, seed: int = 123
) -> AsyncIterator[AsyncCollaborativeOptimizer]:
    """A new peer of ``train_together``'s run, its optimizer open: built from
    ``seed`` (not the run's weights), so what it holds came from its donor."""
    model, inner, _ = load_task("digits").build(seed=seed)
    async with AsyncCollaborativeOptimizer.open(
        await peers.add(),
        run_id=RUN_ID,
        params=model.parameters(),
        optimizer=inner,
        target_batch_size=192,
        batch_size_per_step=32,
        config=config,
    ) as opt:
        yield opt
