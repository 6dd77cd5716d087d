"""Measured link rates: the meter's arithmetic, the part rule, the records
that carry the rates, and an averager that measures its own rounds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import trio
from peer_harness import averager_config, open_peers
from test_allreduce import make_groups
from test_allreduce import open_peers as open_nets
from test_connections import max_pacing_rate

from averaging import (
    AllReduceConfig,
    Averager,
    AveragerConfig,
    Group,
    GroupMember,
    LinkMeter,
    MemberMode,
    MoshpitGrid,
    StepResult,
)
from averaging._allreduce import _auto_paced, all_reduce
from averaging._averager import UPLOAD_PACING_SHARE
from averaging._link_meter import (
    AUTO_PACING_MAX,
    AUTO_PACING_SHARE,
    DRAIN_POLL,
    DRAIN_STALL,
    MIN_SAMPLE_BYTES,
    MIN_UNPACED,
    PROBE_EVERY,
    QUEUED,
    RoundTraffic,
)
from averaging._matchmaking import (
    Candidate,
    announcement,
    member_from_wire,
    member_to_wire,
    parse_candidates,
)
from averaging._partition import Partition, part_sizes, part_weights
from dht import DHTValue, owner_marker
from swarm import ConfigError, Identity, PeerID, ProtocolError
from swarm._connections import _Connection

MIB = 2**20


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_the_transfers() -> None:
    clock = FakeClock()
    meter = LinkMeter(clock)
    traffic = meter.round_traffic()
    with traffic.sending(MIB):  # 0 .. 2
        clock.now = 1.0
        with traffic.sending(MIB):  # 1 .. 3: overlaps, counted once
            clock.now = 2.0
        clock.now = 3.0
    clock.now = 10.0  # idle: waiting for results is not the link's doing
    with traffic.sending(MIB):  # 10 .. 11
        clock.now = 11.0
    meter.record(traffic)
    assert meter.upload == 3 * MIB / 4.0
    assert meter.download == 0.0  # nothing received


def test_a_failed_transfer_counts_its_time_but_not_its_bytes() -> None:
    clock = FakeClock()
    meter = LinkMeter(clock)
    traffic = meter.round_traffic()
    with traffic.receiving(MIB):
        clock.now = 1.0
    with pytest.raises(RuntimeError), traffic.receiving(MIB):
        clock.now = 2.0
        raise RuntimeError("connection lost")
    meter.record(traffic)
    assert meter.download == MIB / 2.0


class FakeConnection:
    def __init__(self, delay: float | None = None) -> None:
        self.queued = 0
        self.delay = delay

    def unacknowledged_bytes(self) -> int:
        return self.queued

    def queueing_delay(self) -> float | None:
        return self.delay


def test_only_bytes_that_crossed_while_sends_ran_count() -> None:
    """A send the kernel buffers returns at once; its bytes cross later,
    untimed, and must not make the link look fast."""
    clock = FakeClock()
    meter = LinkMeter(clock)
    traffic = meter.round_traffic()
    a, b = FakeConnection(), FakeConnection()
    with traffic.sending(MIB, a):  # buffered whole: returns at once
        a.queued = MIB
    clock.now = 5.0  # a drains while nothing is timed
    a.queued = 0
    with traffic.sending(MIB, b):  # buffered too: b now holds 1 MiB
        b.queued = MIB
    with traffic.sending(MIB, a):  # blocks for 1 s while a and b both drain
        clock.now = 6.0
        a.queued = MIB // 2
        b.queued = 0
    meter.record(traffic)
    # the timed second: a's new MiB less the half it still holds, and b's MiB
    assert meter.upload == MIB * 1.5 / 1.0


class DrainingConnection(FakeConnection):
    """A connection whose kernel takes every send at once and then moves
    ``rate`` bytes a second across the link; counts the meter's reads."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = rate
        self.reads = 0

    def unacknowledged_bytes(self) -> int:
        self.reads += 1
        return self.queued

    async def drain(self, until: int = 0) -> None:
        while self.queued > until:
            await trio.sleep(0.001)
            self.queued = max(until, self.queued - int(self.rate * 0.001))


