"""A peer's Prometheus metrics (``--metrics-port``), through ``prometheus_client``.

Each peer has a ``CollectorRegistry`` of its own, never the process-global
default, so many peers in one process (the tests, a benchmark) do not
collide. Two kinds of figures live in it:

- what the training loop observes once per global step (``observe_epoch``):
  epoch, the swarm's throughput and the compute rate, training and
  evaluation loss, accuracy, live peers, averaging time, and the outcome of
  each averaging round, failures labelled by cause;
- the figures the peer's layers keep (bytes sent and received, connections
  dialed and refused, DHT contacts and stored keys): the layers keep them in
  ``prometheus_client`` metric objects (``swarm._counters``) and ``watch``
  registers those very objects here, so ``/metrics``, the layers' own
  properties (``Connections.bytes_sent``) and the tests read one figure.

``serve_metrics`` serves the registry over HTTP for as long as its block runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

from ._errors import ConfigError
from ._history import EpochRecord

log = logging.getLogger(__name__)

#: Buckets of the averaging-time histogram, in seconds (a round is bounded by
#: ``averaging_timeout``, 60 s by default).
AVERAGING_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class PeerMetrics:
    """One peer's metrics in a registry of its own (``registry``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.epoch = Gauge("swarm_epoch", "Global steps of the swarm completed", registry=r)
        self.samples_per_second = Gauge(
            "swarm_samples_per_second",
            "The swarm's throughput: samples of completed global steps per second of wall time",
            registry=r,
        )
        self.compute_samples_per_second = Gauge(
            "swarm_compute_samples_per_second",
            "Samples per second the peers compute, averaging left out",
            registry=r,
        )
        self.train_loss = Gauge(
            "swarm_train_loss", "Mean training loss of this peer's latest batches", registry=r
        )
        self.eval_loss = Gauge("swarm_eval_loss", "Loss of the latest evaluation", registry=r)
        self.accuracy = Gauge(
            "swarm_eval_accuracy", "Accuracy of the latest evaluation (0-1)", registry=r
        )
        self.peers = Gauge(
            "swarm_peers_alive", "Live peers of the run, this one included", registry=r
        )
        self.averaging_seconds = Histogram(
            "swarm_averaging_seconds",
            "Seconds this peer spent averaging per global step",
            buckets=AVERAGING_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "swarm_averaging_rounds",
            "Global steps by how their averaging went: averaged, alone (no other peer), failed",
            ["outcome"],
            registry=r,
        )
        self.round_failures = Counter(
            "swarm_averaging_round_failures",
            "Averaging rounds that failed, by cause",
            ["cause"],
            registry=r,
        )

    def watch(self, metrics: Iterable[Collector]) -> None:
        """Expose ``metrics`` (a peer's ``metrics``: its layers' own metric
        objects) in this registry. Raises ``ValueError`` if a name is already
        exposed (a second peer watched by the same registry)."""
        for metric in metrics:
            self.registry.register(metric)

    def observe_epoch(self, record: EpochRecord, *, outcome: str, cause: str | None) -> None:
        """Record one global step (``outcome`` averaged, alone or failed, and the
        ``cause`` of a failure) or the final evaluation (``outcome`` "")."""
        self.epoch.set(record.epoch)
        self.peers.set(record.peers)
        for gauge, value in (
            (self.samples_per_second, record.samples_per_second),
            (self.compute_samples_per_second, record.compute_samples_per_second),
            (self.train_loss, record.train_loss),
            (self.eval_loss, record.eval_loss),
            (self.accuracy, record.accuracy),
        ):
            if value is not None:
                gauge.set(value)
        if record.averaging_seconds is not None:
            self.averaging_seconds.observe(record.averaging_seconds)
        if outcome:
            self.rounds.labels(outcome=outcome).inc()
        if cause is not None:
            self.round_failures.labels(cause=cause).inc()


@contextlib.contextmanager
def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> Iterator[int]:
    """Serve ``registry`` at ``http://host:port/metrics`` (any path) for the
    duration of the block, from a thread of its own; yields the port (useful
    with port 0). Raises ``ConfigError`` if the port cannot be bound. The
    server is shut down and its thread joined on exit."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise ConfigError(
            f"--metrics-port {port}: cannot listen on {host}: {e.strerror or e}"
        ) from e
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
