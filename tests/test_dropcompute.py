"""DropCompute: the threshold arithmetic, then three real peers, one straggling.

Compute time runs on a virtual clock per peer that each micro-batch advances
by its cost (the straggler's includes its injected delay), so epoch times are
exact; the peers run in one ``trio.run`` on trio's virtual clock, so no
assertion depends on the wall clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import trio
import trio.testing
from async_trainer_harness import held_clock, train_together
from trainer_harness import FAST

from swarm import ConfigError
from trainer import (
    AsyncCollaborativeOptimizer,
    CollaborativeConfig,
    DiLoCo,
    DropCompute,
    GlobalStep,
    Task,
    choose_threshold,
    load_task,
)
from trainer._dropcompute import ComputeBudget, MeasuredStep, expected_speed

# -- the threshold ---------------------------------------------------------------


def _step(*finish: float, communication: float = 1.0, samples: int = 1) -> MeasuredStep:
    return MeasuredStep(tuple(finish), (samples,) * len(finish), communication)


def test_a_step_stops_after_the_micro_batch_that_reaches_the_threshold() -> None:
    step = _step(1.0, 2.0, 3.0, 10.0, samples=8)
    assert step.cut(0.5) == (8, 1.0)
    assert step.cut(2.0) == (16, 2.0)
    assert step.cut(2.5) == (24, 3.0)
    assert step.cut(100.0) == (32, 10.0)


def test_expected_speed_counts_samples_over_compute_and_communication() -> None:
    steps = [_step(1.0, 2.0, communication=2.0), _step(1.0, 5.0, communication=2.0)]
    assert expected_speed(steps, 5.0) == pytest.approx(4 / (4.0 + 7.0))
    assert expected_speed(steps, 1.0) == pytest.approx(2 / 6.0)


def test_steady_compute_drops_nothing() -> None:
    steps = [_step(1.0, 2.0, 3.0, 4.0) for _ in range(5)]
    assert choose_threshold(steps) == 4.0


def test_a_stalling_tail_is_cut() -> None:
    # nine steady steps and one whose last micro-batch stalls: stopping after
    # three micro-batches loses a quarter of the samples and saves far more time
    steps = [_step(1.0, 2.0, 3.0, 4.0) for _ in range(9)] + [_step(1.0, 2.0, 3.0, 100.0)]
    assert choose_threshold(steps) == 3.0
    assert expected_speed(steps, 3.0) > expected_speed(steps, 100.0)


def test_ties_keep_the_larger_threshold() -> None:
    # with no communication every micro-batch is equally fast: drop nothing
    steps = [_step(1.0, 2.0, 3.0, communication=0.0)]
    assert choose_threshold(steps) == 3.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        choose_threshold([])
    with pytest.raises(ValueError):
        MeasuredStep((2.0, 1.0), (1, 1), 0.0)
    with pytest.raises(ValueError):
        MeasuredStep((1.0,), (1, 1), 0.0)
    with pytest.raises(ValueError):
        MeasuredStep((), (), 0.0)
    for bad in ({"threshold": 0.0}, {"threshold": float("inf")}, {"calibration_steps": 0}):
        with pytest.raises(ConfigError):
            DropCompute(**bad)  # type: ignore[arg-type]


class VirtualClock:
    """Compute time of one peer: advanced by its micro-batches, never by waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_calibrates_then_stops_at_its_threshold() -> None:
    clock = VirtualClock()
    budget = ComputeBudget(DropCompute(calibration_steps=3), clock)
    for step in range(3):
        budget.begin()
        for cost in (1.0, 1.0, 1.0, 50.0 if step == 1 else 1.0):
            clock.now += cost
            assert not budget.spent(32)  # no threshold while calibrating
        assert budget.end() == (53.0 if step == 1 else 4.0)
        clock.now += 0.5  # communication is on the clock too
    budget.begin()
    assert budget.threshold == 3.0
    assert [m.communication for m in budget.calibration] == [0.5, 0.5, 0.5]
    clock.now += 1.0
    assert not budget.spent(32)
    clock.now += 2.0
    assert budget.spent(32)


# -- three peers, one straggling ----------------------------------------------------


