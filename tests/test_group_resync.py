"""The leader's decision that its group re-synchronises after a round
(``Group.resync``), over real peers on 127.0.0.1 in virtual time: every member
adopts it, whatever it would have decided itself, so no member waits alone
in a state round its group-mates skip (``trainer._drift``)."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing
from peer_harness import averager_config, open_peers, trio_wall_clock

from averaging import Averager, Group, MoshpitGrid
from averaging._matchmaking import _resync_from_wire
from swarm import ProtocolError


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that jumps when every peer of the process waits for a timer."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def _groups(decisions: list[bool | None]) -> list[Group | None]:
    """Each peer looks for round 0's group with its own ``resync`` decision;
    peer 0 begins first (a second ahead), so it leads."""
    config = averager_config(matchmaking_time=4.0, poll_interval=0.2)
    n = len(decisions)
    groups: list[Group | None] = [None] * n
    async with open_peers(n, seed=23, clock=trio_wall_clock) as peers:
        averagers = [
            Averager(p, [torch.zeros(8)], prefix="resync", config=config, grid=MoshpitGrid(1, 4))
            for p in peers.alive
        ]

        async def find(i: int) -> None:
            await trio.sleep(0 if i == 0 else 1.0)
            groups[i] = await averagers[i].find_group(
                round=0, expected_peers=n, resync=decisions[i]
            )

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(find, i)
    return groups


@pytest.mark.parametrize("leader", [True, False])
async def test_every_member_adopts_the_leaders_decision(
    idle_clock: trio.testing.MockClock, leader: bool
) -> None:
    # the followers decided otherwise (or not at all): the leader's counts
    groups = await _groups([leader, not leader, None])
    assert all(g is not None for g in groups)
    assert [g.resync for g in groups if g is not None] == [leader] * 3


async def test_a_leader_that_does_not_decide_leaves_each_member_to_its_own(
    idle_clock: trio.testing.MockClock,
) -> None:
    groups = await _groups([None, True, False])
    assert all(g is not None and g.resync is None for g in groups)


def test_a_leaders_decision_is_checked() -> None:
    assert _resync_from_wire([]) is None  # a leader that predates it
    assert _resync_from_wire([True]) is True
    assert _resync_from_wire([False]) is False
    for bad in (1, 0, "yes", None, 1.0):
        with pytest.raises(ProtocolError):
            _resync_from_wire([bad])
