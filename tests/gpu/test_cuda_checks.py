"""A CUDA model's micro-steps never wait for the device, and a batch the
device refuses later (NaN, or an AMP overflow) is still neither accumulated
nor counted: the global step equals plain training on the accepted batches."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.nn import functional as F
from trainer_harness import FAST, training_peers

from swarm import NonFiniteError
from trainer import CollaborativeOptimizer

BATCH = 8


def _net(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # drawn on the CPU: the same on every GPU model
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model.to(device)


def _data(device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(BATCH, 16, generator=g).to(device),
            torch.randint(0, 4, (BATCH,), generator=g).to(device),
        )
        for _ in range(n)
    ]


@contextmanager
def _alone(
    model: torch.nn.Module, target: int, lr: float = 0.1
) -> Iterator[CollaborativeOptimizer]:
    with training_peers(1) as (_, (peer,)):
        opt = CollaborativeOptimizer(
            peer,
            run_id="gpu-checks",
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            target_batch_size=target,
            batch_size_per_step=BATCH,
            config=FAST,
        )
        try:
            assert opt.wait_for_peers(1, 10.0)  # a fresh reading: no step waits to read the swarm
            yield opt
        finally:
            opt.close()


@pytest.mark.parametrize("amp", [False, True])
def test_a_cuda_micro_step_never_waits_for_the_device(cuda: torch.device, amp: bool) -> None:
    model = _net(cuda)
    data = _data(cuda, 6)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    with _alone(model, target=10_000) as opt:
        torch.cuda.synchronize(cuda)
        torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
        try:
            for x, y in data:
                with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                assert not opt.step(loss=loss.detach(), grad_scaler=scaler)
                scaler.update()
                opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("amp", [False, True])
def test_a_refused_cuda_batch_is_neither_accumulated_nor_counted(
    cuda: torch.device, amp: bool
) -> None:
    """Batches 0, 2 and 3 are fine; batch 1's gradients hold an Inf (without
    a scaler: ``NonFiniteError`` from its own call or the next, whichever
    reads the device's verdict; with one: an overflow, skipped silently). The
    global step comes with batch 3, and holds exactly the three accepted."""
    model = _net(cuda)
    start = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, enabled=amp)
    accepted: list[list[torch.Tensor]] = []
    errors: list[int] = []
    with _alone(model, target=3 * BATCH) as opt:
        for n, (x, y) in enumerate(_data(cuda, 5)):
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if n == 1:
                grads[0][0, 0] = float("inf")
            else:  # what the step should average: the unscaled gradients
                accepted.append([g / scaler.get_scale() if amp else g.clone() for g in grads])
            try:
                stepped = opt.step(loss=loss.detach(), grad_scaler=scaler)
            except NonFiniteError:
                errors.append(n)
                stepped = False
            finally:
                scaler.update()
                opt.zero_grad()
            if stepped:
                break
        step = opt.last_step
    assert step is not None and (n, step.samples) == (3, 3 * BATCH)
    if amp:
        assert errors == []
    else:
        assert len(errors) == 1 and errors[0] in (1, 2), errors
    mean = [torch.stack(g).mean(0) for g in zip(*accepted, strict=True)]
    for p, p0, m in zip(model.parameters(), start, mean, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * m, rtol=1e-5, atol=1e-7)
