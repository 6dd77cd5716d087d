"""The inner optimizer offloaded to host memory (``offload_optimizer``): the
same steps as without it, checkpoints that resume either way, and the
configurations it cannot serve refused."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from trainer_harness import FAST, training_peers

from swarm import ConfigError, Peer
from trainer import CollaborativeConfig, CollaborativeOptimizer, DiLoCo

STEPS = 3


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    return model.to(dtype)


def _optimizer(
    peer: Peer, model: torch.nn.Module, offload: bool, checkpoint_dir: Path | None = None
) -> CollaborativeOptimizer:
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return CollaborativeOptimizer(
        peer,
        run_id="offload",
        model=model,
        optimizer=inner,
        target_batch_size=8,
        batch_size_per_step=8,
        config=replace(FAST, offload_optimizer=offload, checkpoint_every=1),
        checkpoint_dir=checkpoint_dir,
    )


def _train(opt: CollaborativeOptimizer, model: torch.nn.Module, epochs: int) -> None:
    """Global steps until ``epochs``, each on the batch of its epoch (a lone
    peer's batch is repeated until its step is global: the mean gradient is
    that batch's either way)."""
    dtype = next(model.parameters()).dtype
    data = torch.randn(epochs, 8, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    for _ in range(2000):  # bounded: far more than a few global steps need
        if opt.epoch >= epochs:
            return
        model(data[opt.epoch]).float().pow(2).mean().backward()
        if not opt.step():
            time.sleep(0.005)
        opt.zero_grad()
    raise AssertionError(f"only {opt.epoch} of {epochs} global steps")


def _state(opt: CollaborativeOptimizer) -> list[torch.Tensor]:
    """The inner optimizer's state tensors, parameter by parameter."""
    inner = opt.optimizer
    return [
        value
        for group in inner.param_groups
        for p in group["params"]
        for value in inner.state[p].values()
        if isinstance(value, torch.Tensor) and value.dim()
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_steps_equal_the_plain_ones(dtype: torch.dtype) -> None:
    """float32: the plain path steps the model's own tensors; bfloat16: it
    steps float32 masters on the device. Offloaded, both step host masters."""
    results: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for offload in (False, True):
        with training_peers(1) as (_, (peer,)):
            model = _model(dtype)
            with _optimizer(peer, model, offload) as opt:
                _train(opt, model, STEPS)
                masters = opt.optimizer.param_groups[0]["params"]
                if offload:
                    # the inner optimizer updates host copies, not the model's tensors;
                    # GradScaler still sees the model's parameters
                    assert all(m.device.type == "cpu" for m in masters)
                    assert all(m is not p for m, p in zip(masters, model.parameters(), strict=True))
                    assert opt.param_groups[0]["params"][0] is model[0].weight
                    for m, p in zip(masters, model.parameters(), strict=True):
                        assert m.dtype == torch.float32
                        assert torch.equal(m.detach().to(dtype), p.detach())
                results[offload] = (
                    [p.detach().clone() for p in model.parameters()],
                    [t.clone() for t in _state(opt)],
                )
    (plain_params, plain_state), (params, state) = results[False], results[True]
    assert len(state) == len(plain_state) == 2 * len(plain_params)  # AdamW's two moments
    for a, b in zip(params + state, plain_params + plain_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the steps did move the model
    assert not torch.equal(plain_params[0], _model(dtype)[0].weight.detach())


@pytest.mark.parametrize("resume_offloaded", [True, False])
def test_an_offloaded_checkpoint_resumes_with_or_without_offloading(
    tmp_path: Path, resume_offloaded: bool
) -> None:
    with training_peers(1) as (_, (peer,)):
        model = _model()
        with _optimizer(peer, model, True, tmp_path) as opt:
            _train(opt, model, 2)
            saved_params = [p.detach().clone() for p in model.parameters()]
            saved_state = [t.clone() for t in _state(opt)]
    with training_peers(1) as (_, (peer,)):
        torch.manual_seed(5)  # other initial weights: all must come from the checkpoint
        fresh = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3)
        )
        with _optimizer(peer, fresh, resume_offloaded, tmp_path) as resumed:
            assert resumed.epoch == 2
            for a, b in zip(fresh.parameters(), saved_params, strict=True):
                assert torch.equal(a.detach(), b)
            for a, b in zip(_state(resumed), saved_state, strict=True):
                assert torch.equal(a, b)
            masters = resumed.optimizer.param_groups[0]["params"]
            for m, p in zip(masters, fresh.parameters(), strict=True):
                assert torch.equal(m.detach(), p.detach())
            _train(resumed, fresh, 3)  # and trains on from there
            assert resumed.epoch == 3


def test_offloading_with_diloco_is_refused() -> None:
    with pytest.raises(ConfigError, match="offload_optimizer"):
        CollaborativeConfig(offload_optimizer=True, diloco=DiLoCo(local_steps=4))

