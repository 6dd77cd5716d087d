"""What a training peer shows and keeps about its run, once per global step:
the metric history (``_history``), the Prometheus metrics (``_metrics``), a
structured log record, and on a terminal a live progress display.

``Dashboard`` is fed by the training loop's callbacks (``on_start`` with the
collaborative optimizer, ``on_epoch`` after each global step, ``finish`` with
the final report). It reads the optimizer through the few attributes every
``trainer.CollaborativeOptimizer`` has (``epoch``, ``loss``,
``swarm_progress()``, ``last_step``), so this application module needs the
trainer's objects, never its imports.

``samples_per_second`` here is the swarm's real throughput: the target batch
size times the global steps completed per second of wall time, measured over
the last ``THROUGHPUT_WINDOW`` steps, averaging and waiting included. The rate
the peers compute at (averaging left out) is ``compute_samples_per_second``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from ._history import EpochRecord, HistoryFile
from ._metrics import PeerMetrics, serve_metrics
from ._throughput import Throughput, ThroughputMeter

log = logging.getLogger("swarm.metrics")

#: Global steps the throughput is measured over: long enough to smooth one
#: slow round, short enough to follow a swarm that grows or shrinks.
THROUGHPUT_WINDOW = 10

#: Causes of failed averaging rounds, from the averager's reasons (``StepResult.reason``).
_CAUSES = {
    "no group formed in time": "no_group",
    "timed out in matchmaking": "matchmaking_timeout",
    "timed out during the all-reduce": "allreduce_timeout",
}


def _samples_per_second(throughput: Throughput | None) -> float | None:
    return None if throughput is None else throughput.samples_per_second


def round_outcome(step: Any, peers: int) -> tuple[str, str | None]:
    """How a global step's averaging went: ``(outcome, cause)``, outcome one of
    ``averaged``, ``alone`` (no other peer was in the run), ``failed`` (with a
    cause: ``no_group``, ``matchmaking_timeout``, ``allreduce_timeout``,
    ``members_lost`` when some members' data are missing from the result,
    ``error`` when the round raised, or ``other``). ``step`` is a
    ``trainer.GlobalStep``."""
    averaging = getattr(step, "averaging", None)
    if averaging is None:
        # no round: alone, or the round raised (the trainer logged why)
        return ("alone", None) if peers <= 1 else ("failed", "error")
    if averaging.group is None:
        return "failed", _CAUSES.get(averaging.reason, "other")
    if len(averaging.contributors) < len(averaging.members):
        return "failed", "members_lost"
    return "averaged", None


class Display(Protocol):
    """What shows the run to the user (a live terminal display, or plain lines)."""

    def start(self, opt: Any) -> None: ...

    def epoch(self, opt: Any, report: Any, record: EpochRecord) -> None: ...

    def close(self) -> None: ...


class Dashboard:
    """Fans each global step out to the history, the metrics, the log and the
    display; any of them may be absent.

    ``target_batch_size`` is the samples of one global step. ``wall_clock``
    stamps the records (Unix seconds); ``clock`` measures throughput.
    ``history.append`` failing (a full disk) is logged once and the run goes
    on: a dashboard never stops training.
    """

    def __init__(
        self,
        *,
        target_batch_size: int,
        history: HistoryFile | None = None,
        metrics: PeerMetrics | None = None,
        display: Display | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        meter: ThroughputMeter | None = None,
    ) -> None:
        self.history = history
        self.metrics = metrics
        self.display = display
        #: the swarm's throughput; the plain epoch lines may share it
        self.throughput = meter or ThroughputMeter(target_batch_size, THROUGHPUT_WINDOW)
        self._wall_clock = wall_clock
        self._clock = clock
        self._last_eval: Mapping[str, float] | None = None
        self._history_failed = False
        self._peers = 1
        #: the record of the latest global step (None: none yet)
        self.last_record: EpochRecord | None = None
        self._lock = threading.Lock()

    def on_start(self, opt: Any) -> None:
        # The start is not an epoch the peer saw the swarm complete: timing from
        # here would count the wait for peers (a minute, for the first peer of a
        # run) or a joiner's part of a step as the swarm's, so the first epoch
        # line has no throughput (``_throughput``: only whole steps are timed).
        if self.display is not None:
            self.display.start(opt)

    def on_epoch(self, opt: Any, report: Any) -> None:
        """Record the global step ``opt`` just took (``last_record``)."""
        self.throughput.observe(opt.epoch, self._clock())
        swarm = opt.swarm_progress()
        step = opt.last_step
        metrics = report.metrics
        evaluated = metrics is not self._last_eval and bool(metrics)
        self._last_eval = metrics
        averaging = getattr(step, "averaging", None)
        record = EpochRecord(
            time=self._wall_clock(),
            epoch=opt.epoch,
            train_loss=opt.loss,
            eval_loss=metrics.get("loss") if evaluated else None,
            accuracy=metrics.get("accuracy") if evaluated else None,
            samples_per_second=_samples_per_second(self.throughput.recent()),
            # 0: no peer has measured its rate yet (not a rate of 0)
            compute_samples_per_second=swarm.samples_per_second or None,
            peers=max(1, swarm.num_peers),
            averaging_seconds=None if step is None else step.averaging_seconds,
            group_size=0 if averaging is None else len(averaging.members),
        )
        self._peers = record.peers
        outcome, cause = ("", None) if step is None else round_outcome(step, record.peers)
        self._keep(record, outcome, cause)
        self.last_record = record
        if self.display is not None:
            self.display.epoch(opt, report, record)

    def finish(self, epoch: int, metrics: Mapping[str, float]) -> EpochRecord:
        """Record the run's final evaluation (``metrics``) at ``epoch``."""
        record = EpochRecord(
            time=self._wall_clock(),
            epoch=epoch,
            eval_loss=metrics.get("loss"),
            accuracy=metrics.get("accuracy"),
            samples_per_second=_samples_per_second(self.throughput.overall()),
            peers=self._peers,
            final=True,
        )
        self._keep(record, "", None)
        return record

    def _keep(self, record: EpochRecord, outcome: str, cause: str | None) -> None:
        with self._lock:
            if self.metrics is not None:
                self.metrics.observe_epoch(record, outcome=outcome, cause=cause)
            if self.history is not None:
                try:
                    self.history.append(record)
                except OSError as e:
                    if not self._history_failed:
                        log.warning("cannot append to the metric history (%s); training on", e)
                    self._history_failed = True
            # the log record has its own time
            fields = {k: v for k, v in record.__dict__.items() if v is not None and k != "time"}
            if outcome:
                fields["averaging"] = outcome
            if cause:
                fields["failure"] = cause
            log.info(
                "%s epoch %d: %s",
                "final" if record.final else "global step",
                record.epoch,
                summary(record),
                extra={"fields": fields},
            )

    def attach(self, peer: Any) -> None:
        """Expose ``peer``'s own metric objects (``peer.metrics``, a running
        ``swarm.Peer``) in the metrics."""
        if self.metrics is not None:
            self.metrics.watch(peer.metrics)

    def close(self) -> None:
        """Close the display (the history's owner closes the history)."""
        if self.display is not None:
            self.display.close()