async def test_bytes_that_cross_after_their_sends_returned_count_with_their_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A fast link, parts the kernel takes whole: every send returns at once
    and its bytes cross while no send runs. The round's watcher counts them
    over the time they took; waiting for results afterwards is not counted.
    Without it the round counts nothing and the peer publishes no rate."""
    traffic = RoundTraffic(trio.current_time)
    link = DrainingConnection(rate=10 * MIB)
    async with traffic.watching_drains():
        for _ in range(2):
            with traffic.sending(MIB, link):
                link.queued = MIB
            await link.drain()
            await trio.sleep(1.0)  # the results
    assert traffic.up.bytes == 2 * MIB
    # 0.1 s each; each drain's time errs high by at most one read
    assert 0.2 <= traffic.up.busy <= 0.2 + 2 * DRAIN_POLL + 1e-9
    assert traffic.up.rate() is not None


async def test_a_drain_that_stalls_is_left_and_its_wait_not_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    traffic = RoundTraffic(trio.current_time)
    link = DrainingConnection(rate=10 * MIB)
    async with traffic.watching_drains():
        with traffic.sending(MIB, link):
            link.queued = MIB
        await link.drain(until=MIB // 2)  # 50 ms, then the receiver stops reading
        await trio.sleep(DRAIN_STALL + 0.1)
        reads = link.reads
        await trio.sleep(10.0)
        assert link.reads == reads  # no longer watched
    assert traffic.up.bytes == MIB // 2
    assert 0.05 <= traffic.up.busy <= 0.05 + DRAIN_POLL + 1e-9  # not the stalled wait


def test_small_rounds_do_not_count_and_the_median_of_recent_rounds_does() -> None:
    clock = FakeClock()
    meter = LinkMeter(clock, window=3)
    small = meter.round_traffic()
    with small.sending(MIN_SAMPLE_BYTES - 1):
        clock.now += 1.0
    meter.record(small)
    assert meter.upload == 0.0
    for seconds in (1.0, 4.0, 2.0, 1.0, 8.0):  # the window keeps the last three
        traffic = meter.round_traffic()
        with traffic.sending(MIB):
            clock.now += seconds
        meter.record(traffic)
    assert meter.upload == MIB / 2.0  # median of MiB/2, MiB/1, MiB/8
    with pytest.raises(ValueError):
        LinkMeter(clock, window=0)


def _member(i: int, **kwargs: object) -> GroupMember:
    return GroupMember(PeerID(bytes([i]) * 20), "10.0.0.1", 1000 + i, **kwargs)  # type: ignore[arg-type]


def test_parts_follow_measured_uploads_when_every_reducer_has_one() -> None:
    members = (
        _member(1, upload=1e6, download=5e6),
        _member(2, upload=1e7, download=1e7),
        _member(3, upload=1e7),
        _member(4, bandwidth=0.0, mode=MemberMode.CLIENT),  # reduces nothing
    )
    assert part_weights(members) == [1e6, 1e7, 1e7, 0.0]
    assert part_sizes(2100, part_weights(members), [m.mode for m in members]) == [
        100,
        1000,
        1000,
        0,
    ]


def test_one_reducer_without_a_measurement_means_declared_shares_for_all() -> None:
    # a member that declares its share publishes no rate: the units do not mix
    members = (_member(1, upload=1e6), _member(2, bandwidth=3.0), _member(3, upload=1e7))
    assert part_weights(members) == [1.0, 3.0, 1.0]
    bounds = Partition.for_group(Group(b"g", members, 0), 500, 10).part_bounds
    assert bounds == ((0, 100), (100, 400), (400, 500))


def test_rates_must_be_finite_and_not_negative() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            _member(1, upload=bad)
        with pytest.raises(ConfigError):
            _member(1, download=bad)


def test_members_and_candidates_carry_the_rates_and_old_records_still_parse() -> None:
    measured = _member(7, upload=1.5e6, download=2.5e6)
    plain = _member(8, bandwidth=2.0)
    for member in (measured, plain):
        assert member_from_wire(member_to_wire(member)) == member
        candidate = Candidate(member, 123.5)
        assert Candidate.from_wire(candidate.to_wire()) == candidate
    # a member that measured nothing is on the wire as before the rates existed
    assert member_to_wire(plain) == [bytes(plain.peer_id), "10.0.0.1", 1008, 2.0, "node"]
    assert len(member_to_wire(measured)) == 7
    old_candidate = [bytes(plain.peer_id), "10.0.0.1", 1008, 2.0, "node", 99.0]
    assert Candidate.from_wire(old_candidate) == Candidate(plain, 99.0)
    for bad in (
        [*member_to_wire(measured)[:6]],  # one rate alone
        [*member_to_wire(measured)[:5], -1.0, 0.0],
        [*member_to_wire(measured)[:5], "fast", 0.0],
        [*member_to_wire(measured), 0.0],
    ):
        with pytest.raises(ProtocolError):
            member_from_wire(bad)


def test_announcements_old_and_new_are_candidates() -> None:
    me = Identity.from_seed(b"\x01" * 32).peer_id
    old_peer = Identity.from_seed(b"\x02" * 32).peer_id
    new_peer = Identity.from_seed(b"\x03" * 32).peer_id
    broken_peer = Identity.from_seed(b"\x04" * 32).peer_id
    new = GroupMember(new_peer, "10.0.0.3", 31337, 1.0, MemberMode.NODE, 1e6, 2e6)
    entries = {
        owner_marker(old_peer): DHTValue(["10.0.0.2", 31337, 1.0, "node", 50.0], 60.0),
        owner_marker(new_peer): DHTValue(announcement(new, 51.0), 60.0),
        owner_marker(broken_peer): DHTValue(["10.0.0.4", 31337, 1.0, "node", 50.0, 1e6], 60.0),
    }
    found = DHTValue(entries, 60.0)
    candidates = {c.peer_id: c for c in parse_candidates(found, me)}
    assert set(candidates) == {old_peer, new_peer}
    assert candidates[old_peer].member.upload == 0.0
    assert candidates[new_peer] == Candidate(new, 51.0)


def test_averager_bandwidth_is_a_positive_number_or_measured() -> None:
    assert AveragerConfig().bandwidth is None
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError):
            AveragerConfig(bandwidth=bad)


def test_a_declared_upload_rate_is_bytes_per_second_and_paces_the_allreduce() -> None:
    declared = AveragerConfig().with_upload_rate(2.5e6)
    assert declared.upload_rate == 2.5e6 and declared.bandwidth is None
    assert declared.allreduce.upload_pacing == UPLOAD_PACING_SHARE * 2.5e6
    assert declared.allreduce == replace(AllReduceConfig(), upload_pacing=0.97 * 2.5e6)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="upload_rate"):
            AveragerConfig().with_upload_rate(bad)
    # a share relative to the others' and a rate in bytes per second do not mix
    with pytest.raises(ConfigError, match="not both"):
        AveragerConfig(bandwidth=2.0, upload_rate=2.5e6)


CONFIG = averager_config(
    group_size=3,
    min_group_size=3,
    matchmaking_time=3.0,
    poll_interval=None,
    sender_timeout=10.0,
    round_timeout=60.0,
)


async def test_averagers_publish_what_they_measured_and_cut_parts_by_it() -> None:
    """Three peers on loopback: after a round each has measured its link, its
    next group carries every member's rate, and the parts follow them."""
    async with open_peers(3, seed=3) as peers:
        gen = torch.Generator().manual_seed(3)
        values = [torch.randn(MIB, generator=gen) for _ in range(3)]
        averagers = [
            Averager(p, [values[i]], prefix="meter", config=CONFIG, grid=MoshpitGrid(1, 3))
            for i, p in enumerate(peers.alive)
        ]
        results: list[list[StepResult]] = [[], []]
        for r in range(2):

            async def one(i: int, r: int = r) -> None:
                with trio.fail_after(CONFIG.step_bound + 5):
                    results[r].append(await averagers[i].step(round=r, expected_peers=3))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
        first, second = results
        for res in first:
            assert res.group is not None and len(res.members) == 3
            assert all(m.upload == 0 for m in res.group.members)
        for averager in averagers:
            assert averager.link_meter.upload > 0 and averager.link_meter.download > 0
        groups = []
        for res in second:
            assert res.group is not None and res.allreduce is not None
            members = res.group.members
            assert len(members) == 3 and all(m.upload > 0 and m.download > 0 for m in members)
            weights = part_weights(members)
            assert weights == [m.upload for m in members]
            sizes = part_sizes(MIB, weights, [m.mode for m in members])
            assert [b - a for a, b in res.allreduce.part_bounds] == sizes
            assert res.contributors == frozenset(res.members)
            groups.append(members)
        # every member saw the same rates for every member
        assert groups[0] == groups[1] == groups[2]


