"""The Averager over real peers on 127.0.0.1: Moshpit groups, failures, consistency."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable

import pytest
import torch
import trio
import trio.lowlevel
import trio.testing
from peer_harness import averager_config, open_peers, trio_wall_clock

from averaging._averager import Averager, StepInProgressError, StepResult
from averaging._faults import FaultPlan, MemberFault
from averaging._moshpit import MoshpitGrid
from swarm import SwarmError

CONFIG = averager_config()
#: a step never takes longer than this (matchmaking bound + all-reduce deadline)
STEP_BOUND = CONFIG.step_bound + 1.0


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that moves only when the whole process has been idle for
    50 ms: every peer of a test lives in this process and their packets are on
    loopback, so idleness means everyone waits for a timer. Deadlines then hold
    however loaded the machine is, and waiting out a timer costs 50 ms."""
    return trio.testing.MockClock(autojump_threshold=0.05)


async def _step_all(
    averagers: list[Averager],
    round: int,
    offsets: list[float] | None = None,
    guard: Callable[[int], bool] = lambda i: False,
) -> list[StepResult | None]:
    """Run one round on every averager at once; ``guard(i)`` marks peers expected to die."""
    results: list[StepResult | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        if offsets:
            await trio.sleep(offsets[i])
        with trio.fail_after(STEP_BOUND):
            try:
                results[i] = await averagers[i].step(round=round)
            except SwarmError:
                if not guard(i):
                    raise

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return results


async def test_16_peers_on_a_4x4_grid_hold_the_global_mean_after_2_rounds(
    idle_clock: trio.testing.MockClock,
) -> None:
    grid = MoshpitGrid(2, 4)
    async with open_peers(16, seed=1, clock=trio_wall_clock) as peers:
        gen = torch.Generator().manual_seed(1)
        values = [torch.randn(3000, generator=gen) for _ in range(16)]
        mean = torch.stack(values).mean(0)
        averagers = [
            Averager(
                p,
                [values[i]],
                prefix="grid",
                config=CONFIG,
                grid=grid,
                initial_coordinates=(i // 4, i % 4),
            )
            for i, p in enumerate(peers.alive)
        ]
        for r in range(2):
            results = await _step_all(averagers, r)
            outcome = [(len(res.members), res.reason) if res else None for res in results]
            assert all(res is not None and len(res.members) == 4 for res in results), outcome
            assert len({res.group_id for res in results if res}) == 4
        for v in values:
            torch.testing.assert_close(v, mean, atol=1e-5, rtol=0)


async def test_peers_killed_during_a_round_do_not_stop_the_others(
    idle_clock: trio.testing.MockClock,
) -> None:
    grid = MoshpitGrid(2, 4)
    async with open_peers(16, seed=2, clock=trio_wall_clock) as peers:
        gen = torch.Generator().manual_seed(2)
        values = [torch.randn(2000, generator=gen) for _ in range(16)]
        alive = peers.alive
        victims = {3, 9}

        def crash_plan(i: int) -> FaultPlan:
            # the victim crashes as it starts sending its data: mid-round
            fault = MemberFault(cancel_before_chunk=0, cancel=lambda: peers.crash(alive[i]))
            return FaultPlan({index: fault for index in range(4)})

        averagers = [
            Averager(
                p,
                [values[i]],
                prefix="kill",
                config=CONFIG,
                grid=grid,
                initial_coordinates=(i // 4, i % 4),
                fault_plan=crash_plan(i) if i in victims else None,
            )
            for i, p in enumerate(alive)
        ]
        survivors = [i for i in range(16) if i not in victims]

        def spread() -> float:
            stacked = torch.stack([values[i] for i in survivors])
            return float((stacked - stacked.mean(0)).pow(2).mean())

        spreads = [spread()]
        await _step_all(averagers, 0, guard=lambda i: i in victims)
        for r in range(1, 4):
            results = await _step_all([averagers[i] for i in survivors], r)
            assert all(res is not None for res in results)
            spreads.append(spread())
        assert spreads[-1] < spreads[0] * 1e-3, spreads
        assert all(later <= earlier * 1.0001 for earlier, later in itertools.pairwise(spreads))


async def test_every_member_of_a_group_agrees_on_its_id_and_members(
    idle_clock: trio.testing.MockClock,
) -> None:
    grid = MoshpitGrid(1, 1)  # one key for everyone: groups must split and merge
    rng = random.Random(3)
    async with open_peers(10, seed=3, clock=trio_wall_clock) as peers:
        averagers = [
            Averager(p, [torch.full((64,), float(i))], prefix="agree", config=CONFIG, grid=grid)
            for i, p in enumerate(peers.alive)
        ]
        for r in range(4):
            offsets = [rng.uniform(0, 0.6) for _ in averagers]
            results = await _step_all(averagers, r, offsets)
            by_group: dict[bytes, set[tuple[bytes, ...]]] = {}
            seen: list[bytes] = []
            for res in results:
                assert res is not None
                if res.group_id is None:
                    continue
                by_group.setdefault(res.group_id, set()).add(tuple(res.members))
            for group_id, member_lists in by_group.items():
                assert len(member_lists) == 1, (group_id, member_lists)
                (members,) = member_lists
                assert 2 <= len(members) <= 4
                reporting = [res for res in results if res and res.group_id == group_id]
                assert len(reporting) == len(members)
                seen.extend(members)
            assert len(seen) == len(set(seen))
            assert len(seen) >= 4  # groups do form


async def test_followers_of_a_dead_leader_still_average() -> None:
    grid = MoshpitGrid(1, 1)
    async with open_peers(5, seed=4) as peers:
        alive = peers.alive
        values = [torch.full((100,), float(i)) for i in range(5)]
        averagers = [
            Averager(p, [values[i]], prefix="leader", config=CONFIG, grid=grid)
            for i, p in enumerate(alive)
        ]
        leader = averagers[0]
        results: list[StepResult | None] = [None] * 5

        async def follower(i: int) -> None:
            with trio.fail_after(2 * STEP_BOUND):
                res = await averagers[i].step(round=0)
                if res.group is None:  # the next round, then
                    res = await averagers[i].step(round=1)
                results[i] = res

        async with trio.open_nursery() as nursery:

            async def doomed_leader() -> None:
                # its own step ends either way: "no group" or a closed-peer error
                with contextlib.suppress(SwarmError):
                    await leader.step(round=0)

            nursery.start_soon(doomed_leader)
            # the leader announced first: it is the most senior. Let followers
            # join it, then kill it while its group is still forming.
            lobby = await leader._matchmaker.wait_lobby()
            for i in range(1, 5):
                nursery.start_soon(follower, i)
            with trio.fail_after(STEP_BOUND):  # fail, never hang, if nobody joins
                while not lobby.slots:
                    await lobby.changed.wait()
            await peers.kill(alive[0])
        groups = {res.group_id for res in results[1:] if res is not None}
        assert all(res is not None and res.group is not None for res in results[1:])
        assert alive[0].peer_id not in {m for res in results[1:] if res for m in res.members}
        assert len(groups) <= 2


async def test_concurrent_steps_are_refused(idle_clock: trio.testing.MockClock) -> None:
    async with open_peers(1) as peers:
        averager = Averager(
            peers.alive[0], [torch.zeros(4)], prefix="busy", config=CONFIG, grid=MoshpitGrid(1, 1)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(averager.step)
            while not averager._busy:
                await trio.lowlevel.checkpoint()
            with pytest.raises(StepInProgressError):
                await averager.step()
            nursery.cancel_scope.cancel()


async def test_alone_a_peer_finds_no_group_and_keeps_its_values(
    idle_clock: trio.testing.MockClock,
) -> None:
    async with open_peers(1) as peers:
        tensor = torch.arange(5.0)
        averager = Averager(
            peers.alive[0], [tensor], prefix="alone", config=CONFIG, grid=MoshpitGrid(1, 1)
        )
        result = await averager.step()
        assert result.group is None and result.reason
        assert torch.equal(tensor, torch.arange(5.0))


async def _overflow_rounds(
    prefix: str, rounds: int, late: float = 0.0, window: float | None = None
) -> None:
    """A group's worth of peers plus one on one key, the last beginning each
    round ``late`` after the others (with its own matchmaking ``window``, if
    given), for ``rounds`` rounds: every peer in a group of at least two."""
    grid = MoshpitGrid(1, 1)
    size = CONFIG.matchmaking.target_group_size
    async with open_peers(size + 1, seed=5, clock=trio_wall_clock) as peers:
        averagers = [
            Averager(p, [torch.full((8,), float(i))], prefix=prefix, config=CONFIG, grid=grid)
            for i, p in enumerate(peers.alive)
        ]
        if window is not None:
            averagers[-1].set_matchmaking_time(window)
        for r in range(rounds):
            offsets = [0.0] * size + [late] if late else None
            results = await _step_all(averagers, r, offsets=offsets)
            alone = [i for i, res in enumerate(results) if res is None or res.group is None]
            assert alone == [], (r, alone)
            sizes = sorted({res.group_id: len(res.members) for res in results if res}.values())
            assert sum(sizes) == size + 1 and min(sizes) >= 2, sizes


async def test_a_peer_beyond_a_full_group_is_not_left_alone(
    idle_clock: trio.testing.MockClock,
) -> None:
    """One key holds a group's worth of peers plus one (the overflow of a grid
    line, issue 19's scale run): the first leader fills its group at once, and
    the peer left over had nobody to average with, round after round. The
    leader now hands it a member before closing."""
    await _overflow_rounds("spill", rounds=3)


async def test_a_peer_late_for_a_full_group_is_not_left_alone(
    idle_clock: trio.testing.MockClock,
) -> None:
    """The peer beyond a full group begins its round half a poll after the
    others (at 1,024 peers a peer's first read can miss its leader, and it
    sleeps a poll): the group filled and closed before its announcement was
    readable, and it averaged with nobody. The full leader now waits a poll
    for a peer beyond it, and the late peer's join request makes the leader
    read the key again and hand it a member."""
    await _overflow_rounds("late", rounds=2, late=CONFIG.matchmaking.poll_interval / 2)


async def test_a_late_senior_beyond_a_full_group_is_not_left_alone(
    idle_clock: trio.testing.MockClock,
) -> None:
    """The peer beyond a full group begins late but with a shorter window
    (each peer adapts its own), so it is the most senior: it asks nobody, and
    the others, who read the key before it announced, filled the next one's
    group, which closed at once. Now the full leader waits a poll, in which
    its own search for seniors finds the late one and takes its group there;
    the one that group cannot hold is turned away and handed a member."""
    late = CONFIG.matchmaking.poll_interval / 2
    window = CONFIG.matchmaking.matchmaking_time - 2 * late
    await _overflow_rounds("senior", rounds=2, late=late, window=window)
