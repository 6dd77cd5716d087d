"""A peer looking for its leader reads the lobby from the DHT, and between
reads learns of an announcement the moment the DHT stores it at its node
(``Matchmaker._seek``); a leader reads it once more before closing only
where someone may be left over (``Matchmaker._hand_over``). Over real peers
on 127.0.0.1."""

from __future__ import annotations

import torch
import trio
from peer_harness import averager_config, open_peers

from averaging import Averager, Group, MoshpitGrid
from dht import DHTValue


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
        reads = 0
        first_read = trio.Event()
        dht_get = junior_peer.dht.get

        async def counted_get(key: str, *, latest: bool = False) -> DHTValue | None:
            nonlocal reads
            value = await dht_get(key, latest=latest)
            reads += 1
            first_read.set()
            return value

        junior_peer.dht.get = counted_get  # type: ignore[method-assign]
        groups: dict[str, Group | None] = {}

        async def find(name: str, averager: Averager) -> None:
            groups[name] = await averager.find_group(round=0, expected_peers=2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, "junior", junior)
            await first_read.wait()
            nursery.start_soon(find, "senior", senior)
    junior_group, senior_group = groups["junior"], groups["senior"]
    assert junior_group is not None and senior_group is not None
    assert junior_group.group_id == senior_group.group_id
    assert reads == 1


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
        reads = 0
        dht_get = junior_peer.dht.get

        async def counted_get(key: str, *, latest: bool = False) -> DHTValue | None:
            nonlocal reads
            reads += 1
            return await dht_get(key, latest=latest)

        junior_peer.dht.get = counted_get  # type: ignore[method-assign]
        groups: dict[str, Group | None] = {}

        async def find(name: str, averager: Averager) -> None:
            groups[name] = await averager.find_group(round=0, expected_peers=2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, "senior", senior)
            key = (await senior._matchmaker.wait_lobby()).key
            while junior_peer.dht.get_local(key) is None:
                await junior_peer.dht.wait_for_store(key)
            nursery.start_soon(find, "junior", junior)
    junior_group, senior_group = groups["junior"], groups["senior"]
    assert junior_group is not None and senior_group is not None
    assert junior_group.group_id == senior_group.group_id
    assert reads == 0


async def test_a_group_of_every_expected_peer_closes_without_reading_the_key_again() -> None:
    """Three peers are expected, and the group holds them all: the leader
    (the first to begin, so the senior) closes its lobby as its last
    follower arrives, with no read of the key beyond its search for seniors
    (one read: its next is a pause of 8 s away). The read before closing
    that looks for peers left over (``_spare``), on every step's path
    before, made two."""
    config = averager_config(matchmaking_time=64.0, poll_interval=64.0)
    async with open_peers(3, seed=29) as peers:
        senior_peer = peers.alive[0]
        averagers = [
            Averager(p, [torch.zeros(8)], prefix="close", config=config, grid=MoshpitGrid(1, 4))
            for p in peers.alive
        ]
        reads = 0
        first_read = trio.Event()
        dht_get = senior_peer.dht.get

        async def counted_get(key: str, *, latest: bool = False) -> DHTValue | None:
            nonlocal reads
            value = await dht_get(key, latest=latest)
            reads += 1
            first_read.set()
            return value

        senior_peer.dht.get = counted_get  # type: ignore[method-assign]
        groups: list[Group | None] = [None] * 3

        async def find(i: int) -> None:
            groups[i] = await averagers[i].find_group(round=0, expected_peers=3)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(find, 0)
            await first_read.wait()
            nursery.start_soon(find, 1)
            nursery.start_soon(find, 2)
    assert all(g is not None for g in groups)
    assert len({g.group_id for g in groups if g is not None}) == 1
    assert reads == 1
