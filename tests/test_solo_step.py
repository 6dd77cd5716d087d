"""A peer alone takes its global steps in the training thread: no crossing to
the peer's trio thread (on a GPU each cost a small model milliseconds), and
the same steps as plain accumulated training. A checkpoint still goes
through the trio thread."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_harness import FAST, training_peers

from swarm import Peer
from trainer import CollaborativeOptimizer, DropCompute

BATCH = 8
#: one reading lasts the whole test: every step is decided from it
STILL = replace(FAST, progress_interval=60.0, progress_ttl=120.0)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, 6, generator=g) for _ in range(n)]


def _alone(
    peer: Peer, model: torch.nn.Module, run_id: str, *, target: int, **kwargs: Any
) -> CollaborativeOptimizer:
    """One peer's optimizer: SGD, micro-batches of ``BATCH``, ``STILL`` unless given."""
    return CollaborativeOptimizer(
        peer,
        run_id=run_id,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        target_batch_size=target,
        batch_size_per_step=BATCH,
        config=kwargs.pop("config", STILL),
        **kwargs,
    )


class _Crossings:
    """Counts ``peer.run`` calls: the training thread's crossings to the trio thread."""

    def __init__(self, peer: Peer) -> None:
        self.count = 0
        self._run = peer.run
        peer.run = self  # type: ignore[method-assign]

    def __call__(self, fn: Any, *args: Any) -> Any:
        self.count += 1
        return self._run(fn, *args)


def test_a_peer_alone_steps_as_plain_training_without_crossing_threads() -> None:
    torch.set_num_threads(1)
    model, plain = _model(), _model()
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    batches = _batches(8)
    with training_peers(1) as (_, (peer,)):
        opt = _alone(peer, model, "solo", target=2 * BATCH)
        try:
            assert opt.wait_for_peers(1, 10.0)  # the reading every step is decided from
            crossings = _Crossings(peer)
            stepped = []
            for x in batches:
                model(x).pow(2).mean().backward()
                stepped.append(opt.step())
                opt.zero_grad()
            crossed = crossings.count
        finally:
            opt.close()
    assert stepped == [False, True] * 4 and opt.epoch == 4
    assert crossed == 0
    step = opt.last_step
    assert step is not None and step.samples == 2 * BATCH and step.averaging is None
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        for x in (first, second):
            (plain(x).pow(2).mean() / 2).backward()
        reference.step()
        reference.zero_grad()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_step_that_writes_a_checkpoint_goes_through_the_trio_thread(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = _model()
    with training_peers(1) as (_, (peer,)):
        opt = _alone(
            peer,
            model,
            "solo-checkpoint",
            target=BATCH,
            config=replace(STILL, checkpoint_every=2),
            checkpoint_dir=tmp_path,
            load_state=False,
        )
        try:
            assert opt.wait_for_peers(1, 10.0)
            crossings = _Crossings(peer)
            for x in _batches(4):
                model(x).pow(2).mean().backward()
                assert opt.step()
                opt.zero_grad()
            # epochs 1 and 3 in the training thread, 2 and 4 with their checkpoints
            assert crossings.count == 2 and opt.epoch == 4
            written = sorted(p.name for p in tmp_path.glob("checkpoint-*.swarm"))
            assert written == ["checkpoint-0000000002.swarm", "checkpoint-0000000004.swarm"]
        finally:
            opt.close()


class _ComputeClock:
    """A peer's compute time (DropCompute's clock), advanced by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("target", "cost", "steps_after", "early"),
    [
        (8, 1.0, 3, True),  # 3 s of compute pass the 2.5 s threshold before the target
        (2, 1.5, 2, False),  # the target and the threshold (3 s) both: the target ended it
    ],
)
def test_a_peer_alone_records_whether_its_drop_compute_threshold_ended_the_step(
    target: int, cost: float, steps_after: int, early: bool
) -> None:
    """DropCompute alone, in the training thread: a step that the threshold
    ends is recorded as stopped early, with the samples it has; one that the
    target ends is not, as in a step with others (``_target_reached``)."""
    torch.set_num_threads(1)
    model = _model()
    compute = _ComputeClock()
    config = replace(STILL, drop_compute=DropCompute(threshold=2.5))
    with training_peers(1) as (_, (peer,)):
        opt = _alone(
            peer, model, "solo-drop", target=target * BATCH, config=config, compute_clock=compute
        )
        try:
            assert opt.wait_for_peers(1, 10.0)
            crossings = _Crossings(peer)
            stepped = []
            for x in _batches(2 * steps_after):
                model(x).pow(2).mean().backward()
                compute.now += cost
                stepped.append(opt.step())
                opt.zero_grad()
            crossed = crossings.count
        finally:
            opt.close()
    assert stepped == ([False] * (steps_after - 1) + [True]) * 2
    assert crossed == 0  # decided in the training thread
    step = opt.last_step
    assert step is not None and step.samples == steps_after * BATCH
    assert step.stopped_early is early
    assert step.compute_seconds == pytest.approx(steps_after * cost)


def test_a_declared_upload_rate_reaches_the_optimizers_averager() -> None:
    """``CollaborativeConfig(averaging=AveragerConfig().with_upload_rate(...))``
    (what ``swarm train --upload-rate`` builds): the gradient averager paces
    its all-reduce under the rate and announces the rate as its upload."""
    averaging = STILL.averaging.with_upload_rate(2.5e6)
    with training_peers(1) as (_, (peer,)):
        opt = _alone(
            peer, _model(), "declared", target=2 * BATCH, config=replace(STILL, averaging=averaging)
        )
        try:
            config = opt._grad_averager.config
            assert config.allreduce.upload_pacing == averaging.allreduce.upload_pacing
            assert opt._grad_averager._member().upload == 2.5e6
        finally:
            opt.close()