def summary(record: EpochRecord) -> str:
    """The figures of ``record`` in one line, each with its unit."""
    parts = []
    if record.train_loss is not None:
        parts.append(f"train loss {record.train_loss:.4f}")
    if record.eval_loss is not None:
        parts.append(f"eval loss {record.eval_loss:.4f}")
    if record.accuracy is not None:
        parts.append(f"accuracy {record.accuracy:.3f}")
    if record.samples_per_second is not None and math.isfinite(record.samples_per_second):
        parts.append(f"{record.samples_per_second:.0f} samples/s")
    parts.append(f"{record.peers} {'peer' if record.peers == 1 else 'peers'}")
    return ", ".join(parts)


class PlainLines:
    """The display when stdout is not a terminal: ``report(opt, report)`` prints
    one line per global step (the CLI's epoch line)."""

    def __init__(self, report: Callable[[Any, Any], None]) -> None:
        self._report = report

    def start(self, opt: Any) -> None:
        pass

    def epoch(self, opt: Any, report: Any, record: EpochRecord) -> None:
        self._report(opt, report)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def open_dashboard(
    *,
    target_batch_size: int,
    history_path: Path | None,
    metrics_address: tuple[str, int] | None,
    display: Callable[[ThroughputMeter], Display] | None,
    meter: ThroughputMeter | None = None,
) -> Iterator[Dashboard]:
    """A ``Dashboard`` with a history at ``history_path`` and metrics served at
    ``metrics_address`` (host, port), each when given, and the display
    ``display(throughput)`` makes. The history file is opened and the
    metrics port bound here, before any training: ``ConfigError`` if either
    cannot be. Call ``attach(peer)`` once the peer runs, so the metrics include
    its counters. Everything is closed on exit.
    """
    history = None if history_path is None else HistoryFile(history_path)
    try:
        metrics = None if metrics_address is None else PeerMetrics()
        with contextlib.ExitStack() as stack:
            if metrics is not None and metrics_address is not None:
                host, port = metrics_address
                bound = stack.enter_context(serve_metrics(metrics.registry, host, port))
                log.info("serving Prometheus metrics at http://%s:%d/metrics", host, bound)
            dashboard = Dashboard(
                target_batch_size=target_batch_size, history=history, metrics=metrics, meter=meter
            )
            if display is not None:
                dashboard.display = display(dashboard.throughput)
            try:
                yield dashboard
            finally:
                dashboard.close()
    finally:
        if history is not None:
            history.close()
