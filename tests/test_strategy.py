"""The modes of the global step behind one interface, without a network.

What each strategy accumulates, what it puts up for averaging, and how it
applies the average, checked against plain PyTorch arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from averaging import AveragerConfig
from trainer import DenseGradients, DiLoCo, LocalSGD, Strategy, Trainee
from trainer._amp import zero_unless
from trainer._diloco import OuterLoop


def _trainee(*, lr: float = 0.5) -> Trainee:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]
    return Trainee(
        params=params,
        trained=params,
        optimizer=torch.optim.SGD(params, lr=lr),
        sync_model=lambda: None,
    )


def _backward(trainee: Trainee, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(trainee.params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def _global_step(strategy: Strategy, samples: int) -> object:
    """What the optimizer does around a step taken alone: prepare, stage, apply."""
    strategy.prepare(samples, strategy.averaged)
    strategy.staged(strategy.averaged)
    return strategy.apply(strategy.averaged, lambda: None)


def test_dense_gradients_apply_the_sample_weighted_mean_gradient() -> None:
    trainee = _trainee()
    before = [p.detach().clone() for p in trainee.params]
    strategy = DenseGradients(trainee)
    assert strategy.local_steps_left() is None  # the swarm's target ends the step
    g1 = [torch.full((3,), 1.0), torch.full((2, 2), 2.0)]
    g2 = [torch.full((3,), 4.0), None]  # the second parameter got no gradient here
    _backward(trainee, g1)
    strategy.accumulate(2)
    _backward(trainee, g2)
    strategy.accumulate(3)
    _global_step(strategy, 5)
    mean = [(2 * g1[0] + 3 * g2[0]) / 5, 2 * g1[1] / 5]
    for p, b, m in zip(trainee.params, before, mean, strict=True):
        assert torch.allclose(p.detach(), b - 0.5 * m)
    # the accumulators start over for the next step
    assert all(torch.count_nonzero(acc) == 0 for acc in strategy.averaged)


def test_a_batch_refused_on_the_device_adds_nothing_and_a_kept_one_adds_all() -> None:
    """``keep`` is the device's verdict, never read on the host: a refused
    batch holding NaN and Inf leaves the accumulators as they were."""
    trainee = _trainee()
    strategy = DenseGradients(trainee)
    good = [torch.full((3,), 1.0), torch.full((2, 2), 2.0)]
    _backward(trainee, good)
    strategy.accumulate(2, keep=torch.tensor(True))
    _backward(trainee, [torch.tensor([float("nan"), 1.0, float("inf")]), torch.full((2, 2), -3.0)])
    strategy.accumulate(5, keep=torch.tensor(False))
    for acc, g in zip(strategy.averaged, good, strict=True):
        assert torch.equal(acc.view_as(g), 2 * g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_zero_unless_zeroes_nan_and_inf_and_keeps_every_bit_otherwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    values = torch.randn(4, 6, generator=g).to(dtype)
    values[0, 0], values[1, 2], values[2, 3] = float("nan"), float("inf"), float("-inf")
    values[3, 1] = -0.0
    strided = values.clone().t()  # not contiguous: a view of the same width works too
    kept, zeroed = [values.clone(), strided.clone()], [values.clone(), strided.clone()]
    zero_unless(torch.tensor(True), kept)
    zero_unless(torch.tensor(False), zeroed)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)

    for t, original in zip(kept, [values, strided], strict=True):
        assert torch.equal(bits(t), bits(original))  # NaN, -0.0 and all
    for t in zeroed:
        assert torch.count_nonzero(bits(t)) == 0  # +0.0


def test_a_parameter_without_gradient_in_the_whole_step_keeps_grad_none() -> None:
    trainee = _trainee()
    seen: list[list[torch.Tensor | None]] = []
    hooked = Trainee(
        params=trainee.params,
        trained=trainee.trained,
        optimizer=trainee.optimizer,
        sync_model=trainee.sync_model,
        grad_hook=lambda ps: seen.append([p.grad for p in ps]) or "norm",
    )
    strategy = DenseGradients(hooked)
    _backward(hooked, [torch.ones(3), None])
    strategy.accumulate(1)
    assert _global_step(strategy, 1) == "norm"  # the hook's result is returned
    assert seen[0][0] is not None and seen[0][1] is None


def test_local_sgd_steps_locally_then_applies_the_averaged_pseudo_gradient() -> None:
    trainee = _trainee(lr=0.1)
    start = [p.detach().clone() for p in trainee.params]
    config = DiLoCo(local_steps=2, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    strategy = LocalSGD(trainee, OuterLoop(trainee.params, config))
    assert strategy.prefix_suffix == "diloco"
    for left in (1, 0):
        _backward(trainee, [torch.ones(3), torch.ones(2, 2)])
        strategy.accumulate(4)  # an inner step now
        assert strategy.local_steps_left() == left
    moved = [p.detach().clone() for p in trainee.params]
    assert not torch.equal(moved[0], start[0])
    strategy.prepare(8, strategy.averaged)
    for delta, s, m in zip(strategy.averaged, start, moved, strict=True):
        assert torch.allclose(delta, s - m)  # the way back to the last sync
    _global_step(strategy, 8)
    # outer SGD with lr 1 and no momentum applies the whole pseudo-gradient
    for p, m in zip(trainee.params, moved, strict=True):
        assert torch.allclose(p.detach(), m)
    assert strategy.local_steps_left() == 2


def test_mode_state_is_named_by_its_mode_and_a_missing_one_resyncs_local_sgd() -> None:
    trainee = _trainee()
    assert DenseGradients(trainee).mode_state() == {}
    strategy = LocalSGD(trainee, OuterLoop(trainee.params, DiLoCo(local_steps=3)))
    assert set(strategy.mode_state()) == {"diloco"}
    _backward(trainee, [torch.ones(3), torch.ones(2, 2)])
    strategy.accumulate(1)
    strategy.load_mode_state({})  # saved by a run without DiLoCo: start from here
    assert strategy.local_steps_left() == 3
    for s, p in zip(strategy.shared_params(), trainee.params, strict=True):
        assert torch.equal(s, p.detach())


@pytest.mark.parametrize("bad", [{"diloco": {}}, {"diloco": {"momentum": [torch.zeros(1)]}}])
def test_local_sgd_refuses_a_state_that_does_not_fit(bad: dict[str, object]) -> None:
    from swarm import ProtocolError

    trainee = _trainee()
    strategy = LocalSGD(trainee, OuterLoop(trainee.params, DiLoCo(local_steps=3)))
    with pytest.raises(ProtocolError):
        strategy.load_mode_state(bad)


def test_every_mode_keeps_the_declared_upload_rate_and_its_pacing() -> None:
    """A mode changes what its averager averages (lossy, a codec), never the
    link it runs on: ``swarm train --upload-rate`` reaches every mode."""
    run = AveragerConfig().with_upload_rate(2.5e6)
    trainee = _trainee()
    for strategy in (
        DenseGradients(trainee),
        DenseGradients(trainee, lossy=True),
        LocalSGD(trainee, OuterLoop(trainee.params, DiLoCo(local_steps=3))),
    ):
        config = strategy.averager_config(run)
        assert config.upload_rate == 2.5e6
        assert config.allreduce.upload_pacing == run.allreduce.upload_pacing


async def test_only_dense_gradients_carry_riding_tensors() -> None:
    """Only the dense mode's round carries other tensors (a lossy run's
    parameters, ``trainer._drift``); the others refuse before any network."""
    from swarm import ConfigError
    from trainer import ArcTopK, CompressedGradients
    from trainer._ef21m import EF21M

    trainee = _trainee()
    riding = [torch.zeros(7)]
    for strategy in (
        LocalSGD(trainee, OuterLoop(trainee.params, DiLoCo(local_steps=3))),
        CompressedGradients(trainee, EF21M(trainee.params, ArcTopK())),
    ):
        with pytest.raises(ConfigError, match="nothing rides"):
            await strategy.average(None, None, [], 1.0, 0, riding=riding)  # type: ignore[arg-type]
