"""Collaborative training in one process: three (then four) peers train digits
(on virtual time with the async optimizer; through the synchronous facade and
the training loop in threads)."""

from __future__ import annotations

import gc
import itertools
import logging
import statistics
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import trio
import trio.testing
from async_trainer_harness import Snapshots, Together, held_clock, newcomer, train_together
from peer_harness import Peers
from trainer_harness import (
    FAST,
    TrainingPeer,
    join_run,
    training_config,
    training_peers,
)

from swarm import ClosedError, NonFiniteError
from trainer import AsyncCollaborativeOptimizer, CollaborativeOptimizer, Task, load_task


def _fingerprint(opt: CollaborativeOptimizer | AsyncCollaborativeOptimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in opt.params]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    return held_clock(monkeypatch)


async def test_three_peers_train_digits_together(clock: trio.testing.MockClock) -> None:
    """Three peers on virtual time take 40 global steps together: every step
    averages all three peers' data, every pair holds identical parameters
    after each, and each step averages the target batch."""
    together = await train_together(FAST, epochs=40)
    together.assert_every_step_taken_together(40)
    assert min(together.accuracy.values()) >= 0.90, together.accuracy
    # The target batch on average (test_global_batch checks it closely). Each
    # step varies with when each peer read the others' counts, which the
    # machine's load moves (real-time rates on virtual time): over 40 steps on
    # an idle machine 128-288 (mean about 210); with three busy threads per
    # core once 320, and a mean of 233. A decision that overshot by a whole
    # target, or stepped early, would still fail.
    totals = {
        epoch: sum(step.samples for step, _ in by_peer.values())
        for epoch, by_peer in together.after.items()
    }
    assert 192 - 32 <= statistics.mean(totals.values()) <= 192 + 64, totals
    assert all(192 - 3 * 32 <= samples <= 2 * 192 for samples in totals.values()), totals


def _optimizer_tensors(
    opt: CollaborativeOptimizer | AsyncCollaborativeOptimizer,
) -> list[torch.Tensor]:
    tensors = []
    for p in opt.params:
        for value in opt.optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().clone())
    return tensors


async def test_a_newcomer_starts_from_the_swarms_exact_state(
    clock: trio.testing.MockClock,
) -> None:
    """A fourth peer joins after step 4: before it contributes anything it
    holds exactly the parameters and optimizer state of its donor's epoch."""
    snapshots = Snapshots(lambda opt: (_fingerprint(opt), _optimizer_tensors(opt)))
    joined: list[int] = []

    async def join(peers: Peers, together: Together) -> None:
        await together.reached[4].wait()
        async with newcomer(peers, FAST) as opt:
            assert opt.epoch >= 4 and opt.state_source is not None
            expected_params, expected_state = await snapshots.of(opt.epoch, opt.state_source)
            assert all(
                torch.equal(a, b) for a, b in zip(_fingerprint(opt), expected_params, strict=True)
            )
            assert all(
                torch.equal(a, b)
                for a, b in zip(_optimizer_tensors(opt), expected_state, strict=True)
            )
            joined.append(opt.epoch)

    together = await train_together(FAST, epochs=12, on_step=snapshots.on_step, meanwhile=join)
    assert joined and all(len(by_peer) == 3 for by_peer in together.after.values())


async def test_the_others_train_on_when_a_peer_is_killed(clock: trio.testing.MockClock) -> None:
    """A peer dies after step 3 (no goodbye, its progress record left behind):
    the two others take all 10 steps, none waiting longer than the averaging
    timeout plus an epoch's compute, and from step 5 on average together."""
    ended: defaultdict[int, list[float]] = defaultdict(list)

    def timer(i: int, opt: AsyncCollaborativeOptimizer) -> None:
        ended[i].append(trio.current_time())

    async def kill(peers: Peers, together: Together) -> None:
        await together.reached[3].wait()
        await peers.kill(peers.alive[2])

    together = await train_together(FAST, epochs=10, on_step=timer, meanwhile=kill)
    victim = together.peer_ids[2]
    assert list(together.lost) == [victim] and len(together.accuracy) == 2
    # its optimizer did not train on alone: its next step said the peer stopped
    assert isinstance(together.lost[victim], ClosedError), together.lost
    for i in (0, 1):
        assert len(ended[i]) == 10
        gaps = [b - a for a, b in itertools.pairwise(ended[i])]
        assert max(gaps) < FAST.averaging_timeout + 5.0, gaps
    survivors = frozenset(together.peer_ids[:2])
    for epoch in range(5, 11):
        for step, _ in together.after[epoch].values():
            assert step.contributors == survivors, (epoch, step.contributors)


def test_a_restarted_peer_resumes_from_its_checkpoint(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    torch.set_num_threads(1)
    directory = f"{tmp_path}/checkpoints"
    caplog.set_level(logging.INFO, logger="trainer")
    with training_peers(1) as (_, peers):
        config = training_config(
            0,
            max_epochs=3,
            eval_every=3,
            min_peers=1,
            checkpoint_dir=directory,
            optimizer=replace(FAST, checkpoint_every=1),
        )
        first = TrainingPeer(peers[0], config)
        saved: list[list[torch.Tensor]] = []
        first.start(on_epoch=lambda opt, report: saved.append(_fingerprint(opt)))
        assert first.join().epochs == 3
    # Epochs 1 to 3 are each saved once and evaluated once: closing at epoch 3
    # neither writes that checkpoint again nor evaluates the same model twice.
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if m.startswith("saved checkpoint")]) == 3
    assert len([m for m in messages if m.startswith("epoch 3 evaluation: ")]) == 1
    with training_peers(1) as (_, peers):
        resumed = join_run(peers[0], FAST, seed=99, checkpoint_dir=directory)
        try:
            assert resumed.epoch == 3
            assert all(
                torch.equal(a, b) for a, b in zip(_fingerprint(resumed), saved[-1], strict=True)
            )
        finally:
            resumed.close()