#: what peer 0 of the next test declares: far under loopback's rate, so it
#: gets the smallest part once the others have measured theirs. A rate
#: measured on loopback is what the receiving peer drains, so on a loaded
#: machine it fell to 3.3 MB/s (under 10 MB/s, declared before): 1 MB/s, a
#: slow home uplink, leaves a margin (its pacing costs ~2 s a round here)
DECLARED = 1e6
#: elements averaged in that test: small, as the declarer uploads at DECLARED,
#: yet over ``MIN_SAMPLE_BYTES`` each way for every measured peer
DECLARED_ELEMENTS = MIB // 2


async def test_a_declared_upload_stands_in_for_the_measured_one_among_measured_peers() -> None:
    """Three peers on loopback, one declaring its upload (and pacing to it):
    its member carries the declared rate from the first round on, the others
    measure theirs, and once every member has a rate the parts follow them:
    the declared rate mixes with the measured ones, in the same unit."""
    configs = [CONFIG.with_upload_rate(DECLARED), CONFIG, CONFIG]
    async with open_peers(3, seed=4) as peers:
        gen = torch.Generator().manual_seed(4)
        values = [torch.randn(DECLARED_ELEMENTS, generator=gen) for _ in range(3)]
        mean = torch.stack(values).mean(dim=0)
        averagers = [
            Averager(p, [values[i]], prefix="declared", config=configs[i], grid=MoshpitGrid(1, 3))
            for i, p in enumerate(peers.alive)
        ]
        results: list[dict[int, StepResult]] = [{}, {}]
        for r in range(2):

            async def one(i: int, r: int = r) -> None:
                with trio.fail_after(CONFIG.step_bound + 5):
                    results[r][i] = await averagers[i].step(round=r, expected_peers=3)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
        declarer = peers.alive[0].peer_id
        first, second = results
        group = first[0].group
        assert group is not None
        uploads = {m.peer_id: m.upload for m in group.members}
        assert uploads.pop(declarer) == DECLARED and set(uploads.values()) == {0.0}
        assert all(torch.allclose(v, mean, atol=1e-6) for v in values)
        for i in range(3):
            res = second[i]
            assert res.group is not None and res.allreduce is not None
            assert res.contributors == frozenset(res.members)
            members = res.group.members
            rates = {m.peer_id: m.upload for m in members}
            assert rates[declarer] == DECLARED and all(rate > 0 for rate in rates.values())
            sizes = part_sizes(DECLARED_ELEMENTS, part_weights(members), [m.mode for m in members])
            assert [b - a for a, b in res.allreduce.part_bounds] == sizes
            # measured on loopback, the others are far faster than the declared link
            assert sizes[[m.peer_id for m in members].index(declarer)] == min(sizes)


