"""The pure parts of the dashboard: the metric history file, the throughput
meter, the outcome of a round, the JSON log format, the metrics registry."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from swarm import ConfigError, PeerID
from swarm._dashboard import Dashboard, round_outcome
from swarm._history import EpochRecord, HistoryFile, history_path, read_history
from swarm._live import format_eta
from swarm._log_file import JsonFormatter
from swarm._metrics import PeerCounters, PeerMetrics


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


def test_metrics_registry_is_per_peer_and_reads_the_peers_counters() -> None:
    counters = PeerCounters(1000, 2000, 3, 1, 5, 7)
    first, second = PeerMetrics(lambda: counters), PeerMetrics()
    record = EpochRecord(time=0.0, epoch=4, train_loss=1.5, samples_per_second=300.0, peers=3)
    first.observe_epoch(record, outcome="failed", cause="no_group")
    text = generate_latest(first.registry).decode()
    assert "swarm_epoch 4.0" in text and "swarm_peers_alive 3.0" in text
    assert 'swarm_averaging_round_failures_total{cause="no_group"} 1.0' in text
    assert "swarm_bytes_sent_total 1000.0" in text and "swarm_dht_stored_keys 7.0" in text
    assert "swarm_epoch 0.0" in generate_latest(second.registry).decode()  # not shared


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