async def test_a_client_mode_peer_contributes_without_accepting_connections(
    clock: trio.testing.MockClock,
) -> None:
    """Two peers and a client (it dials out, accepts nothing) take every step
    together: the client's gradients are in every average."""
    together = await train_together(FAST, epochs=6, peers=2, clients=1)
    together.assert_every_step_taken_together(6)


def test_a_batch_with_nan_gradients_is_refused_and_changes_nothing() -> None:
    torch.set_num_threads(1)
    with training_peers(1) as (_, peers):
        opt = join_run(peers[0], FAST, seed=0)
        try:
            params = [p.detach().clone() for p in opt.params]
            for p in opt.params:
                p.grad = torch.ones_like(p)
            grad = opt.params[-1].grad
            assert grad is not None
            grad.view(-1)[0] = float("nan")
            with pytest.raises(NonFiniteError, match="not accumulated"):
                opt.step(32)
            assert all(not acc.any() for acc in opt._strategy.averaged)  # nothing accumulated
            grad.view(-1)[0] = 1.0
            assert opt.step(32) is False  # alone, 32 of 192 samples: no global step yet
            accumulated = opt._strategy.averaged
            assert all(torch.equal(acc, torch.full_like(acc, 32.0)) for acc in accumulated)
            assert all(torch.equal(p, q) for p, q in zip(opt.params, params, strict=True))
        finally:
            opt.close()


def _nan_losses(calls: Callable[[int], bool]) -> Task[Any]:
    """Digits, with a NaN loss on the calls (counted from 0) that ``calls`` picks."""
    digits = load_task("digits")
    count = itertools.count()

    def loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        value, size = digits.loss(model, batch)
        return (value * float("nan") if calls(next(count)) else value), size

    return replace(digits, loss=loss)


def test_the_loop_skips_a_nan_batch_and_stops_when_the_model_only_gives_nan() -> None:
    torch.set_num_threads(1)
    with training_peers(1) as (_, peers):
        trainer = TrainingPeer(peers[0], training_config(0, max_epochs=2, min_peers=1))
        trainer.start(task=_nan_losses(lambda call: call in (2, 3)))
        report = trainer.join()
    assert report.epochs == 2
    assert report.local_steps == 12  # 2 epochs of 192 samples in batches of 32; 2 skipped
    with training_peers(1) as (_, peers):
        trainer = TrainingPeer(peers[0], training_config(0, max_epochs=2, min_peers=1))
        trainer.start(task=_nan_losses(lambda call: call >= 4))
        with pytest.raises(NonFiniteError):
            trainer.join()


def test_a_dropped_optimizer_frees_its_tensors_at_once() -> None:
    """No reference cycle keeps a closed, dropped optimizer, and so its float32
    accumulators (on a GPU: device memory the size of the model in float32),
    alive until the cycle collector runs. (The model itself is then held only
    by the inner optimizer, which torch's own optimizers keep in a cycle once
    they stepped.)"""
    torch.set_num_threads(1)
    gc.disable()  # freed by reference counting alone
    try:
        with training_peers(1) as (_, (peer,)):
            model = torch.nn.Linear(10, 10)
            opt = CollaborativeOptimizer(
                peer,
                run_id="dropped",
                model=model,
                optimizer=torch.optim.AdamW(model.parameters()),
                target_batch_size=8,
                batch_size_per_step=8,
                config=FAST,
            )
            model(torch.randn(8, 10)).sum().backward()
            assert opt.step()
            core, accumulator = weakref.ref(opt._core), weakref.ref(opt._strategy.averaged[0])
            opt.close()
            del opt
            assert core() is None and accumulator() is None
    finally:
        gc.enable()


async def test_three_peers_train_digits_around_the_ring(
    clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``swarm train --ring``: the gradient rounds run the pipelined ring, and
    every step still averages every peer's data into identical parameters
    (each peer's contributors come from the ring's results)."""
    import averaging._allreduce as allreduce

    rings: list[bytes] = []
    real_ring = allreduce.ring_all_reduce

    async def counted(net: Any, group: Any, *args: Any) -> Any:
        outcome = await real_ring(net, group, *args)
        rings.append(group.group_id)  # finished: no fallback to the butterfly
        return outcome

    monkeypatch.setattr(allreduce, "ring_all_reduce", counted)
    averaging = replace(FAST.averaging, allreduce=replace(FAST.averaging.allreduce, ring=True))
    together = await train_together(replace(FAST, averaging=averaging), epochs=10)
    together.assert_every_step_taken_together(10)
    # three members per gradient round, each ran its ring to the end
    assert len(set(rings)) >= 10 and len(rings) == 3 * len(set(rings))