class Compute:
    """One peer's compute on its virtual clock: micro-batch ``m`` of an epoch
    (counted from 1) costs ``costs.get(m, 1.0)`` seconds."""

    def __init__(self, costs: dict[int, float] | None = None) -> None:
        self.clock = VirtualClock()
        self.costs = costs or {}
        self.in_epoch = 0

    def task(self) -> Task[Any]:
        task = load_task("digits")

        def loss(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
            self.in_epoch += 1
            self.clock.now += self.costs.get(self.in_epoch, 1.0)
            return task.loss(model, batch)

        return replace(task, loss=loss)


async def _train(
    config: CollaborativeConfig, computes: list[Compute], epochs: int, *, seed: int = 3
) -> tuple[float, list[float], list[dict[int, GlobalStep]]]:
    """Train three peers on virtual time; returns the compute time of all
    epochs (each lasts as long as its slowest peer's compute), the final
    accuracies, and each peer's ``GlobalStep`` by epoch."""
    marks: list[dict[int, float]] = [{0: 0.0} for _ in computes]

    def on_step(i: int, opt: AsyncCollaborativeOptimizer) -> None:
        computes[i].in_epoch = 0
        marks[i][opt.epoch] = computes[i].clock.now

    together = await train_together(
        config,
        epochs=epochs,
        seed=seed,
        tasks=[compute.task() for compute in computes],
        compute_clocks=[compute.clock for compute in computes],
        on_step=on_step,
    )
    total = 0.0
    for epoch in range(1, epochs + 1):
        lengths = [m[epoch] - m[epoch - 1] for m in marks if epoch in m and epoch - 1 in m]
        total += max(lengths)
    steps = [
        {epoch: by_peer[peer][0] for epoch, by_peer in together.after.items()}
        for peer in together.peer_ids
    ]
    return total, [together.accuracy[peer] for peer in together.peer_ids], steps


STRAGGLER = {1: 1.5, 2: 1.5, 3: 1.5, 4: 1.5, 5: 1.5, 6: 12.0}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    return held_clock(monkeypatch)


async def test_diloco_epochs_stop_waiting_for_a_straggler(clock: trio.testing.MockClock) -> None:
    """DiLoCo with H = 6 local steps of 1 s; one peer takes 1.5 s per local
    step and stalls for 10.5 s more in the last one of every round, so each
    outer step lasts 19.5 s. With a 7 s threshold that peer goes to the outer
    step after five local steps (7.5 s), the others are not cut (6 s), and the
    accuracy stays within a point of the run without delays (virtual delays
    change no real timing, so the first run, which measures the epoch time
    with delays, trains exactly as a run without)."""
    epochs = 20
    # a leader waits up to 5 s for every peer (the group closes as soon as all
    # three joined): exact epoch times need every outer step taken together,
    # also when other processes load the machine
    matchmaking = replace(FAST.averaging.matchmaking, matchmaking_time=5.0)
    patient = replace(FAST, averaging=replace(FAST.averaging, matchmaking=matchmaking))
    diloco = replace(patient, diloco=DiLoCo(local_steps=6))
    baseline, accuracy, _ = await _train(diloco, [Compute(), Compute(), Compute(STRAGGLER)], epochs)
    dropping = replace(diloco, drop_compute=DropCompute(threshold=7.0))
    total, dropped_accuracy, steps = await _train(
        dropping, [Compute(), Compute(), Compute(STRAGGLER)], epochs, seed=4
    )
    assert baseline == pytest.approx(19.5 * epochs)
    assert total == pytest.approx(7.5 * epochs)
    # the straggler averaged with the samples it computed, and said why
    assert all(s.stopped_early and s.samples == 5 * 32 for s in steps[2].values())
    assert all(not s.stopped_early and s.samples == 6 * 32 for s in steps[0].values())
    for a, b in zip(accuracy, dropped_accuracy, strict=True):
        assert abs(a - b) <= 0.01, (accuracy, dropped_accuracy)


async def test_a_straggler_stops_at_its_threshold_in_the_standard_mode(
    clock: trio.testing.MockClock,
) -> None:
    """Target 192 samples, 32 per micro-batch: a peer whose micro-batches take
    3 s ends its step after the first one, past the 2.5 s threshold, with the
    samples it computed as its weight; the others fill the global batch."""
    config = replace(FAST, drop_compute=DropCompute(threshold=2.5))
    slow = Compute(dict.fromkeys(range(1, 100), 3.0))
    _, accuracy, steps = await _train(config, [Compute(), Compute(), slow], 20)
    for step in steps[2].values():
        assert step.compute_seconds is not None and step.compute_seconds <= 2.5 + 3.0
        if step.stopped_early:
            assert step.samples == 32 * round(step.compute_seconds / 3.0)
    assert any(s.stopped_early for s in steps[2].values())
    assert all(a >= 0.85 for a in accuracy), accuracy
