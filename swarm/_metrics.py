"""A peer's Prometheus metrics (``--metrics-port``), through ``prometheus_client``.

Each peer has a ``CollectorRegistry`` of its own, never the process-global
default, so many peers in one process (the tests, a benchmark) do not
collide. Two kinds of figures live in it:

- what the training loop observes once per global step (``observe_epoch``):
  epoch, the swarm's throughput and the compute rate, training and
  evaluation loss, accuracy, live peers, averaging time, and the outcome of
  each averaging round, failures labelled by cause;
- the counters the peer's layers keep (bytes sent and received, connections
  dialed and refused, DHT contacts and stored keys), read when Prometheus
  scrapes (``PeerCounters``): a custom collector reads them through
  ``read`` (the CLI passes one that runs on the peer's trio thread, where
  they are written), so they are never copied into a second set of counters.

``serve_metrics`` serves the registry over HTTP for as long as its block runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._errors import ConfigError, SwarmError
from ._history import EpochRecord

log = logging.getLogger(__name__)

#: Buckets of the averaging-time histogram, in seconds (a round is bounded by
#: ``averaging_timeout``, 60 s by default).
AVERAGING_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class PeerCounters:
    """The peer's own counters at one moment (see ``swarm.AsyncPeer``)."""

    bytes_sent: int
    bytes_received: int
    connections_dialed: int
    inbound_refused: int
    dht_contacts: int
    dht_stored_keys: int


def read_peer_counters(peer: object) -> PeerCounters:
    """``peer``'s counters (an ``AsyncPeer``); call it on the peer's trio thread,
    where they change."""
    connections = peer.connections  # type: ignore[attr-defined]
    dht = peer.dht  # type: ignore[attr-defined]
    return PeerCounters(
        bytes_sent=connections.bytes_sent,
        bytes_received=connections.bytes_received,
        connections_dialed=connections.dialed,
        inbound_refused=connections.refused_inbound,
        dht_contacts=dht.routing_table_size(),
        dht_stored_keys=dht.stored_key_count(),
    )


class _PeerCollector(Collector):
    def __init__(self, read: Callable[[], PeerCounters]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        try:
            c = self._read()
        except SwarmError as e:  # the peer is stopping: its figures are gone
            log.debug("metrics: cannot read the peer's counters: %s", e)
            return []
        return [
            CounterMetricFamily(
                "swarm_bytes_sent", "Bytes sent over peer connections", value=c.bytes_sent
            ),
            CounterMetricFamily(
                "swarm_bytes_received",
                "Bytes received over peer connections",
                value=c.bytes_received,
            ),
            CounterMetricFamily(
                "swarm_connections_dialed",
                "Outbound peer connections made",
                value=c.connections_dialed,
            ),
            CounterMetricFamily(
                "swarm_inbound_refused",
                "Inbound connections closed at once for a limit",
                value=c.inbound_refused,
            ),
            GaugeMetricFamily(
                "swarm_dht_contacts", "Peers in the DHT routing table", value=c.dht_contacts
            ),
            GaugeMetricFamily(
                "swarm_dht_stored_keys", "Keys this DHT node stores", value=c.dht_stored_keys
            ),
        ]


class PeerMetrics:
    """One peer's metrics in a registry of its own (``registry``)."""

    def __init__(self, read_counters: Callable[[], PeerCounters] | None = None) -> None:
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
        if read_counters is not None:
            self.watch(read_counters)

    def watch(self, read_counters: Callable[[], PeerCounters]) -> None:
        """Include the counters ``read_counters`` returns, read at each scrape."""
        self.registry.register(_PeerCollector(read_counters))

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
