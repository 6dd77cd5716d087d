"""The pure parts of the dashboard: the metric history file, the throughput
meter, the outcome of a round, the JSON log format, the metrics registry, and
the peer's own counters served over HTTP."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarm import ConfigError, Peer, PeerConfig, PeerID, Stream
from swarm._dashboard import Dashboard, round_outcome
from swarm._history import EpochRecord, HistoryFile, history_path, read_history
from swarm._live import format_eta
from swarm._log_file import JsonFormatter
from swarm._metrics import PeerMetrics, serve_metrics


def test_history_round_trip_skips_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "history.jsonl"
    records = [
        EpochRecord(time=10.0, epoch=1, train_loss=2.0, samples_per_second=100.0, peers=2),
        EpochRecord(time=11.5, epoch=2, eval_loss=math.nan, accuracy=0.5, final=True),
    ]
    with HistoryFile(path) as history:
        for record in records:
            history.append(record)
    with path.open("a") as file:
        file.write('{"time": 12.0, "epo')  # a writer killed mid-line
    got = read_history(path)
    assert got[0] == records[0]
    assert got[1].eval_loss is None and got[1].accuracy == 0.5  # NaN is written as null
    assert len(got) == 2
    with HistoryFile(path) as history:  # a restarted peer appends
        history.append(EpochRecord(time=13.0, epoch=3))
    assert [r.epoch for r in read_history(path)] == [1, 2, 3]


def test_history_path_and_unwritable_history(tmp_path: Path) -> None:
    assert history_path(tmp_path, "x.log") == tmp_path / "history.jsonl"
    assert history_path(None, tmp_path / "run.log") == tmp_path / "run.history.jsonl"
    assert history_path(None, None) is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the metric history"):
        HistoryFile(blocker / "history.jsonl")
    with pytest.raises(ConfigError, match="cannot read the metric history"):
        read_history(tmp_path / "none.jsonl")


@dataclass
class _Member:
    peer_id: PeerID


@dataclass
class _Result:
    group: object | None
    reason: str = ""
    members: tuple[PeerID, ...] = ()
    contributors: frozenset[PeerID] = field(default_factory=frozenset)


@dataclass
class _Step:
    averaging: _Result | None
    averaging_seconds: float = 0.5


def test_round_outcome_names_each_cause() -> None:
    a, b = PeerID(bytes(20)), PeerID(bytes([1]) * 20)
    assert round_outcome(_Step(None), peers=1) == ("alone", None)
    assert round_outcome(_Step(None), peers=3) == ("failed", "error")
    for reason, cause in [
        ("no group formed in time", "no_group"),
        ("timed out in matchmaking", "matchmaking_timeout"),
        ("timed out during the all-reduce", "allreduce_timeout"),
        ("something new", "other"),
    ]:
        assert round_outcome(_Step(_Result(None, reason)), peers=3) == ("failed", cause)
    whole = _Result(object(), members=(a, b), contributors=frozenset({a, b}))
    assert round_outcome(_Step(whole), peers=2) == ("averaged", None)
    lost = _Result(object(), members=(a, b), contributors=frozenset({a}))
    assert round_outcome(_Step(lost), peers=2) == ("failed", "members_lost")


def test_json_log_lines_carry_fields_without_replacing_the_four() -> None:
    record = logging.LogRecord("swarm.x", logging.WARNING, __file__, 1, "hello %s", ("you",), None)
    record.fields = {"epoch": 3, "message": "clash", "loss": math.inf}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "hello you" and entry["field_message"] == "clash"
    assert entry["level"] == "WARNING" and entry["logger"] == "swarm.x"
    assert entry["epoch"] == 3 and entry["loss"] is None
    assert entry["time"].endswith("+00:00")


def test_metrics_registry_is_per_peer() -> None:
    first, second = PeerMetrics(), PeerMetrics()
    record = EpochRecord(time=0.0, epoch=4, train_loss=1.5, samples_per_second=300.0, peers=3)
    first.observe_epoch(record, outcome="failed", cause="no_group")
    text = generate_latest(first.registry).decode()
    assert "swarm_epoch 4.0" in text and "swarm_peers_alive 3.0" in text
    assert 'swarm_averaging_round_failures_total{cause="no_group"} 1.0' in text
    assert "swarm_epoch 0.0" in generate_latest(second.registry).decode()  # not shared


async def _echo(stream: Stream) -> None:
    await stream.send(await stream.receive())


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def test_metrics_serve_the_peers_own_counters_not_copies() -> None:
    """Two real peers talk over TCP and UDP; what /metrics serves over HTTP
    is exactly what each layer's own properties say, for each peer."""
    config = PeerConfig(host="127.0.0.1")
    with (
        Peer(config=config) as first,
        Peer(config=replace(config, initial_peers=(first.address,))) as second,
    ):
        first.async_peer.connections.set_handler("echo", _echo)
        payload = bytes(range(256)) * 64
        reply = second.run(
            functools.partial(
                second.async_peer.connections.call,
                first.peer_id,
                first.async_peer.endpoint,
                "echo",
                payload,
                timeout=10,
            )
        )
        assert reply == payload
        second.dht.store("k", "v", time.time() + 60)
        metrics = {p: PeerMetrics() for p in (first, second)}
        with contextlib.ExitStack() as stack:
            scraped = {}
            for peer, registry in metrics.items():
                registry.watch(peer.metrics)
                port = stack.enter_context(serve_metrics(registry.registry, "127.0.0.1", 0))
                scraped[peer] = _scrape(port)
        for peer, got in scraped.items():
            connections = peer.async_peer.connections
            assert got["swarm_bytes_sent_total"] == connections.bytes_sent
            assert got["swarm_bytes_received_total"] == connections.bytes_received
            assert got["swarm_connections_dialed_total"] == connections.dialed
            assert got["swarm_inbound_refused_total"] == connections.refused_inbound == 0
            dht = peer.async_peer.dht
            assert got["swarm_dht_contacts"] == peer.run_sync(dht.routing_table_size) == 1
            assert got["swarm_dht_stored_keys"] == peer.run_sync(dht.stored_key_count)
            # the DHT's datagram counters (read after the scrape: maintenance may
            # have sent more since, never fewer)
            stats = peer.run_sync(dht.stats)
            assert 0 < got["swarm_dht_sent_datagrams_total"] <= stats.sent_datagrams
            assert 0 < got["swarm_dht_sent_bytes_total"] <= stats.sent_bytes
            assert got["swarm_dht_largest_datagram_bytes"] <= stats.largest_datagram
            assert got["swarm_dht_dropped_datagrams_total"] == dht.dropped_datagrams == 0
        # the echo: what one sent the other received, and only `second` dialed
        assert (
            scraped[second]["swarm_bytes_sent_total"]
            == scraped[first]["swarm_bytes_received_total"]
            > len(payload)
        )
        assert (
            scraped[first]["swarm_connections_dialed_total"],
            scraped[second]["swarm_connections_dialed_total"],
        ) == (0, 1)
        assert sum(s["swarm_dht_stored_keys"] for s in scraped.values()) >= 1


def test_dashboard_keeps_going_when_the_history_cannot_be_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    history = HistoryFile("/dev/full")  # every write fails: no space left on the device
    dashboard = Dashboard(target_batch_size=8, history=history, wall_clock=lambda: 1.0)
    with caplog.at_level(logging.WARNING, logger="swarm.metrics"):
        for epoch in (1, 2):
            dashboard.finish(epoch, {"loss": 1.0})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "training on" in warnings[0].getMessage()
    history.close()  # what could not be written is not retried on close


def test_format_eta() -> None:
    assert format_eta(None) == "-" and format_eta(math.inf) == "-"
    assert format_eta(3725.4) == "1:02:05"