#: the queueing delay of a link that unpaced flows overrun, and of one they do not
QUEUEING = 4 * QUEUED
NO_QUEUE = QUEUED / 50


def one_round(rate: float, delay: float | None = QUEUEING) -> RoundTraffic:
    """The traffic of a round that uploaded 4 MiB at ``rate`` bytes/s on a
    connection whose packets waited ``delay`` seconds in queues."""
    clock = FakeClock()
    traffic = RoundTraffic(clock)
    with traffic.sending(4 * MIB, FakeConnection(delay)):
        clock.now = 4 * MIB / rate
    return traffic


def test_the_pace_follows_unpaced_rounds_whose_flows_queued() -> None:
    meter = LinkMeter(FakeClock())
    assert meter.pacing_rate() is None  # nothing measured: unpaced
    meter.record(one_round(10e6, delay=None))  # the kernel did not say: no sign of a queue
    meter.record(one_round(10e6))
    assert meter.pacing_rate() is None  # one round that queued is not enough
    meter.record(one_round(9e6))
    # the largest: a busy CPU or a late receiver makes a round look slower, not faster
    assert meter.pacing_rate() == pytest.approx(AUTO_PACING_SHARE * 10e6)
    meter.record(one_round(11e6))
    assert meter.pacing_rate() == pytest.approx(AUTO_PACING_SHARE * 11e6)
    # the CPU or the receiver held the flows, not the link: pacing would only cap them
    meter.record(one_round(10e6, delay=NO_QUEUE))
    assert meter.pacing_rate() is None
    # faster than a home link: no pace, however the flows queued
    for _ in range(MIN_UNPACED):
        meter.record(one_round(2 * AUTO_PACING_MAX))
    assert meter.pacing_rate() is None


def test_paced_rounds_keep_the_pace_and_a_probe_comes_every_so_often() -> None:
    """A paced round measures the pace, not the link: it neither lowers nor
    raises the pace, and after ``PROBE_EVERY`` of them a round runs unpaced,
    whose figure (the link got faster) joins the estimate."""
    meter = LinkMeter(FakeClock())
    for _ in range(MIN_UNPACED):
        meter.record(one_round(10e6))
    pace = meter.pacing_rate()
    assert pace == pytest.approx(AUTO_PACING_SHARE * 10e6)
    for _ in range(PROBE_EVERY - 1):
        meter.record(one_round(0.95 * pace), paced=pace)
        assert meter.pacing_rate() == pace
    meter.record(one_round(0.95 * pace), paced=pace)
    assert meter.pacing_rate() is None  # the probe
    meter.record(one_round(11e6))
    assert meter.pacing_rate() == pytest.approx(AUTO_PACING_SHARE * 11e6)
    assert meter.upload == pytest.approx(0.95 * pace)  # what it publishes: every round's


