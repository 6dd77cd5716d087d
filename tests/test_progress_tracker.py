"""The progress tracker over real DHT nodes: who is counted, and when; totals
through the aggregation tree, names in a directory that stays small."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing
from dht_harness import TEST_CONFIG, open_swarm

from dht import open_dht_node
from swarm import ConfigError, ManualClock, PeerID
from swarm.cli import _status_object, _status_table
from trainer import (
    PeerProgress,
    ProgressTracker,
    TrackerConfig,
    observe_progress,
    parse_progress,
    progress_key,
)

NOW = 1_700_000_000.0


def _tracker(node: object, clock: ManualClock, epoch: list[int]) -> ProgressTracker:
    peer_id: PeerID = node.peer_id  # type: ignore[attr-defined]

    def record() -> PeerProgress:
        return PeerProgress(peer_id, epoch[0], 32, 100.0, clock())

    return ProgressTracker(
        node,  # type: ignore[arg-type]
        peer_id,
        "run",
        record=record,
        target_batch_size=256,
        config=TrackerConfig(progress_interval=1.0, progress_ttl=30.0, fresh_within=5.0),
        clock=clock,
    )


async def test_a_peer_counts_in_the_run_from_its_first_publication_until_it_withdraws() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(3, clock, seed=3) as swarm:
        a, b = swarm.nodes[0], swarm.nodes[2]
        epochs = {a.peer_id: [4], b.peer_id: [4]}
        first, second = _tracker(a, clock, epochs[a.peer_id]), _tracker(b, clock, epochs[b.peer_id])
        await first.refresh()
        # a read-only refresh counts the others and itself, but publishes nothing
        reading = await second.refresh(publish=False)
        assert (reading.swarm.num_peers, reading.expected, reading.swarm.reported) == (2, 2, 64)
        assert (await first.refresh()).swarm.num_peers == 1
        await second.refresh()
        assert (await first.refresh()).swarm.num_peers == 2
        # one epoch behind and silent for longer than fresh_within: not expected
        epochs[b.peer_id][0] = 3
        clock.advance(0.5)  # a later version of its record (the merge keeps the latest)
        await second.refresh()
        clock.advance(6.0)
        reading = await first.refresh()
        assert (reading.swarm.num_peers, reading.expected) == (2, 1)
        await second.withdraw()
        assert (await first.refresh()).swarm.num_peers == 1


async def test_a_read_that_misses_a_live_peer_keeps_counting_it_until_its_record_is_stale() -> None:
    """A read that reaches no node that holds the records (here: the only full
    node stopped; in life: a NATed client whose one contact timed out under
    load) is not news that the others left. It once read as "nobody else is
    training", and a peer stepped alone for seven epochs and lost its group.
    A peer counts until its last record read goes stale, or it withdraws."""
    clock = ManualClock(NOW)
    client = replace(TEST_CONFIG, client_mode=True)
    stop_storage, storage_stopped = trio.Event(), trio.Event()

    async def storage(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        async with open_dht_node(config=TEST_CONFIG, clock=clock) as node:
            task_status.started((node.host, node.port))
            await stop_storage.wait()
        storage_stopped.set()

    async with trio.open_nursery() as nursery:
        initial = [await nursery.start(storage)]
        async with (
            open_dht_node(config=client, clock=clock, initial_peers=initial) as a,
            open_dht_node(config=client, clock=clock, initial_peers=initial) as b,
        ):
            first, second = _tracker(a, clock, [4]), _tracker(b, clock, [4])
            await first.refresh()
            assert (await second.refresh()).swarm.num_peers == 2
            stop_storage.set()
            await storage_stopped.wait()
            assert await b.get(progress_key("run")) is None  # the read reaches nobody now
            clock.advance(20.0)
            assert (await second.refresh()).swarm.num_peers == 2  # a's record is 20 s old
            clock.advance(11.0)
            assert (await second.refresh()).swarm.num_peers == 1  # 31 s: stale (ttl 30 s)


async def test_a_reading_says_when_every_other_peer_stepped_past_this_one() -> None:
    """``Reading.passed_by``: only once no other live peer is at this peer's
    epoch or finishing the step before it (its record lags it, and it may
    still form a group with this peer) and the swarm is beyond it; a peer
    waits for its group while next to a new reading, ``next_reading``."""
    clock = ManualClock(NOW)
    async with open_swarm(3, clock, seed=6) as swarm:
        a, b, c = swarm.nodes
        epochs = {a.peer_id: [4], b.peer_id: [5], c.peer_id: [4]}
        trackers = [_tracker(node, clock, epochs[node.peer_id]) for node in swarm.nodes]
        for tracker in trackers:
            await tracker.refresh()
        assert not (await trackers[0].refresh()).passed_by  # c is at a's epoch
        epochs[c.peer_id][0] = 5
        clock.advance(0.5)
        await trackers[2].refresh()
        seen: list[bool] = []

        async def wait_for_reading() -> None:
            seen.append((await trackers[0].next_reading()).passed_by)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_reading)
            await trio.testing.wait_all_tasks_blocked()
            assert not seen  # no reading yet
            await trackers[0].refresh()
        assert seen == [True]  # b and c at 5, a at 4
        assert not (await trackers[1].refresh()).passed_by  # b is not behind
        epochs[c.peer_id][0] = 6
        clock.advance(0.5)
        await trackers[2].refresh()
        # a, one behind b, may be finishing its step and join b's round
        assert not (await trackers[1].refresh()).passed_by
        epochs[a.peer_id][0] = 3  # a fell two behind: it downloads the state
        clock.advance(0.5)
        await trackers[0].refresh()
        assert (await trackers[1].refresh()).passed_by


async def test_a_reading_names_the_peers_of_the_next_epochs_round() -> None:
    """A step taken before the next reading goes by ``Reading.round_of``
    (the peers at most one epoch behind this peer: their records lag them),
    not by a read in its way; a reading whose other peers were all further
    behind says nothing of that round."""
    clock = ManualClock(NOW)
    async with open_swarm(4, clock, seed=5) as swarm:
        a, b, c, d = swarm.nodes
        epochs = {a.peer_id: [4], b.peer_id: [4], c.peer_id: [3], d.peer_id: [2]}
        trackers = [_tracker(node, clock, epochs[node.peer_id]) for node in swarm.nodes]
        for tracker in trackers:
            await tracker.refresh()
        reading = await trackers[0].refresh()
        # d, two behind, downloads the state first: in neither round
        assert reading.awaited == {a.peer_id, b.peer_id, c.peer_id}
        assert reading.round_of(5) == {a.peer_id, b.peer_id, c.peer_id}
        for node in (b, c):  # later records: b and c two behind as well
            epochs[node.peer_id][0] = 2
        clock.advance(0.5)
        for tracker in trackers[1:3]:
            await tracker.refresh()
        reading = await trackers[0].refresh()
        assert reading.awaited_next == {a.peer_id}
        assert reading.round_of(5) is None


def test_a_tracker_config_that_would_make_live_peers_look_gone_is_refused() -> None:
    with pytest.raises(ConfigError, match="progress_ttl"):
        TrackerConfig(progress_interval=30.0, progress_ttl=30.0)
    with pytest.raises(ConfigError, match="fresh_within"):
        TrackerConfig(fresh_within=0.0)


async def test_totals_come_from_the_tree_and_the_directory_holds_a_sample() -> None:
    clock = ManualClock(NOW)
    config = TrackerConfig(
        progress_interval=1.0, progress_ttl=30.0, fresh_within=5.0, directory_size=2
    )
    async with open_swarm(8, clock, seed=4) as swarm:
        nodes = swarm.nodes
        trackers = []
        for node in nodes:
            tracker = _tracker(node, clock, [4])
            tracker.config = config
            trackers.append(tracker)
        limiter = trio.CapacityLimiter(8)

        async def refresh(tracker: ProgressTracker) -> None:
            async with limiter:
                await tracker.refresh()

        async def everyone() -> None:
            async with trio.open_nursery() as nursery:
                for tracker in trackers:
                    nursery.start_soon(refresh, tracker)

        # a swarm four times the directory_size: the records everyone listed
        # at first (each peer counted only itself) expire, and only the
        # sampled peers write again (about 2 * directory_size of them)
        for advance in (0.0, 0.0, 0.0, 16.0, 16.0, 0.0):
            clock.advance(advance)
            await everyone()
        for tracker in trackers:
            reading = tracker.reading
            assert reading is not None
            # every peer counts every peer and every sample, through the tree
            assert (reading.swarm.num_peers, reading.swarm.reported) == (8, 8 * 32)
            assert reading.expected == 8  # the tree's peers at the epoch
        listed = parse_progress(await nodes[0].get(progress_key("run"), latest=True))
        live = [r for r in listed if clock() - r.time <= config.progress_ttl]
        assert len(live) < 8
        sampled = {t.peer_id for t in trackers if t._rank < 2 * config.directory_size / 8}
        # the sampled peers, and perhaps a peer that counted fewer a moment ago
        assert sampled <= {r.peer_id for r in live}


async def test_an_observer_reads_the_totals_from_the_tree_when_the_directory_holds_a_sample() -> (
    None
):
    clock = ManualClock(NOW)
    config = TrackerConfig(
        progress_interval=1.0, progress_ttl=30.0, fresh_within=5.0, directory_size=2
    )
    async with open_swarm(9, clock, seed=19) as swarm:
        # the last node observes only, as ``swarm status`` does
        *nodes, observer = swarm.nodes
        small = await observe_progress(observer, "run", stale_after=30.0)
        assert (small.swarm.num_peers, small.listed, small.sampled) == (0, [], False)
        trackers = []
        for node in nodes:
            tracker = _tracker(node, clock, [4])
            tracker.config = config
            trackers.append(tracker)
        # two peers: the directory lists both, and is what the observer reads
        for tracker in trackers[:2]:
            await tracker.refresh()
        pair = await observe_progress(observer, "run", stale_after=30.0)
        assert (pair.swarm.num_peers, len(pair.listed), pair.sampled) == (2, 2, False)
        listing = _status_table(_status_object("run", pair.swarm, pair.listed, NOW, None))
        assert "a sample of" not in listing
        # eight: four times the directory_size (as in the test above), so the
        # first records expire and only the sampled peers list themselves
        for advance in (0.0, 0.0, 0.0, 16.0, 16.0, 0.0):
            clock.advance(advance)
            async with trio.open_nursery() as nursery:
                for tracker in trackers:
                    nursery.start_soon(tracker.refresh)
        seen = await observe_progress(observer, "run", stale_after=30.0)
        assert seen.sampled and len(seen.listed) < 8
        assert (seen.swarm.num_peers, seen.swarm.reported, seen.swarm.epoch) == (8, 8 * 32, 4)
        assert seen.swarm.samples_per_second == 8 * 100.0
        status = _status_object("run", seen.swarm, seen.listed, clock(), None, sampled=True)
        assert (status["num_peers"], status["peers_sampled"]) == (8, True)
        table = _status_table(status)
        assert "run run: epoch 4, 8 peers" in table
        assert f"a sample of {len(seen.listed)} of the 8 peers" in table


class _Reads:
    """A real DHT node that notes the keys its tracker reads."""

    def __init__(self, node: object) -> None:
        self.node = node
        self.keys: list[str] = []

    async def store(self, *args: Any, **kwargs: Any) -> Any:
        return await self.node.store(*args, **kwargs)  # type: ignore[attr-defined]

    async def get(self, key: str, *, latest: bool = False) -> Any:
        self.keys.append(key)
        return await self.node.get(key, latest=latest)  # type: ignore[attr-defined]

    def now(self) -> float:
        return self.node.now()  # type: ignore[attr-defined, no-any-return]


async def test_a_cold_start_reads_the_whole_directory_only_while_the_swarm_is_small() -> None:
    clock = ManualClock(NOW)
    config = TrackerConfig(
        progress_interval=1.0, progress_ttl=30.0, fresh_within=5.0, directory_size=2
    )
    async with open_swarm(8, clock, seed=4) as swarm:
        dhts = [_Reads(node) for node in swarm.nodes]
        trackers = []
        for dht in dhts:
            tracker = _tracker(dht.node, clock, [4])
            tracker.dht = dht  # type: ignore[assignment]
            tracker.config = config
            trackers.append(tracker)
        # one peer after another: each counts the peers before it and itself,
        # the first ones in the directory, the others (whose first look at the
        # tree's root counted more than directory_size) in the tree alone
        for tracker in trackers:
            await tracker.refresh()
        counted = [t.reading.swarm.num_peers for t in trackers if t.reading is not None]
        assert counted == list(range(1, 9))
        directory = [progress_key("run") in dht.keys for dht in dhts]
        assert directory == [True] * 2 + [False] * 6
        # everyone at once, and in every order: the tree fills while the
        # counts read from it are still short of the swarm, and a peer that
        # counted more than directory_size sticks to the tree instead of
        # reading the whole directory again (and not writing the tree)
        for dht in dhts:
            dht.keys.clear()
        for _ in range(3):
            async with trio.open_nursery() as nursery:
                for tracker in trackers:
                    nursery.start_soon(tracker.refresh)
        for count, dht in zip(counted, dhts, strict=True):
            assert (progress_key("run") in dht.keys) == (count <= config.directory_size)
        for tracker in trackers:
            assert tracker.reading is not None and tracker.reading.swarm.num_peers == 8
