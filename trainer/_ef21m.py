"""EF21M error feedback around ARC-Top-K gradient compression.

ARC-Top-K (``averaging._arctopk``; Chen, Ma, Li, He, Dong, Yuan 2025,
arXiv:2510.26709) is paired there with EF21M, the momentum variant of EF21
(Fatkhullin, Tyurin, Richtarik 2023), and this module is that pairing as the
paper's convergence analysis states it. Each peer ``i`` keeps, per parameter
tensor (same shape as the parameter):

- ``v_i``: a momentum of its gradients, ``v_i <- (1 - eta) v_i + eta * grad_i``
  (``eta`` = ``ArcTopK.momentum``; 1 means no momentum);
- ``g_i``: its own gradient estimate. It sends ``c_i = C(v_i - g_i)`` and
  updates ``g_i <- g_i + c_i``;
- ``g_bar``: the shared estimate, ``g_bar <- g_bar + mean_group(c)``, which
  the inner optimizer uses as the gradient.

If every peer always averages with the whole swarm, ``g_bar`` stays the mean
of the ``g_i``. Compression only delays what it leaves out: the difference
``v_i - g_i`` keeps it and sends it in a later step.

The cases that break "always the whole swarm", and what happens:

- Dense warm-up (``warmup_steps``): ``C`` is the identity (up to the
  codec's rounding: ``C`` is then the rounding), so after the first step
  every ``g_i`` equals its ``v_i`` as rounded; compression starts from there.

Everything a peer sends goes through ``ArcTopK.codec`` (float16 by default),
and its own ``c_i`` is the rounded value the others decode, so ``g_i`` adds
exactly what the group averaged.
- No group (alone, or matchmaking failed): nothing travels, so nothing is
  compressed: ``c_i = v_i - g_i`` stays local and ``g_bar += c_i``.
- A partly failed all-reduce: ``mean_group(c)`` is, chunk by chunk, what the
  all-reduce delivered (the mean over the members that delivered the chunk,
  or this peer's own ``c_i`` where the chunk's reducer failed); ``g_i`` always
  adds its own full ``c_i``. Members that selected other rows (a failed sketch
  round) never average values together (``ArcTopKRound``). Peers' ``g_bar``
  then differ a little, like their parameters do after such a step, until
  the next state averaging, which averages ``g_bar`` with the parameters.
- A peer leaves: its ``g_i`` leaves with it; ``g_bar`` keeps what it sent.
- A newcomer downloads ``g_bar`` with the parameters (the donated state) and
  starts with ``g_i = v_i = g_bar``: its first difference is its fresh
  gradient against the swarm's estimate, not against zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from averaging import FLOAT16, ArcTopKRound, Averager, Codec, Group, StepResult
from averaging._arctopk import check_codec, check_parameters, on_the_wire, payload_elements
from swarm import ConfigError

#: Sub-round tag of a dense warm-up step (``EF21M.average_dense``), then the codec.
DENSE_TAG = b"ef21m.dense."


@dataclass(frozen=True)
class ArcTopK:
    """Compress gradients with ARC-Top-K and EF21M error feedback.

    Select it with ``CollaborativeConfig(gradient_compression=ArcTopK(...))``.
    Each global step then sends, instead of every gradient value, a sketch of
    ``r`` columns per matrix and ``rho`` of its rows (1-D tensors whole):
    for a linear layer with ``n x m`` weights (``n >= m``: rows along the
    longer side), ``n * r + ceil(rho * n) * m`` values instead of ``n * m``,
    where ``r = min(rank, floor(rho * m))``, at least 1 (``sketch_rank``: the
    sketch never outweighs the values, so in FLOAT16 a matrix costs about
    ``rho`` of its float32 bytes).
    Use it on slow links (home connections) with models whose gradients are
    mostly large matrices; see ``averaging._arctopk`` for what it costs and
    guarantees. Every peer of a run must use the same setting: members that
    differ never average together.

    Step size. The shared estimate lags the gradient by a number of steps
    that grows as ``rho`` shrinks, and EF21's step-size bound shrinks with the
    compressor's contraction (Richtarik, Sokolov, Fatkhullin 2021, "EF21",
    Theorem 1: ``gamma <= 1 / (L + L~ sqrt(beta / theta))``, about 20 times
    below dense's ``1 / L`` at alpha = 0.1 and 9 times at 0.2). A learning
    rate tuned for dense training can therefore oscillate under strong
    compression: on digits with 4 peers, 1,024 samples a step and 80 steps
    (``benchmarks/arctopk_digits.py --peers 4 --target 1024 --epochs 80``),
    rho 0.1 plateaued at 0.871 with the task's Adam lr 1e-2 (dense 0.985) and
    reached 0.918 with lr 3e-3 (dense 0.969); rho 0.2 reached 0.961 and
    0.950. Lower the inner learning rate, or raise ``rho``, when rho is small.

    Given steps, it catches up: with 4 peers and 4,096 samples a step
    (``benchmarks/arctopk_digits.py``, 3 seeds), rho 0.1 reached 0.818,
    0.927 and 0.985 after 50, 100 and 200 steps, against dense's 0.985,
    0.988 and 0.983. The cost is in the early steps, not in the end result.

    Not adopted, measured at 20 steps (4 peers, 4,096 samples a step, 3
    seeds; rho 0.1 0.861, dense 0.944 with the uncapped sketch): freezing
    Adam's second moment after a dense warm-up, as 1-bit Adam does (Tang et
    al. 2021, section 3) because error feedback corrupts the variance
    estimate: 0.220, 0.749 and 0.862
    after 1, 3 and 5 dense steps (twenty steps leave no time for the
    variance to settle; the paper warms up for 15-25% of training, and even
    dense training dropped to 0.903 with a freeze after 3 steps). Adam's
    ``eps`` 1e-2 instead of 1e-8 (with the capped sketch): 0.873 against
    0.836, while dense dropped to 0.929 with ``eps`` 1e-3 already.
    """

    #: fraction of each matrix's rows sent per step (0 < rho <= 1)
    rho: float = 0.2
    #: columns of the random projection that ranks the rows (capped per
    #: matrix at ``rho`` times its columns: ``averaging._arctopk.sketch_rank``)
    rank: int = 4
    #: global steps averaged dense (uncompressed) before compression starts;
    #: one dense step already sets every peer's estimate g to its momentum v,
    #: and on digits 1 trained better in 30 epochs than 3 or 5
    warmup_steps: int = 1
    #: EF21M's eta: v <- (1 - eta) v + eta * grad (1: no momentum, i.e. EF21).
    #: 1 by default because the inner optimizers of our tasks (Adam) keep a
    #: momentum of their own: on digits with Adam, eta 0.3 and 0.5 trained
    #: worse than 1 in 25 epochs. Use eta < 1 with plain SGD, as the paper does.
    momentum: float = 1.0
    #: codec of the sketch and the selected values on the wire: NONE or FLOAT16
    #: (element-wise, so error feedback knows the exact c it sent). FLOAT16 by
    #: default: it halves the bytes, and its rounding (2**-11 relative) is far
    #: below what the compression itself leaves for later steps. Every member
    #: decodes the same averaged sketch bits, so all still select the same
    #: rows. The dense warm-up steps travel in it too.
    codec: Codec = FLOAT16

    def __post_init__(self) -> None:
        check_parameters(self.rho, self.rank)
        check_codec(self.codec)
        if isinstance(self.warmup_steps, bool) or not (
            isinstance(self.warmup_steps, int) and self.warmup_steps >= 0
        ):
            raise ConfigError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if not (math.isfinite(self.momentum) and 0 < self.momentum <= 1):
            raise ConfigError(
                f"momentum={self.momentum} must be in (0, 1]: EF21M's eta, the weight of the"
                " newest gradient in v (1 = no momentum)"
            )

    def payload_elements(self, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
        """``(sketch, values)`` elements a compressed step all-reduces for
        parameters of ``shapes`` (a dense step: their total)."""
        return payload_elements(shapes, self.rho, self.rank)

    def payload_bytes(self, shapes: Sequence[Sequence[int]]) -> int:
        """Bytes of sketch and values a compressed step all-reduces per
        member, in ``codec`` (4 per element for NONE, 2 for FLOAT16)."""
        return self.codec.payload_size(sum(self.payload_elements(shapes)))

    def compresses(self, epoch: int) -> bool:
        """Is the step that ends ``epoch`` compressed (past the warm-up)?"""
        return epoch >= self.warmup_steps


class EF21M:
    """One peer's EF21M state for ``shapes`` (one entry per parameter tensor).

    ``begin`` turns the step's mean gradient into the difference to send;
    the averaging then compresses and averages it in place (``average``, or
    the dense all-reduce during the warm-up, or nothing when alone);
    ``finish`` folds the result into the estimates and leaves ``g_bar`` in
    place of the gradient. Not thread-safe: the trainer calls all of it on
    its trio thread.
    """

    def __init__(self, like: Sequence[torch.Tensor], config: ArcTopK) -> None:
        self.config = config
        self.v = [torch.zeros(t.shape, dtype=torch.float32) for t in like]
        self.g = [torch.zeros(t.shape, dtype=torch.float32) for t in like]
        self.g_bar = [torch.zeros(t.shape, dtype=torch.float32) for t in like]
        #: this peer's own c for the step under way (set by ``begin``)
        self._own: list[torch.Tensor] | None = None

    def begin(self, grads: Sequence[torch.Tensor]) -> None:
        """``v <- (1 - eta) v + eta * grads``, then ``grads <- v - g`` (in place).

        Until ``average`` says otherwise, this peer's own ``c`` is the whole
        difference (the identity compressor): right for the dense warm-up and
        for a step without a group.
        """
        eta = self.config.momentum
        with torch.no_grad():
            for v, g, grad in zip(self.v, self.g, grads, strict=True):
                v.mul_(1 - eta).add_(grad, alpha=eta)
                grad.copy_(v).sub_(g)
        self._own = [grad.detach().clone() for grad in grads]

    async def average(
        self, averager: Averager, group: Group, grads: list[torch.Tensor], weight: float, step: int
    ) -> StepResult:
        """ARC-Top-K all-reduce of the differences in ``grads`` with ``group``
        (``ArcTopKRound.run``): ``grads`` end as ``mean_group(c)``, and this
        peer's own ``c`` is recorded for ``finish``, also if cancelled."""
        exchange = ArcTopKRound(grads, self.config.rho, self.config.rank, self.config.codec)
        try:
            return await exchange.run(averager, group, weight, step)
        finally:
            self._own = exchange.local

    async def average_dense(
        self, averager: Averager, group: Group, grads: list[torch.Tensor], weight: float
    ) -> StepResult:
        """A dense (warm-up) all-reduce of the differences in ``grads`` with
        ``group``, in ``codec``: each difference is first rounded as the codec
        delivers it, and that rounded difference is this peer's own ``c``.
        ``grads`` end as ``mean_group(c)``, chunk by chunk as the all-reduce
        delivered it (local where it failed, also if cancelled)."""
        codec = self.config.codec
        with torch.no_grad():
            for grad in grads:
                grad.copy_(on_the_wire(grad, codec))
        self._own = [grad.detach().clone() for grad in grads]
        tag = DENSE_TAG + bytes([codec.kind])
        return await averager.average_with(group, grads, weight, tag=tag, last=True, codec=codec)

    def finish(self, averaged: Sequence[torch.Tensor]) -> None:
        """``g += own c``, ``g_bar += averaged`` (the group's mean of the c's),
        then ``averaged <- g_bar``: the gradient for the inner optimizer."""
        own = self._own
        if own is None:
            raise RuntimeError("EF21M.finish without begin: a step is finished once")
        self._own = None
        with torch.no_grad():
            for g, g_bar, c, mean in zip(self.g, self.g_bar, own, averaged, strict=True):
                g.add_(c)
                g_bar.add_(mean)
                mean.copy_(g_bar)

    def adopt(self, g_bar: Sequence[torch.Tensor]) -> None:
        """Start from the swarm's estimate (a newcomer): ``g = v = g_bar``."""
        with torch.no_grad():
            for mine, theirs, g, v in zip(self.g_bar, g_bar, self.g, self.v, strict=True):
                mine.copy_(theirs)
                g.copy_(theirs)
                v.copy_(theirs)
        self._own = None

    def state_dict(self) -> dict[str, Any]:
        """The tensors themselves (not copies): ``v``, ``g`` and ``g_bar``."""
        return {"v": list(self.v), "g": list(self.g), "g_bar": list(self.g_bar)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` (from ``state_dict``) in; ``ConfigError`` if it does not fit."""
        try:
            for name in ("v", "g", "g_bar"):
                values = state[name]
                mine = getattr(self, name)
                if len(values) != len(mine):
                    raise ConfigError(f"EF21M state has {len(values)} {name} tensors")
                for dst, src in zip(mine, values, strict=True):
                    if tuple(src.shape) != tuple(dst.shape):
                        raise ConfigError(f"EF21M {name} of shape {tuple(src.shape)}")
            with torch.no_grad():
                for name in ("v", "g", "g_bar"):
                    for dst, src in zip(getattr(self, name), state[name], strict=True):
                        dst.copy_(src)
        except (KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"not an EF21M state: {e!r}") from e
        self._own = None
