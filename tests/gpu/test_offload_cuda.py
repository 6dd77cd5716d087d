"""The inner optimizer offloaded from a CUDA model (``offload_optimizer``):
float32 masters and the optimizer's state in pinned host memory, the same
steps as on the device, and less device memory at the peak."""

from __future__ import annotations

import gc
import time
from dataclasses import replace

import pytest
import torch
from trainer_harness import FAST, training_peers

from trainer import CollaborativeOptimizer

STEPS = 3


def _model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)  # drawn on the CPU: the same on every GPU model
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    return model.to(device=device, dtype=dtype)


def _run(
    device: torch.device, dtype: torch.dtype, offload: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Train STEPS global steps alone; the parameters, the optimizer's state
    (on the CPU) and the peak device memory of the steps."""
    with training_peers(1) as (_, (peer,)):
        model = _model(device, dtype)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        # What earlier runs and tests left for the cycle collector would count
        # toward this run's peak whenever it has not run yet: collect it, and
        # count from what is held now
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_allocated(device)
        with CollaborativeOptimizer(
            peer,
            run_id=f"offload-{offload}",
            model=model,
            optimizer=inner,
            target_batch_size=32,
            batch_size_per_step=32,
            config=replace(FAST, offload_optimizer=offload),
        ) as opt:
            data = torch.randn(STEPS, 32, 256, generator=torch.Generator().manual_seed(1))
            data = data.to(device=device, dtype=dtype)
            for _ in range(2000):
                if opt.epoch >= STEPS:
                    break
                model(data[opt.epoch]).float().pow(2).mean().backward()
                if not opt.step():
                    time.sleep(0.005)
                opt.zero_grad()
            assert opt.epoch >= STEPS
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - held
            masters = inner.param_groups[0]["params"]
            state = [
                v
                for p in masters
                for v in inner.state[p].values()
                if isinstance(v, torch.Tensor) and v.dim()
            ]
            if offload:
                assert all(m.device.type == "cpu" and m.is_pinned() for m in masters)
                assert all(m.dtype == torch.float32 for m in masters)
                assert all(v.device.type == "cpu" for v in state)
            else:
                assert all(v.device == device for v in state)
            return (
                [p.detach().cpu().float() for p in model.parameters()],
                [v.detach().cpu() for v in state],
                peak,
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_offloaded_optimizer_steps_as_on_the_device_with_less_device_memory(
    cuda: torch.device, dtype: torch.dtype
) -> None:
    params, state, plain_peak = _run(cuda, dtype, offload=False)
    offloaded_params, offloaded_state, offloaded_peak = _run(cuda, dtype, offload=True)
    # the host's AdamW and CUDA's round differently; bf16 parameters round that
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.01}
    )
    for a, b in zip(offloaded_params + offloaded_state, params + state, strict=True):
        torch.testing.assert_close(a, b, **tolerance)
    # AdamW's two float32 moments (and the float32 masters of a bf16 model)
    # no longer take device memory
    moments = 2 * 4 * sum(p.numel() for p in params)
    assert offloaded_peak <= plain_peak - moments // 2, (offloaded_peak, plain_peak)
