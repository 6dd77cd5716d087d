"""Mixed precision around the collaborative step: finiteness of a micro-step's
gradients in one reduction, and ``torch.amp.GradScaler`` support.

A batch's gradients are checked with one batched reduction per device
(``torch._foreach_norm`` with the infinity norm, stacked, read once), not one
device synchronisation per parameter.

With a ``GradScaler`` the gradients are unscaled before they are accumulated
(the swarm averages true gradients, never gradients 65,536 times too large),
and a batch whose scaled gradients overflowed is skipped: the scaler lowers
its scale at ``update()``, as in plain AMP training, and the batch counts for
nothing. ``GradScaler.step(opt)`` hands the step to an optimizer that sets
``_step_supports_amp_scaling`` by calling ``opt.step(grad_scaler=scaler)``;
for the others it unscales, skips an overflow and calls ``opt.step()``
(``CollaborativeOptimizer``). ``AsyncCollaborativeOptimizer.step`` takes
``grad_scaler=`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """True if no parameter's ``.grad`` holds NaN or Inf (parameters without a
    gradient are fine). One reduction and one read per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad.detach())
    flags = []
    for grads in by_device.values():
        norms = torch._foreach_norm(grads, float("inf"))
        flags.append(torch.stack([n.float() for n in norms]).isfinite().all())
    if not flags:
        return True
    return bool(torch.stack([f.cpu() for f in flags]).all())


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Unscale ``optimizer``'s gradients with ``scaler`` (unless the caller
    already did, e.g. to clip them) and return True if they overflowed.

    The scaler records the overflow for its next ``update()``. Raises what
    ``GradScaler.unscale_`` raises (e.g. for float16 gradients).
    """
    if not scaler.is_enabled():
        return False
    state = scaler._per_optimizer_states[id(optimizer)]
    if not state["found_inf_per_device"]:  # not unscaled yet in this iteration
        scaler.unscale_(optimizer)
    found = state["found_inf_per_device"]
    return bool(sum(v.item() for v in found.values()))
