"""Byzantine-robust aggregation: CenteredClip. Pure code, no network.

CenteredClip (Karimireddy, He and Jaggi 2021, "Learning from History for
Byzantine Robust Optimization", sec. 4; used by BTARD, Gorbunov et al. 2022,
"Secure Distributed Training at Scale", sec. 3.2) replaces the mean of vectors
``x_1..x_k`` by the fixed point of::

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i

Each sender moves ``v`` by at most ``tau`` (times its weight share), so a
sender that scales its vector by 1000 or sends noise pulls the result no
further than one that sends a vector at distance ``tau``.

The bound the tests check. Let the honest senders hold weight share
``1 - delta`` (``delta < 1/2``), ``mu`` be their weighted mean and every honest
``x_i`` lie within ``r`` of ``mu``. While ``||v - mu|| <= tau - r`` no honest
vector is clipped, so one iteration maps the error ``e = v - mu`` to
``e' = delta * e + b`` with ``||b|| <= delta * tau`` (the clipped Byzantine
pull), hence ``||e'|| <= delta * (||e|| + tau)``: after ``T`` iterations

    ||v_T - mu|| <= delta**T * ||v_0 - mu|| + tau * delta / (1 - delta)

and ``||v_t - mu|| <= tau - r`` holds throughout if it holds at the start and
``tau >= r * (1 - delta) / (1 - 2 * delta)``. The start is the coordinate-wise
median: with fewer Byzantine than honest senders every coordinate of it lies
within the honest range, so ``||v_0 - mu|| <= sqrt(k_honest) * r``. With 1 of 4
equally weighted senders Byzantine (``delta = 1/4``) both conditions hold for
``tau >= (1 + sqrt(3)) r``, so with ``tau >= 3 r``:
``||v_T - mu|| <= 4**-T * sqrt(3) * r + tau / 3``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm import ConfigError

#: Most iterations a config may ask for: each is one pass over every sender's chunk.
MAX_ITERATIONS = 100


@dataclass(frozen=True)
class CenteredClip:
    """Robust aggregation for the all-reduce (``AllReduceConfig.aggregation``).

    ``tau`` is the clipping radius in the units of the averaged vector (per
    chunk: see ``PartReducer``); pick it a few times the typical distance of
    an honest chunk from the honest mean (``tau >= 3 r`` for the bound in the
    module docstring). Too small a ``tau`` slows convergence to the mean of
    honest peers that disagree; too large lets a Byzantine peer move the
    result by up to ``tau / 3`` per chunk with 1 of 4 peers Byzantine.

    ``iterations`` of the fixed-point update start from the coordinate-wise
    median. ``use_weights=False`` (default) counts every sender with a
    positive weight once: weights are declared by the senders themselves, and
    a Byzantine sender that claims a huge weight would otherwise own the
    result. With ``use_weights=True`` the bound holds for the weight share of
    Byzantine senders instead of their number.
    """

    tau: float
    iterations: int = 20
    use_weights: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ConfigError(f"CenteredClip.tau={self.tau} must be a positive finite radius")
        if not 1 <= self.iterations <= MAX_ITERATIONS:
            raise ConfigError(
                f"CenteredClip.iterations={self.iterations} must be in [1, {MAX_ITERATIONS}]"
            )


def centered_clip(
    values: torch.Tensor,
    weights: torch.Tensor,
    tau: float,
    iterations: int,
    *,
    start: torch.Tensor | None = None,
) -> torch.Tensor:
    """CenteredClip of the rows of ``values`` (k x n) with ``weights`` (k, all > 0).

    Starts from ``start`` or else the coordinate-wise median of the rows, and
    runs ``iterations`` updates. Returns a new float32 tensor of n values.
    Raises ``ValueError`` for mismatched shapes or non-positive weights.
    """
    if values.dim() != 2 or weights.shape != (values.shape[0],) or values.shape[0] == 0:
        raise ValueError("values must be k x n and weights k positive numbers, k >= 1")
    if not bool((weights > 0).all()):
        raise ValueError("every weight must be positive")
    x = values.to(torch.float32)
    w = weights.to(torch.float32)
    v = torch.median(x, dim=0).values if start is None else start.to(torch.float32).clone()
    total = float(w.sum())
    for _ in range(iterations):
        diff = x - v
        # a row at distance 0 has tau / 0 = inf, clamped to 1
        scale = torch.clamp(tau / torch.linalg.vector_norm(diff, dim=1), max=1.0)
        v += (w * scale) @ diff / total
    return v
