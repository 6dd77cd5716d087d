"""The figures a layer keeps about itself, as ``prometheus_client`` metric objects.

A layer (the peer connections, the DHT node) keeps each of its counts in a
``prometheus_client`` ``Counter`` or ``Gauge`` made here, and lists them in a
``metrics`` attribute. Those objects are the only copy: a peer's registry
(``swarm._metrics.PeerMetrics.watch``) registers the very objects, so what
``/metrics`` serves, what a test asserts and what a benchmark reads are one
figure, never copied into a second set of counters.

The objects are made without a registry (``registry=None``): each peer's
metrics live in a ``CollectorRegistry`` of its own, so many peers in one
process (the tests, a benchmark) never collide in the global default one.
``prometheus_client`` metrics are thread-safe, so the trio thread writes them
while the metrics server's thread reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from prometheus_client import Counter, Gauge


def new_counter(name: str, documentation: str) -> Counter:
    """A counter that belongs to no registry yet (exposed as ``<name>_total``)."""
    return Counter(name, documentation, registry=None)


def count_of(counter: Counter) -> int:
    """The current value of ``counter`` (made by ``new_counter``), as an integer:
    the counts kept here are whole (bytes, connections)."""
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                return int(sample.value)
    raise AssertionError(f"counter {counter!r} has no _total sample")  # prometheus_client changed


def new_trio_gauge(
    name: str, documentation: str, read: Callable[[], float], token: trio.lowlevel.TrioToken
) -> Gauge:
    """A gauge (in no registry yet) whose value is ``read()``, called when the
    gauge is collected: on the trio thread of ``token``'s run, where the state
    it reads changes (from that thread itself, directly). Once that run has
    ended the gauge reads 0: a stopped layer holds nothing."""

    def on_trio_thread() -> float:
        try:
            if trio.lowlevel.current_trio_token() is token:
                return read()
        except RuntimeError:  # not in a trio run: this is another thread
            pass
        try:
            return trio.from_thread.run_sync(read, trio_token=token)
        except trio.RunFinishedError:
            return 0.0

    gauge = Gauge(name, documentation, registry=None)
    gauge.set_function(on_trio_thread)
    return gauge


def gauge_value(gauge: Gauge) -> float:
    """The current value of ``gauge`` (one without labels)."""
    for metric in gauge.collect():
        for sample in metric.samples:
            return float(sample.value)
    raise AssertionError(f"gauge {gauge!r} has no sample")  # prometheus_client changed
