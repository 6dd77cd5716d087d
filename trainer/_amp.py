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

On CUDA the check does not wait for the device (``device_flags``,
``DeviceChecks``): reading a flag back every micro-step stalls the training
thread until the GPU has run the whole backward, so the next forward's
kernels are launched only then and the GPU idles meanwhile. Instead the
flags are computed on the device, a refused batch's gradients are zeroed in
place (``zero_unless``: their bits, not their values, times the flag: NaN
times zero is still NaN) before they are added to the accumulators, and the flags come back by a
non-blocking copy that the training thread reads at a later call, once the
device is past them, and at the latest, waiting for them, when the global
step is due. A refused batch is then taken out of the count, and one with
NaN or Inf raises ``NonFiniteError`` from that later call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """True if no parameter's ``.grad`` holds NaN or Inf (parameters without a
    gradient are fine). One reduction and one read per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad.detach())
    flags = [_all_finite(grads) for grads in by_device.values()]
    return all(bool(flag) for flag in flags)


def _all_finite(grads: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor on the gradients' device: none holds NaN or Inf
    (one reduction; stack promotes mixed dtypes). Reads nothing back."""
    return torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite().all()


def _found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Unscale ``optimizer``'s gradients with ``scaler`` (unless the caller
    already did, e.g. to clip them): its overflow flags, one per device,
    recorded for the scaler's next ``update()``."""
    state = scaler._per_optimizer_states[id(optimizer)]
    if not state["found_inf_per_device"]:  # not unscaled yet in this iteration
        scaler.unscale_(optimizer)
    return list(state["found_inf_per_device"].values())


def unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Unscale ``optimizer``'s gradients with ``scaler`` (unless the caller
    already did, e.g. to clip them) and return True if they overflowed.

    The scaler records the overflow for its next ``update()``. Raises what
    ``GradScaler.unscale_`` raises (e.g. for float16 gradients).
    """
    if not scaler.is_enabled():
        return False
    return bool(sum(v.item() for v in _found_inf(scaler, optimizer)))


#: the integer type of each float width, to zero gradients bit by bit
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_unless(keep: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Zero ``grads`` in place where the 0-dim bool ``keep`` is False, with
    no read of ``keep`` on the host and a few multi-tensor kernels in all.

    Multiplying the values by 0 would leave NaN and Inf as NaN, so the bits
    are multiplied instead: each gradient viewed as the integer type of its
    width, times 1 (unchanged, exactly) or 0 (+0.0). One ``masked_fill_`` per
    gradient did the same with a kernel launch each, about a hundred per
    micro-batch of a small transformer, where the host's launches are what
    limits the step."""
    by_width: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        bits = _BITS.get(g.element_size()) if g.is_floating_point() else None
        if bits is None:
            g.masked_fill_(~keep, 0)
        else:
            by_width.setdefault(bits, []).append(g.view(bits))
    for bits, views in by_width.items():
        torch._foreach_mul_(views, keep.to(bits))


def device_flags(
    params: Sequence[torch.Tensor], scaler: Any, optimizer: torch.optim.Optimizer
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A batch's flags on its one CUDA device, computed without waiting for
    it: (every ``.grad`` is finite, ``scaler`` found an overflow; None without
    an enabled scaler), 0-dim bool tensors; unscales with ``scaler`` first, as
    ``unscale`` does. None where the check stays eager: gradients on the CPU
    (nothing to wait for), on several devices, or none at all."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return None
    device = grads[0].device
    if device.type != "cuda" or any(g.device != device for g in grads):
        return None
    finite = _all_finite(grads)
    if scaler is None or not scaler.is_enabled():
        return finite, None
    found = [f.to(device) for f in _found_inf(scaler, optimizer)]
    return finite, torch.stack(found).sum() > 0


@dataclass
class _Pending:
    """A batch whose flags are on their way back from the device."""

    size: int
    loss: float | torch.Tensor | None
    #: pinned host copy of (finite[, overflowed]), valid once ``ready`` has passed
    flags: torch.Tensor
    ready: torch.cuda.Event


@dataclass
class Verdicts:
    """What the device said of the batches that one call settled."""

    #: samples of the batches that were not accumulated (NaN/Inf, or an overflow)
    refused: int = 0
    #: how many of those held NaN or Inf without a scaler's overflow (errors)
    nonfinite: int = 0
    #: the losses of the batches that were accumulated, oldest first
    losses: list[float | torch.Tensor] = field(default_factory=list)


class DeviceChecks:
    """The batches added to the accumulators before the device said whether
    they may be (see the module doc), oldest first. The training thread's."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self,
        size: int,
        loss: float | torch.Tensor | None,
        finite: torch.Tensor,
        overflowed: torch.Tensor | None,
    ) -> None:
        """Start reading back the flags of a batch of ``size`` samples that
        was just accumulated under them (``device_flags``)."""
        device = finite.reshape(1) if overflowed is None else torch.stack([finite, overflowed])
        flags = torch.empty(device.shape, dtype=torch.bool, pin_memory=True)
        flags.copy_(device, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(finite.device))
        self._pending.append(_Pending(size, loss, flags, ready))

    def settle(self, *, wait: bool) -> Verdicts:
        """The verdicts of the pending batches that the device is done with,
        or, with ``wait``, of all of them once it is."""
        verdicts = Verdicts()
        while self._pending and (wait or self._pending[0].ready.query()):
            batch = self._pending.popleft()
            if wait:
                batch.ready.synchronize()
            finite, *overflow = batch.flags.tolist()
            overflowed = bool(overflow and overflow[0])
            if finite and not overflowed:
                if batch.loss is not None:
                    verdicts.losses.append(batch.loss)
                continue
            verdicts.refused += batch.size
            verdicts.nonfinite += not overflowed
        return verdicts

    def clear(self) -> None:
        """Forget the pending batches: the accumulators they went into were reset."""
        self._pending.clear()