def test_a_link_that_got_slower_is_probed_at_once_and_its_old_figures_dropped() -> None:
    meter = LinkMeter(FakeClock())
    for rate in (10e6, 10.2e6, 9.8e6):
        meter.record(one_round(rate))
    pace = meter.pacing_rate()
    assert pace == pytest.approx(AUTO_PACING_SHARE * 10.2e6)
    meter.record(one_round(0.5 * pace), paced=pace)  # the link no longer carries the pace
    assert meter.pacing_rate() is None
    meter.record(one_round(5e6))  # far from 10: a new link, a new history
    assert meter.pacing_rate() is None
    meter.record(one_round(5e6))
    assert meter.pacing_rate() == pytest.approx(AUTO_PACING_SHARE * 5e6)
    # and one that got faster, found by the next probe, as quickly
    for _ in range(PROBE_EVERY):
        meter.record(one_round(AUTO_PACING_SHARE * 5e6), paced=AUTO_PACING_SHARE * 5e6)
    assert meter.pacing_rate() is None
    for _ in range(MIN_UNPACED):
        meter.record(one_round(20e6))
    assert meter.pacing_rate() == pytest.approx(AUTO_PACING_SHARE * 20e6)


def test_a_set_pace_wins_and_automatic_pacing_can_be_turned_off() -> None:
    meter = LinkMeter(FakeClock())
    config = AllReduceConfig()
    assert config.auto_pacing and config.upload_pacing is None  # the default
    assert _auto_paced(config, meter) == config  # nothing measured yet
    for _ in range(MIN_UNPACED):
        meter.record(one_round(10e6))
    assert _auto_paced(config, meter) == replace(config, upload_pacing=meter.pacing_rate())
    assert _auto_paced(config, None) == config  # no meter, no measurement
    declared = replace(config, upload_pacing=1e6)
    assert _auto_paced(declared, meter) == declared
    off = replace(config, auto_pacing=False)
    assert _auto_paced(off, meter) == off


#: two members' all-reduce of this many floats: each uploads 512 KiB, paced at
#: AUTO_PACED (bytes/s) it takes a quarter of a second
PACED_ELEMENTS = MIB // 8
AUTO_PACED = AUTO_PACING_SHARE * 2e6


BASE = AllReduceConfig(sender_timeout=10.0, reducer_timeout=20.0, round_timeout=60.0)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (BASE, {int(AUTO_PACED)}),
        (replace(BASE, upload_pacing=1.5e6), {int(1.5e6)}),
        (replace(BASE, auto_pacing=False), set()),
    ],
    ids=["measured", "set", "off"],
)
async def test_a_measured_pace_caps_each_stream_of_a_real_round(
    config: AllReduceConfig, expected: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two peers on loopback whose meters measured a slow link that queued:
    their next round's stream to the other is paced (``SO_MAX_PACING_RATE``
    on the real connection) at the measured pace, or at the one the config
    sets, and is not paced with ``auto_pacing=False``."""
    caps: set[int] = set()  # every SO_MAX_PACING_RATE a connection was given
    pace = _Connection.pace

    def read_back(connection: _Connection, rate: float | None) -> None:
        pace(connection, rate)
        caps.add(max_pacing_rate(connection))

    monkeypatch.setattr(_Connection, "pace", read_back)
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(PACED_ELEMENTS, generator=gen) for _ in range(2)]
    mean = (values[0] + values[1]) / 2
    meters = [LinkMeter(trio.current_time) for _ in range(2)]
    for meter in meters:
        for _ in range(MIN_UNPACED):
            meter.record(one_round(2e6))
    async with open_nets(2) as nets:
        groups = make_groups(nets)

        async def member(i: int) -> None:
            await all_reduce(nets[i], groups[i], [values[i]], config=config, meter=meters[i])

        async with trio.open_nursery() as members:
            for i in range(2):
                members.start_soon(member, i)
    for v in values:
        torch.testing.assert_close(v, mean)
    assert caps - {2**64 - 1} == expected
