"""DropCompute: a compute budget per global step, so stragglers stop waiting
the swarm (Giladi et al. 2023, "DropCompute: simple and more robust distributed
synchronous training via compute variance reduction").

In synchronous training every step lasts as long as its slowest worker.
DropCompute gives each step a compute threshold tau: a worker that has computed
for longer than tau in the current step takes no new micro-batch and goes to
the all-reduce with what it has, its gradients weighted by the samples it
actually computed. The global batch shrinks a little in the steps that hit the
threshold, and no step waits for a straggler's tail.

In a swarm the compute of one global step is: until the swarm reaches
``target_batch_size`` (the standard mode), or ``local_steps`` inner steps (the
DiLoCo mode). With DropCompute it also ends once this peer has computed for
``tau`` seconds since the step began; the training loop does not change, since
``CollaborativeOptimizer.step()`` takes the global step right away.

tau is fixed (``DropCompute(threshold=...)``) or chosen by ``choose_threshold``
from this peer's first ``calibration_steps`` steps, which maximises the
paper's effective speed: the expected samples per step over the expected step
time, communication included (sec. 4 of the paper, its analysis of the
effective speed and automatic selection of the threshold). Candidates are the
cumulative micro-batch times observed in those steps: a lower threshold drops
the micro-batches that would finish later and shortens the steps in which
they happen.

Time is read from an injected clock (``time.monotonic`` by default), so tests
run on a virtual one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarm import ConfigError


@dataclass(frozen=True)
class DropCompute:
    """DropCompute option of ``CollaborativeConfig``; validated on construction.

    Use it when peers' step times vary: shared or preemptible machines, a peer
    that stalls now and then, a data loader with hiccups. It bounds how long the
    swarm waits for one peer's compute in each step. It does not speed up a
    peer that is uniformly slow (the threshold a peer chooses from its own
    times would cut nothing): give such a peer a fixed ``threshold``, or let
    the swarm's target batch absorb it (the standard mode already does).

    A peer that stops early waits for the others in matchmaking, for at most
    the matchmaking time: a threshold far below the swarm's usual step time
    makes it average with fewer peers, or alone, and the others then download
    its state. Peers of one run should stop within the matchmaking time of
    each other, as they do with one fixed threshold, or with thresholds each
    chose from step times that the swarm's pace sets alike.
    """

    #: tau, seconds of compute per global step; None: chosen automatically
    threshold: float | None = None
    #: global steps measured before tau is chosen (when ``threshold`` is None)
    calibration_steps: int = 10

    def __post_init__(self) -> None:
        if self.threshold is not None and not (
            math.isfinite(self.threshold) and self.threshold > 0
        ):
            raise ConfigError(
                f"DropCompute threshold ({self.threshold}) must be a positive number of seconds "
                "or None to choose it automatically"
            )
        if isinstance(self.calibration_steps, bool) or not isinstance(self.calibration_steps, int):
            raise ConfigError("DropCompute calibration_steps must be an integer")
        if self.calibration_steps < 1:
            raise ConfigError(
                f"DropCompute calibration_steps ({self.calibration_steps}) must be at least 1"
            )


@dataclass(frozen=True)
class MeasuredStep:
    """One global step as this peer saw it.

    ``finish_times[m]`` is the compute time from the step's start to the end of
    micro-batch ``m`` (non-decreasing), ``samples[m]`` its samples, and
    ``communication`` the time from the end of compute to the next step's start.
    """

    finish_times: tuple[float, ...]
    samples: tuple[int, ...]
    communication: float

    def __post_init__(self) -> None:
        if len(self.finish_times) != len(self.samples) or not self.finish_times:
            raise ValueError("a measured step needs one finish time per micro-batch, at least one")
        if any(b < a for a, b in zip(self.finish_times, self.finish_times[1:], strict=False)):
            raise ValueError("finish times must be non-decreasing")
        if self.finish_times[0] < 0 or self.communication < 0:
            raise ValueError("times must be >= 0")

    def cut(self, threshold: float) -> tuple[int, float]:
        """Samples computed and compute time under ``threshold``: the peer stops
        after the first micro-batch that ends at or past it."""
        samples = 0
        for finish, size in zip(self.finish_times, self.samples, strict=True):
            samples += size
            if finish >= threshold:
                return samples, finish
        return samples, self.finish_times[-1]


def expected_speed(steps: Sequence[MeasuredStep], threshold: float) -> float:
    """Expected samples per second with ``threshold``: samples of all ``steps``
    over their time, each step cut at the threshold, communication included."""
    samples = 0
    seconds = 0.0
    for step in steps:
        computed, compute_time = step.cut(threshold)
        samples += computed
        seconds += compute_time + step.communication
    return samples / seconds if seconds > 0 else math.inf


def choose_threshold(steps: Sequence[MeasuredStep]) -> float:
    """The threshold among the observed cumulative times with the highest
    ``expected_speed``; of equally fast ones the largest (it drops least).

    Raises ``ValueError`` for no steps.
    """
    if not steps:
        raise ValueError("choosing a threshold needs at least one measured step")
    candidates = sorted({t for step in steps for t in step.finish_times})
    best, best_speed = candidates[-1], expected_speed(steps, candidates[-1])
    for candidate in reversed(candidates[:-1]):
        speed = expected_speed(steps, candidate)
        if speed > best_speed * (1 + 1e-9):
            best, best_speed = candidate, speed
    return best


class ComputeBudget:
    """This peer's compute time in the current global step, against tau.

    ``begin()`` when a step's compute begins, ``spent(samples)`` after each
    micro-batch (True once the threshold is reached), ``end()`` when the peer
    goes to averaging (returns the compute seconds). While calibrating, the
    steps are recorded and tau is chosen after ``calibration_steps`` of them.
    """

    def __init__(self, config: DropCompute, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        #: tau in seconds; None while calibrating
        self.threshold = config.threshold
        self.calibration: list[MeasuredStep] = []
        self._started = clock()
        self._ended: float | None = None
        self._finish: list[float] = []
        self._samples: list[int] = []
        self._pending: tuple[tuple[float, ...], tuple[int, ...]] | None = None

    def begin(self) -> None:
        """The current step's compute begins now; a step ended with ``end`` is
        recorded with the time since as its communication."""
        now = self.clock()
        if self._pending is not None and self._ended is not None:
            finish, samples = self._pending
            self.calibration.append(MeasuredStep(finish, samples, max(0.0, now - self._ended)))
            if len(self.calibration) >= self.config.calibration_steps:
                self.threshold = choose_threshold(self.calibration)
        self._pending = None
        self._ended = None
        self._started = now
        self._finish = []
        self._samples = []

    def spent(self, samples: int) -> bool:
        """Count a micro-batch of ``samples`` that just finished; True if the
        step's compute reached the threshold."""
        elapsed = max(0.0, self.clock() - self._started)
        self._finish.append(max(elapsed, self._finish[-1]) if self._finish else elapsed)
        self._samples.append(samples)
        return self.threshold is not None and elapsed >= self.threshold

    def end(self) -> float:
        """The step's compute ended (the peer goes to averaging); returns its seconds."""
        self._ended = self.clock()
        computed = self._finish[-1] if self._finish else 0.0
        if self.threshold is None and self._finish:
            self._pending = (tuple(self._finish), tuple(self._samples))
        return computed
