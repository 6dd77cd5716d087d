"""A peer looking for its leader reads the lobby from the DHT, and between
reads learns of an announcement the moment the DHT stores it at its node
(``Matchmaker._seek``); a leader reads it once more before closing only
where someone may be left over (``Matchmaker._hand_over``). Over real peers
on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import torch
import trio
from peer_harness import averager_config, open_peers

from averaging import Averager, Group, MoshpitGrid
from dht import DHTValue


class CountedReads:
    """Counts the reads of the DHT that ``peer`` makes (``dht.get``), from
    now on; ``first`` is set once the first of them returned."""

    def __init__(self, peer: Any) -> None:
        self.count = 0
        self.first = trio.Event()
        self._get = peer.dht.get
        peer.dht.get = self._counted

    async def _counted(self, key: str, *, latest: bool = False) -> DHTValue | None:
        value = await self._get(key, latest=latest)
        self.count += 1
        self.first.set()
        return value


async def find(groups: dict[int, Group | None], i: int, averager: Averager, expected: int) -> None:
    groups[i] = await averager.find_group(round=0, expected_peers=expected)


def one_group(groups: dict[int, Group | None], peers: int) -> bool:
    return len(groups) == peers and len({g.group_id for g in groups.values() if g}) == 1


async def test_a_peer_that_read_before_its_leader_announced_joins_on_the_announcement() -> None:
    """The junior reads the lobby before its senior has begun: nothing there.
    Its next read is a pause away (an eighth of its poll interval, 8 s here);
    the senior's announcement reaches its node long before, and it joins on
    that, with one read of the DHT in all. Reading again only after the pause
    (as before) takes two."""
    # the senior begins later but closes its lobby first: a shorter window
    junior_config = averager_config(matchmaking_time=64.0, poll_interval=64.0)
    senior_config = averager_config(matchmaking_time=4.0, poll_interval=1.0)
    async with open_peers(2, seed=23) as peers:
        junior_peer, senior_peer = peers.alive
        junior, senior = (
            Averager(p, [torch.zeros(8)], prefix="lobby", config=c, grid=MoshpitGrid(1, 4))
            for p, c in ((junior_peer, junior_config), (senior_peer, senior_config))
        )
        reads = CountedReads(junior_peer)
        groups: dict[int, Group | None] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, groups, 0, junior, 2)
            await reads.first.wait()
            nursery.start_soon(find, groups, 1, senior, 2)
    assert one_group(groups, 2) and None not in groups.values()
    assert reads.count == 1


async def test_a_peer_whose_node_holds_its_leaders_announcement_joins_without_a_read() -> None:
    """The senior announced itself while the junior was still computing, and
    the announcement reached the junior's node: the junior looks there first
    and joins with no read of the DHT at all. Reading the network first (as
    before) took one, on the path of every step: the leader waits for the
    last peer to begin."""
    config = averager_config(matchmaking_time=64.0, poll_interval=64.0)
    async with open_peers(2, seed=31) as peers:
        junior_peer = peers.alive[1]
        senior, junior = (
            Averager(p, [torch.zeros(8)], prefix="here", config=config, grid=MoshpitGrid(1, 4))
            for p in peers.alive
        )
        reads = CountedReads(junior_peer)
        groups: dict[int, Group | None] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, groups, 0, senior, 2)
            key = (await senior._matchmaker.wait_lobby()).key
            while junior_peer.dht.get_local(key) is None:
                await junior_peer.dht.wait_for_store(key)
            nursery.start_soon(find, groups, 1, junior, 2)
    assert one_group(groups, 2) and None not in groups.values()
    assert reads.count == 0


async def test_a_group_of_every_expected_peer_closes_without_reading_the_key_again() -> None:
    """Three peers are expected, and the group holds them all: the leader
    (the first to begin, so the senior) closes its lobby as its last
    follower arrives, with no read of the key beyond its search for seniors
    (one read: its next is a pause of 8 s away). The read before closing
    that looks for peers left over (``_spare``), on every step's path
    before, made two."""
    config = averager_config(matchmaking_time=64.0, poll_interval=64.0)
    async with open_peers(3, seed=29) as peers:
        averagers = [
            Averager(p, [torch.zeros(8)], prefix="close", config=config, grid=MoshpitGrid(1, 4))
            for p in peers.alive
        ]
        reads = CountedReads(peers.alive[0])
        groups: dict[int, Group | None] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, groups, 0, averagers[0], 3)
            await reads.first.wait()
            for i in (1, 2):
                nursery.start_soon(find, groups, i, averagers[i], 3)
    assert one_group(groups, 3) and None not in groups.values()
    assert reads.count == 1
