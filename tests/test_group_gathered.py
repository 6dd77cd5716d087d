"""The leader's view of how long a group took to gather (``Group.gathered``),
over real peers on 127.0.0.1 in virtual time: every member gets the leader's
measure, which spans the peers' different starts, and round timing adopts it."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing
from peer_harness import averager_config, open_peers, trio_wall_clock

from averaging import Averager, Group, GroupMember, MoshpitGrid
from averaging._matchmaking import _gathered_from_wire
from swarm import PeerID, ProtocolError
from trainer import RoundTiming, RoundTimingConfig

WINDOW = 4.0
#: the peers begin matchmaking this far apart (virtual seconds)
STAGGER = 1.0


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that jumps when every peer of the process waits for a timer."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def test_every_member_gets_the_leaders_gathering_time(
    idle_clock: trio.testing.MockClock,
) -> None:
    config = averager_config(matchmaking_time=WINDOW, poll_interval=0.2)
    async with open_peers(3, seed=19, clock=trio_wall_clock) as peers:
        averagers = [
            Averager(p, [torch.zeros(8)], prefix="gather", config=config, grid=MoshpitGrid(1, 4))
            for p in peers.alive
        ]
        groups: list[Group | None] = [None] * 3
        began = [0.0] * 3
        got = [0.0] * 3

        async def find(i: int) -> None:
            await trio.sleep(i * STAGGER)
            began[i] = trio.current_time()
            groups[i] = await averagers[i].find_group(round=0, expected_peers=3)
            got[i] = trio.current_time()

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(find, i)
    assert all(g is not None for g in groups)
    gathered = {g.gathered for g in groups if g is not None}
    assert len(gathered) == 1, "every member must adopt the leader's measure"
    (value,) = gathered
    assert value is not None
    # the first peer leads (its window closes first); it admitted the last
    # peer after that one began, 2 * STAGGER after its own lobby opened, and
    # before its window closed
    assert began[2] - began[0] <= value <= WINDOW
    # the last peer's own wait is no measure of the window the group needed:
    # it began after the leader had waited 2 * STAGGER already
    assert got[2] - began[2] < value


def _group(gathered: float | None, size: int = 2) -> Group:
    members = tuple(
        GroupMember(PeerID(bytes([i + 1]) * 20), "127.0.0.1", 1000 + i) for i in range(size)
    )
    return Group(b"g" * 16, members, 0, gathered=gathered)


def test_round_timing_adopts_the_leaders_view_and_misses_partial_groups() -> None:
    timing = RoundTiming(RoundTimingConfig(5.0, 60.0, 2.0))
    timing.settle(_group(0.4), 2.0, wanted=2, one_group=True, swarm_size=2)
    # mean 0.4, deviation 0.2: 1.5 * (0.4 + 0.8) = 1.8 s, as in ``observe``
    assert timing.matchmaking_time(2) == pytest.approx(1.8)
    timing.settle(_group(0.4), 2.0, wanted=3, one_group=True, swarm_size=3)
    assert timing.matchmaking_time(2) == pytest.approx(3.6)  # partial: doubled
    timing.settle(None, None, wanted=2, one_group=True, swarm_size=2)
    assert timing.matchmaking_time(2) == 5.0  # no group: doubled, capped
    timing.settle(_group(0.4), 2.0, wanted=3, one_group=False, swarm_size=3)
    # on a larger grid no group's size is known in advance: measured
    assert timing.matchmaking_time(2) < 3.6
    before = timing.matchmaking_time(2)
    timing.settle(_group(None), 2.0, wanted=2, one_group=True, swarm_size=2)
    assert timing.matchmaking_time(2) == before  # an older leader: nothing learned
    timing.settle(_group(0.4), None, wanted=2, one_group=True, swarm_size=2)
    assert timing.matchmaking_time(2) == pytest.approx(min(5.0, 2 * before))  # timed out


def test_a_leaders_gathering_time_is_checked() -> None:
    assert _gathered_from_wire([]) is None  # a leader that predates it
    assert _gathered_from_wire([1.5]) == 1.5
    for bad in (-0.1, "1", float("nan"), True):
        with pytest.raises(ProtocolError):
            _gathered_from_wire([bad])
