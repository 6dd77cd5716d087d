"""Collaborative training in one process: three (then four) peers train digits."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from trainer_harness import (
    FAST,
    TEST_DHT,
    TrainingPeer,
    join_run,
    training_config,
    training_peers,
    whole_group,
)

from swarm import NonFiniteError, SwarmError
from trainer import CollaborativeOptimizer, Task, load_task


def _fingerprint(opt: CollaborativeOptimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in opt.params]


def test_three_peers_train_digits_together() -> None:
    torch.set_num_threads(1)
    params: dict[int, dict[int, list[torch.Tensor]]] = {}
    groups: dict[int, dict[int, tuple[bytes, ...]]] = {}
    samples: dict[int, dict[int, int]] = {}
    #: peers whose every step so far averaged every chunk with the whole group
    clean = {0: True, 1: True, 2: True}
    lock = threading.Lock()

    def recorder(i: int):  # type: ignore[no-untyped-def]
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            step = opt.last_step
            assert step is not None
            with lock:
                samples.setdefault(step.epoch, {})[i] = step.samples
                clean[i] = clean[i] and whole_group(opt)
                if clean[i] and step.averaging is not None:
                    params.setdefault(opt.epoch, {})[i] = _fingerprint(opt)
                    groups.setdefault(opt.epoch, {})[i] = step.averaging.members

        return on_epoch

    with training_peers(3) as (_, peers):
        trainers = [TrainingPeer(p, training_config(i, max_epochs=40)) for i, p in enumerate(peers)]
        for i, t in enumerate(trainers):
            t.start(on_epoch=recorder(i))
        reports = [t.join() for t in trainers]

    for report in reports:
        assert report.epochs == 40
        assert report.metrics["accuracy"] >= 0.90, report.metrics
    # every global step consumed the target batch, summed over the peers, give
    # or take one local batch per peer (test_global_batch checks it closely)
    for epoch, by_peer in samples.items():
        if len(by_peer) == 3:
            assert sum(by_peer.values()) >= 192 - 3 * 32, (epoch, by_peer)
    # peers that always averaged every chunk together hold identical parameters
    # (a step where a member missed a deadline leaves the peers apart until the
    # next parameter averaging, as designed)
    compared = 0
    for epoch, by_peer in params.items():
        for i, j in [(0, 1), (0, 2), (1, 2)]:
            if i in by_peer and j in by_peer and groups[epoch][i] == groups[epoch][j]:
                for a, b in zip(by_peer[i], by_peer[j], strict=True):
                    assert torch.equal(a, b), f"epoch {epoch}: peers {i} and {j} differ"
                compared += 1
    assert compared >= 1


def _optimizer_tensors(opt: CollaborativeOptimizer) -> list[torch.Tensor]:
    tensors = []
    for p in opt.params:
        for value in opt.optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().clone())
    return tensors


def test_a_newcomer_starts_from_the_swarms_exact_state() -> None:
    torch.set_num_threads(1)
    snapshots: dict[tuple[int, bytes], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    recorded = threading.Condition()

    def record(opt: CollaborativeOptimizer, report: object) -> None:
        with recorded:
            key = (opt.epoch, bytes(opt.peer.peer_id))
            snapshots[key] = (_fingerprint(opt), _optimizer_tensors(opt))
            recorded.notify_all()

    reached = threading.Event()

    def record_and_signal(opt: CollaborativeOptimizer, report: object) -> None:
        record(opt, report)
        if opt.epoch >= 4:
            reached.set()

    with training_peers(4) as (_, peers):
        trainers = [
            TrainingPeer(p, training_config(i, max_epochs=12)) for i, p in enumerate(peers[:3])
        ]
        trainers[0].start(on_epoch=record_and_signal)
        for t in trainers[1:]:
            t.start(on_epoch=record)
        assert reached.wait(60)
        # a fourth peer joins mid-run: before it contributes anything it must
        # hold exactly the parameters and optimizer state of the swarm's epoch
        newcomer = join_run(peers[3], trainers[0].config.optimizer, seed=123)
        try:
            epoch = newcomer.epoch
            assert epoch >= 4 and newcomer.state_source is not None
            key = (epoch, bytes(newcomer.state_source))
            with recorded:  # the donor records its epoch right after stepping
                assert recorded.wait_for(lambda: key in snapshots, timeout=30)
                expected_params, expected_state = snapshots[key]
            assert all(
                torch.equal(a, b)
                for a, b in zip(_fingerprint(newcomer), expected_params, strict=True)
            )
            assert all(
                torch.equal(a, b)
                for a, b in zip(_optimizer_tensors(newcomer), expected_state, strict=True)
            )
        finally:
            newcomer.close()
        for t in trainers:
            assert t.join().epochs == 12


def test_the_others_train_on_when_a_peer_is_killed() -> None:
    torch.set_num_threads(1)
    epoch_times: dict[int, list[float]] = {0: [], 1: []}

    def timer(i: int):  # type: ignore[no-untyped-def]
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            epoch_times[i].append(time.monotonic())

        return on_epoch

    with training_peers(3) as (_, peers):
        victim_peer = peers[2]

        def kill_at_epoch_3(opt: CollaborativeOptimizer, report: object) -> None:
            if opt.epoch == 3:
                victim_peer.close()  # the process "dies": no goodbye, record left behind

        trainers = [TrainingPeer(p, training_config(i, max_epochs=10)) for i, p in enumerate(peers)]
        trainers[0].start(on_epoch=timer(0))
        trainers[1].start(on_epoch=timer(1))
        trainers[2].start(on_epoch=kill_at_epoch_3)
        survivors = [trainers[0].join(), trainers[1].join()]
        with pytest.raises(SwarmError):
            trainers[2].join()
    bound = FAST.averaging_timeout + 5.0  # averaging timeout plus an epoch's compute
    for i, report in enumerate(survivors):
        assert report.epochs == 10
        gaps = [b - a for a, b in itertools.pairwise(epoch_times[i])]
        assert max(gaps) < bound, gaps


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


def test_a_client_mode_peer_contributes_without_accepting_connections() -> None:
    torch.set_num_threads(1)
    members: list[int] = []
    with training_peers(2) as (stack, peers):
        from swarm import Identity, Peer, PeerConfig

        client = stack.enter_context(
            Peer(
                Identity.from_seed(b"c" * 32),
                PeerConfig(
                    initial_peers=(peers[0].address,),
                    client_mode=True,
                    dht=TEST_DHT,
                ),
            )
        )
        trainers = [
            TrainingPeer(p, training_config(i, max_epochs=6))
            for i, p in enumerate([*peers, client])
        ]
        for t in trainers[:2]:
            t.start()

        def record(opt: CollaborativeOptimizer, report: object) -> None:
            step = opt.last_step
            if step is not None and step.averaging is not None:
                members.append(len(step.averaging.members))

        trainers[2].start(on_epoch=record)
        reports = [t.join() for t in trainers]
    assert all(r.epochs == 6 for r in reports)
    # the client averaged in groups with the others: its gradients counted
    assert members and max(members) == 3


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
