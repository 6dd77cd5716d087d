"""The pure parts behind ``swarm train``'s numbers and run settings: the
throughput meter, the settings record and the rule that adopts or refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dht import DHTValue, owner_marker
from swarm import Identity, PeerID, ProtocolError
from swarm._run_settings import (
    RunSettings,
    SettingsConflictError,
    choose,
    parse_run_settings,
    reconcile,
)
from swarm._throughput import Throughput, ThroughputMeter

RUN = RunSettings(
    task="digits",
    task_name="digits",
    target_batch_size=256,
    matchmaking_time=5.0,
    target_group_size=16,
    diloco=None,
    max_epochs=30,
    started=1000.0,
)


def test_throughput_counts_only_epochs_it_saw_taken() -> None:
    meter = ThroughputMeter(target_batch_size=100, window=2)
    assert meter.recent() is None and meter.overall() is None
    meter.observe(1, 10.0)
    assert meter.recent() is None  # one epoch is no interval
    meter.observe(2, 12.0)  # 100 samples in 2 s
    assert meter.recent() == Throughput(50.0, 2.0, 1)
    meter.observe(2, 13.0)  # the same epoch again: nothing new
    meter.observe(7, 14.0)  # a state download: when those steps happened is unknown
    meter.observe(8, 15.0)  # 100 samples in 1 s
    assert meter.recent() == Throughput(200 / 3, 1.5, 2)
    meter.observe(9, 19.0)  # 100 samples in 4 s; the window keeps the last two
    assert meter.recent() == Throughput(200 / 5, 2.5, 2)
    assert meter.overall() == Throughput(300 / 7, 7 / 3, 3)
    meter.observe(5, 20.0)  # a stale reading: the run does not go back
    assert meter.overall() == Throughput(300 / 7, 7 / 3, 3)
    with pytest.raises(ValueError):
        ThroughputMeter(target_batch_size=0)


def test_a_joiner_adopts_what_it_did_not_set_and_is_refused_otherwise() -> None:
    mine = RunSettings(
        "other.py:make", "digits", 512, 1.0, 4, 8, None, 2000.0, "bf16", True, ring=True
    )
    # nothing set: the run's settings, start time included
    assert reconcile(RUN, mine, frozenset()) == RUN
    # the same task under another path is the same task: its own path is kept
    adopted = reconcile(RUN, mine, frozenset({"task"}))
    assert adopted.task == "other.py:make" and adopted.target_batch_size == 256
    for name, option in RunSettings.OPTIONS.items():
        if name == "task":
            continue
        with pytest.raises(SettingsConflictError, match=f"^{option} "):
            reconcile(RUN, mine, frozenset({name}))
    renamed = RunSettings("x.py:f", "another-task", 256, 5.0, 16, None, 30, 0.0)
    with pytest.raises(
        SettingsConflictError, match="--task another-task differs from run's digits"
    ):
        reconcile(RUN, renamed, frozenset({"task"}))
    # the same values given explicitly: no conflict; no run yet: this peer's own
    assert reconcile(RUN, RUN, frozenset(RunSettings.OPTIONS)) == RUN
    assert reconcile(None, mine, frozenset({"task"})) == mine


def test_settings_records_round_trip_and_every_peer_chooses_the_same() -> None:
    assert RunSettings.from_value(RUN.to_value()) == RUN
    for field, bad in [
        ("target_batch_size", 0),
        ("target_batch_size", True),
        ("matchmaking_time", float("nan")),
        ("matchmaking_time", -1.0),
        ("task", ""),
        ("diloco", "4"),
        ("started", None),
    ]:
        with pytest.raises(ProtocolError):
            RunSettings.from_value(RUN.to_value() | {field: bad})
    with pytest.raises(ProtocolError):
        RunSettings.from_value([1, 2])
    with pytest.raises(ProtocolError):
        RunSettings.from_value(RUN.to_value() | {"precision": 16})
    # a record from before --precision was a run setting means fp32
    older = {k: v for k, v in RUN.to_value().items() if k != "precision"}
    assert RunSettings.from_value(older).precision == "fp32"
    bf16 = RunSettings(**(RUN.to_value() | {"precision": "bf16"}))
    assert RunSettings.from_value(bf16.to_value()) == bf16
    # --lossy: a boolean; a record from before it was a run setting means off
    lossy = RunSettings(**(RUN.to_value() | {"lossy": True}))
    assert RunSettings.from_value(lossy.to_value()) == lossy
    older = {k: v for k, v in RUN.to_value().items() if k != "lossy"}
    assert RunSettings.from_value(older).lossy is False
    with pytest.raises(ProtocolError):
        RunSettings.from_value(RUN.to_value() | {"lossy": 1})
    # --ring likewise: peers that disagree would fail every round they share
    ring = RunSettings(**(RUN.to_value() | {"ring": True}))
    assert RunSettings.from_value(ring.to_value()) == ring
    older = {k: v for k, v in RUN.to_value().items() if k != "ring"}
    assert RunSettings.from_value(older).ring is False
    with pytest.raises(ProtocolError, match="ring"):
        RunSettings.from_value(RUN.to_value() | {"ring": "yes"})

    a, b = (Identity.generate().peer_id for _ in range(2))
    later = RunSettings(**(RUN.to_value() | {"started": 2000.0, "target_batch_size": 64}))
    found = DHTValue(
        {
            owner_marker(a): DHTValue(later.to_value(), 0.0),
            owner_marker(b): DHTValue(RUN.to_value(), 0.0),
            "no-owner": DHTValue(RUN.to_value(), 0.0),
            owner_marker(Identity.generate().peer_id): DHTValue({"task": 1}, 0.0),
        },
        0.0,
    )
    published = parse_run_settings(found)
    assert published == {a: later, b: RUN}
    assert choose(published) == RUN  # the earliest start
    # a tie on the start: the lowest peer id, whichever order they arrive in
    tie = {a: RUN, b: later.__class__(**(RUN.to_value() | {"target_batch_size": 8}))}
    lowest = min((a, b), key=PeerID.hex)
    assert choose(tie) == tie[lowest] and choose(dict(reversed(tie.items()))) == tie[lowest]
    assert choose({}) is None and parse_run_settings(None) == {}


def test_status_names_each_number_for_what_it_is() -> None:
    from swarm.cli import _status_object, _status_table
    from trainer import PeerProgress, estimate

    peer = Identity.generate().peer_id
    record = PeerProgress(peer, 12, 40, 20000.0, 1099.5, loss=0.25, accuracy=0.9)
    swarm = estimate([record], now=1100.0, target_batch_size=1, stale_after=30.0)
    status = _status_object("digits", swarm, [record], 1100.0, RUN)
    # 12 epochs of 256 samples in the 100 s since the run began: the real throughput
    assert status["samples_per_second"] == pytest.approx(12 * 256 / 100)
    assert status["compute_samples_per_second"] == 20000.0
    assert status["settings"] == RUN.to_value() and status["seconds_since_start"] == 100.0
    (shown,) = status["peers"]
    assert shown["train_loss"] == shown["loss"] == 0.25
    assert shown["compute_samples_per_second"] == shown["samples_per_second"] == 20000.0
    table = _status_table(status).splitlines()
    assert table[0] == (
        "run digits: epoch 12, 1 peer, 31 samples/s since it began 100 s ago, "
        "compute 20000 samples/s"
    )
    assert table[1].split() == [
        "peer", "epoch", "compute", "samples/s", "train", "loss", "accuracy", "age", "(s)",
        "reachability", "device",
    ]  # fmt: skip
    # a record of an older peer: it says neither its reachability nor its device
    assert table[2].split() == [
        str(peer), "12", "20000.0", "0.2500", "0.900", "0.5", "-", "unknown"
    ]  # fmt: skip
    assert shown["reachability"] is None
    # a peer that says where it trains: the label, whole, in the table and the JSON
    gpu = replace(record, device="cuda:0 NVIDIA H100 80GB HBM3 bf16")
    status = _status_object("digits", swarm, [gpu], 1100.0, RUN)
    assert status["peers"][0]["device"] == gpu.device
    shown_row = _status_table(status).splitlines()[2]
    assert shown_row.endswith("  0.5  -             cuda:0 NVIDIA H100 80GB HBM3 bf16")
    # a peer behind a NAT says so
    natted = PeerProgress(peer, 12, 40, 1.0, 1099.5, client=True, reachability="unreachable")
    assert PeerProgress.from_value(peer, natted.to_value()) == natted
    status = _status_object("digits", swarm, [natted], 1100.0, RUN)
    assert status["peers"][0]["reachability"] == "unreachable"
    assert _status_table(status).splitlines()[2].split()[-2:] == ["unreachable", "unknown"]
    # and with how many peers it holds connections punched through NATs
    punched = replace(natted, punched=2)
    assert PeerProgress.from_value(peer, punched.to_value()) == punched
    status = _status_object("digits", swarm, [punched], 1100.0, RUN)
    assert status["peers"][0]["punched"] == 2
    assert _status_table(status).splitlines()[2].split()[-2:] == [
        "unreachable,punched:2",
        "unknown",
    ]
    # a peer that has not measured its rate yet: no "compute 0 samples/s"
    fresh = replace(record, samples_per_second=0.0)
    unmeasured = estimate([fresh], now=1100.0, target_batch_size=1, stale_after=30.0)
    head = _status_table(_status_object("digits", unmeasured, [fresh], 1100.0, RUN))
    assert "compute" not in head.splitlines()[0], head
    # without the run's settings (or in DiLoCo mode) the real throughput is unknown
    for settings in (None, RunSettings(**(RUN.to_value() | {"diloco": 4}))):
        unknown = _status_object("digits", swarm, [record], 1100.0, settings)
        assert unknown["samples_per_second"] is None
        assert "since it began" not in _status_table(unknown)
