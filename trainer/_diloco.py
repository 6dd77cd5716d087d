"""DiLoCo: local inner steps, then an outer Nesterov step on the averaged
pseudo-gradient (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", Algorithm 1; as run over a swarm in OpenDiLoCo,
Jaghouar et al. 2024).

Every peer holds the parameters of the last synchronisation (``synced``). It
takes ``local_steps`` steps of its own inner optimizer on its own data, then
the group averages the pseudo-gradient ``synced - params`` and every member
applies the same outer step to ``synced``: SGD with Nesterov momentum (the
paper's defaults: learning rate 0.7, momentum 0.9). The result becomes both the
new ``synced`` and the parameters the next local steps start from.

A peer sends its pseudo-gradient once per ``local_steps`` inner steps instead
of a gradient per step, so the bytes on the wire drop by about that factor;
FLOAT16 halves them again (OpenDiLoCo all-reduces the pseudo-gradients in
half precision and reports no loss of quality).

``OuterLoop`` holds the state and does the arithmetic; the collaborative
optimizer decides when, and averages ``deltas`` with its group in between.

``synced`` and the outer momentum live in host memory (pinned when the
parameters are on CUDA), not on the device: on a GPU they would be two more
copies of the model, used once per ``local_steps`` steps. The outer step runs
on the host, on the averaged pseudo-gradient's host copy (the one the
all-reduce produced), and the result is copied to the device once per outer
step; the pseudo-gradient is computed on the device, one parameter's worth of
``synced`` at a time. Donors and checkpoints read ``synced`` without touching
the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from averaging import FLOAT16, Codec, float32_accumulators
from swarm import ConfigError, ProtocolError


@dataclass(frozen=True)
class DiLoCo:
    """DiLoCo mode of ``CollaborativeConfig``; validated on construction.

    Use it when the network, not compute, limits training (home links, peers
    far apart): peers talk once per ``local_steps`` inner steps. The inner
    optimizer is the task's (the paper uses AdamW); the outer one is fixed to
    SGD with Nesterov momentum, which the paper found best among the outer
    optimizers it compared.

    In DiLoCo mode an epoch is one outer step. ``target_batch_size`` does not
    trigger it: each peer synchronises after its own ``local_steps`` inner
    steps (``CollaborativeOptimizer.step()`` calls), with its samples since the
    last synchronisation as its weight; the group waits for every live peer
    up to the matchmaking time, and a peer that the others passed meanwhile
    downloads their state instead. The task's scheduler steps once per epoch.
    """

    #: inner optimizer steps of each peer between two synchronisations (H);
    #: the paper uses 500 for language models, fewer suit small models
    local_steps: int = 500
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    #: codec of the pseudo-gradients in the all-reduce
    codec: Codec = FLOAT16

    def __post_init__(self) -> None:
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int):
            raise ConfigError("DiLoCo local_steps must be an integer")
        if self.local_steps < 1:
            raise ConfigError(f"DiLoCo local_steps ({self.local_steps}) must be at least 1")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ConfigError(f"DiLoCo outer_lr ({self.outer_lr}) must be a positive number")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"DiLoCo outer_momentum ({self.outer_momentum}) must be in [0, 1)")
        if self.nesterov and self.outer_momentum == 0:
            raise ConfigError("DiLoCo nesterov needs outer_momentum > 0 (or nesterov=False)")


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory, pinned when ``t`` is on CUDA."""
    pin = t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    with torch.no_grad():
        out.copy_(t.detach())
    return out


class OuterLoop:
    """The synced parameters, the outer optimizer over them and the count of
    local steps since the last synchronisation, for ``params``.

    Not thread-safe: the collaborative optimizer calls it under its state lock,
    which every change to parameters holds.
    """

    def __init__(self, params: list[torch.nn.Parameter], config: DiLoCo) -> None:
        self.config = config
        self.params = params
        #: the parameters of the last synchronisation, in host memory
        self.synced = [_host_copy(p) for p in params]
        #: the pseudo-gradients: float32 on the parameters' device (the group
        #: averages their host copy, see ``averaging.HostStaging``)
        self.deltas = float32_accumulators(params)
        self.optimizer = torch.optim.SGD(
            self.synced,
            lr=config.outer_lr,
            momentum=config.outer_momentum,
            nesterov=config.nesterov,
        )
        self.local_steps = 0

    def compute_pseudo_gradients(self) -> None:
        """``deltas = synced - params``: the way back to the last sync."""
        with torch.no_grad():
            for delta, synced, p in zip(self.deltas, self.synced, self.params, strict=True):
                # one parameter's worth on the device at a time (no copy on the CPU)
                torch.sub(synced.to(p.device, non_blocking=True), p, out=delta)

    def outer_step(self, averaged: list[torch.Tensor] | None = None) -> None:
        """Apply the outer optimizer to ``synced`` with the averaged
        pseudo-gradients as the gradient, and restart the parameters from the
        result. ``averaged`` is their host copy (float32 CPU tensors shaped as
        ``deltas``, e.g. what the all-reduce averaged); None: ``deltas``."""
        deltas = self.deltas if averaged is None else averaged
        with torch.no_grad():
            for synced, delta in zip(self.synced, deltas, strict=True):
                # itself for float32 host tensors; else one copy to the host
                synced.grad = delta.to(device=synced.device, dtype=synced.dtype)
            self.optimizer.step()
            for synced, p in zip(self.synced, self.params, strict=True):
                synced.grad = None
                p.copy_(synced)  # the one host-to-device copy of the outer step
        self.local_steps = 0

    def resync(self) -> None:
        """Take the current parameters as the synced ones (after loading a
        state, or averaging parameters); local progress is forgotten."""
        with torch.no_grad():
            for synced, p in zip(self.synced, self.params, strict=True):
                synced.copy_(p)
        self.local_steps = 0

    def momentum(self) -> list[torch.Tensor]:
        """The outer momentum buffers (zeros before the first outer step, which
        is what SGD's first step is equivalent to)."""
        buffers = []
        for synced in self.synced:
            buffer = self.optimizer.state.get(synced, {}).get("momentum_buffer")
            if buffer is None:
                buffer = self.optimizer.state[synced]["momentum_buffer"] = torch.zeros_like(synced)
            buffers.append(buffer)
        return buffers

    def state_dict(self) -> dict[str, Any]:
        """The outer state that a newcomer or a checkpoint needs (the synced
        parameters travel as the model's parameters)."""
        return {"momentum": [m.detach() for m in self.momentum()]}

    def template(self) -> dict[str, Any]:
        """The structure ``load_state_dict`` accepts, for checking downloads."""
        return {"momentum": [torch.zeros_like(s) for s in self.synced]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output, then ``resync`` from the parameters.

        Raises ``ProtocolError`` if the momentum does not fit the parameters.
        """
        momentum = state.get("momentum") if isinstance(state, dict) else None
        if not isinstance(momentum, list) or len(momentum) != len(self.synced):
            raise ProtocolError("the DiLoCo state has no momentum buffer per parameter")
        for buffer, value in zip(self.momentum(), momentum, strict=True):
            if not isinstance(value, torch.Tensor) or value.shape != buffer.shape:
                raise ProtocolError("a DiLoCo momentum buffer does not fit its parameter")
            buffer.copy_(value)
        self.resync()
