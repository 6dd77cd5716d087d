"""DiLoCo on CUDA: the synced copy and the outer momentum live in pinned host
memory, and the outer steps equal those of a copy kept on the device."""

from __future__ import annotations

import torch

from trainer import DiLoCo
from trainer._diloco import OuterLoop


def test_the_synced_copy_is_pinned_host_memory_and_steps_as_on_the_device(
    cuda: torch.device,
) -> None:
    torch.manual_seed(3)  # drawn on the CPU: the same on every GPU model
    params = [
        torch.nn.Parameter(torch.randn(1000).to(cuda)),
        torch.nn.Parameter(torch.randn(30, 40).to(cuda)),
    ]
    reference = [p.detach().clone() for p in params]  # the copy on the device
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    loop = OuterLoop(params, DiLoCo(local_steps=2))
    assert all(s.device.type == "cpu" and s.is_pinned() for s in loop.synced)
    before = torch.cuda.memory_allocated(cuda)
    for _ in range(3):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape).to(cuda))
        loop.compute_pseudo_gradients()
        averaged = [d.cpu() for d in loop.deltas]  # the all-reduce's host copy
        for r, d in zip(reference, loop.deltas, strict=True):
            r.grad = d.clone()
        outer.step()
        loop.outer_step(averaged)
        torch.cuda.synchronize(cuda)
        for s, r, p in zip(loop.synced, reference, params, strict=True):
            torch.testing.assert_close(s, r.cpu(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(p.detach(), r, rtol=1e-6, atol=1e-6)
    assert all(m.device.type == "cpu" for m in loop.momentum())
    # the outer state took no device memory: what was added since is the
    # reference's own (its momentum buffers and gradients), each block as the
    # caching allocator hands it out (rounded up to 512 bytes)
    reference_state = sum(_block(4 * r.numel()) for r in reference)
    assert torch.cuda.memory_allocated(cuda) <= before + 2 * reference_state


def _block(size: int) -> int:
    """The bytes ``torch.cuda.memory_allocated`` counts for a tensor of ``size`` bytes."""
    return -(-size // 512) * 512
