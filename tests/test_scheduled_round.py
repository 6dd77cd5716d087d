"""Scheduled rounds over real peers on 127.0.0.1: a group found ahead of time,
then triggered with a weight, joined with weight 0, or cancelled."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing
from peer_harness import averager_config, open_peers, trio_wall_clock

from averaging import (
    Averager,
    MoshpitGrid,
    RoundClosedError,
    ScheduledRound,
    StepInProgressError,
    StepResult,
)
from swarm import ConfigError
from trainer import DenseGradients, Trainee

SENDER_TIMEOUT = 5.0
CONFIG = averager_config(sender_timeout=SENDER_TIMEOUT, round_timeout=30.0)
SIZE = 3000


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that jumps when every peer of the process waits for a timer."""
    return trio.testing.MockClock(autojump_threshold=0.05)


def _values(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SIZE, generator=gen) for _ in range(n)]


def _averagers(peers: list, values: list[torch.Tensor], prefix: str) -> list[Averager]:
    return [
        Averager(p, [v], prefix=prefix, config=CONFIG, grid=MoshpitGrid(1, 4))
        for p, v in zip(peers, values, strict=True)
    ]


async def _schedule_all(
    nursery: trio.Nursery, averagers: list[Averager], round: int
) -> list[ScheduledRound]:
    scheduled = [
        await a.schedule(nursery, round=round, expected_peers=len(averagers)) for a in averagers
    ]
    for s in scheduled:
        assert await s.wait_group() is not None
    assert len({s.group.group_id for s in scheduled if s.group is not None}) == 1
    return scheduled


async def test_triggered_rounds_hold_the_weighted_mean_and_name_every_contributor(
    idle_clock: trio.testing.MockClock,
) -> None:
    async with open_peers(3, seed=11, clock=trio_wall_clock) as peers:
        values = _values(3, 11)
        weights = [1.0, 2.0, 3.0]
        mean = sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
        averagers = _averagers(peers.alive, values, "sched")
        async with trio.open_nursery() as nursery:
            scheduled = await _schedule_all(nursery, averagers, 0)
            results: list[StepResult | None] = [None] * 3

            async def trigger(i: int) -> None:
                results[i] = await scheduled[i].trigger(weights[i])

            for i in range(3):
                nursery.start_soon(trigger, i)
        everyone = frozenset(p.peer_id for p in peers.alive)
        for v, result in zip(values, results, strict=True):
            assert result is not None and result.contributors == everyone
            torch.testing.assert_close(v, mean, atol=1e-5, rtol=0)
        # the round is over: the averagers take steps again, in the next round
        assert all(a.state.round == 1 for a in averagers)


async def test_a_member_that_joins_with_weight_zero_receives_the_average_of_the_others(
    idle_clock: trio.testing.MockClock,
) -> None:
    async with open_peers(3, seed=12, clock=trio_wall_clock) as peers:
        values = _values(3, 12)
        mean = (values[0] + values[1]) / 2
        averagers = _averagers(peers.alive, values, "zero")
        # the late peer's own tensors are in use: it receives into scratch zeros
        scratch = torch.zeros(SIZE)
        async with trio.open_nursery() as nursery:
            scheduled = await _schedule_all(nursery, averagers, 4)
            results: list[StepResult | None] = [None] * 3

            async def trigger(i: int) -> None:
                if i == 2:
                    results[i] = await scheduled[i].trigger(0.0, tensors=[scratch])
                else:
                    results[i] = await scheduled[i].trigger(1.0)

            for i in range(3):
                nursery.start_soon(trigger, i)
        ids = [p.peer_id for p in peers.alive]
        for result in results:
            assert result is not None and result.contributors == frozenset(ids[:2])
            assert result.allreduce is not None and not result.allreduce.failed_senders
            assert not result.allreduce.failed_reducers
        for tensor in (values[0], values[1], scratch):
            torch.testing.assert_close(tensor, mean, atol=1e-5, rtol=0)
        # its own tensors are untouched
        torch.testing.assert_close(values[2], _values(3, 12)[2], atol=0, rtol=0)


@pytest.mark.parametrize("cancel_first", [True, False], ids=["before", "during"])
async def test_a_cancelled_member_costs_its_group_mates_no_timeout(
    idle_clock: trio.testing.MockClock, cancel_first: bool
) -> None:
    """Cancelled before the others trigger (its notices wait for their rounds)
    or while their rounds wait for its data: either way they finish at once,
    with the data of the two that stayed wherever a member reduced it."""
    async with open_peers(3, seed=13, clock=trio_wall_clock) as peers:
        values = _values(3, 13)
        originals = [v.clone() for v in values]
        mean = (values[0] + values[1]) / 2
        averagers = _averagers(peers.alive, values, "cancel")
        results: list[StepResult | None] = [None, None]
        async with trio.open_nursery() as nursery:
            scheduled = await _schedule_all(nursery, averagers, 2)
            started = trio.current_time()
            if cancel_first:
                assert await scheduled[2].cancel()

            async def trigger(i: int) -> None:
                results[i] = await scheduled[i].trigger(1.0)

            for i in range(2):
                nursery.start_soon(trigger, i)
            if not cancel_first:
                await trio.sleep(0.5)  # the others' reducers wait for its data now
                assert await scheduled[2].cancel()
        elapsed = trio.current_time() - started
        assert elapsed < SENDER_TIMEOUT / 2, f"the group waited {elapsed:.2f} s"
        torch.testing.assert_close(values[2], originals[2], atol=0, rtol=0)
        ids = [p.peer_id for p in peers.alive]
        cancelled = next(
            j for j, m in enumerate(scheduled[0].group.members) if m.peer_id == ids[2]
        )
        for i, result in enumerate(results):
            assert result is not None and result.allreduce is not None
            allreduce = result.allreduce
            assert allreduce.failed_senders == frozenset({cancelled})
            assert allreduce.failed_reducers == frozenset({cancelled})
            stayed = frozenset(j for j in range(3) if j != cancelled)
            for j, (a, b) in enumerate(allreduce.part_bounds):
                if j == cancelled:  # nobody reduced its part: local values
                    torch.testing.assert_close(values[i][a:b], originals[i][a:b], atol=0, rtol=0)
                else:
                    assert allreduce.part_contributors(j) == stayed
                    torch.testing.assert_close(values[i][a:b], mean[a:b], atol=1e-5, rtol=0)
        # the averager of the cancelled peer is free for its next round
        assert averagers[2].state.round == 3


async def test_without_the_withdrawal_the_group_waits_out_the_sender_timeout(
    idle_clock: trio.testing.MockClock,
) -> None:
    """The contrast to the test above: a member that simply never triggers
    costs its group-mates ``sender_timeout``."""
    async with open_peers(3, seed=13, clock=trio_wall_clock) as peers:
        averagers = _averagers(peers.alive, _values(3, 13), "silent")
        async with trio.open_nursery() as nursery:
            scheduled = await _schedule_all(nursery, averagers, 2)
            started = trio.current_time()
            async with trio.open_nursery() as others:
                for i in range(2):
                    others.start_soon(scheduled[i].trigger, 1.0)
            elapsed = trio.current_time() - started
            assert await scheduled[2].cancel()
        assert elapsed >= SENDER_TIMEOUT


async def test_cancelled_during_matchmaking_the_others_still_form_a_group(
    idle_clock: trio.testing.MockClock,
) -> None:
    async with open_peers(3, seed=14, clock=trio_wall_clock) as peers:
        values = _values(3, 14)
        mean = (values[0] + values[1]) / 2
        averagers = _averagers(peers.alive, values, "early")
        async with trio.open_nursery() as nursery:
            # the leaver is scheduled first and expects nobody: it stops at once
            leaver = await averagers[2].schedule(nursery, round=0)
            assert await leaver.cancel()
            assert leaver.group is None
            scheduled = [
                await a.schedule(nursery, round=0, expected_peers=2) for a in averagers[:2]
            ]
            results: list[StepResult | None] = [None, None]

            async def trigger(i: int) -> None:
                results[i] = await scheduled[i].trigger(1.0)

            for i in range(2):
                nursery.start_soon(trigger, i)
        ids = frozenset(p.peer_id for p in peers.alive[:2])
        for i, result in enumerate(results):
            assert result is not None and result.contributors == ids
            torch.testing.assert_close(values[i], mean, atol=1e-5, rtol=0)


async def test_a_scheduled_round_is_used_once_and_holds_its_averager(
    idle_clock: trio.testing.MockClock,
) -> None:
    async with open_peers(2, seed=15, clock=trio_wall_clock) as peers:
        averagers = _averagers(peers.alive, _values(2, 15), "once")
        async with trio.open_nursery() as nursery:
            scheduled = await _schedule_all(nursery, averagers, 0)
            with pytest.raises(StepInProgressError):
                await averagers[0].step(round=0)
            with pytest.raises(StepInProgressError):
                await averagers[0].schedule(nursery, round=0)
            with pytest.raises(ConfigError):
                await scheduled[0].trigger(float("nan"))
            with pytest.raises(ConfigError):
                await scheduled[0].trigger(1.0, tensors=[torch.zeros(SIZE + 1)])
            async with trio.open_nursery() as both:
                for s in scheduled:
                    both.start_soon(s.trigger, 1.0)
            with pytest.raises(RoundClosedError):
                await scheduled[0].trigger(1.0)
            assert not await scheduled[0].cancel()
            # the averager is free again
            second = await _schedule_all(nursery, averagers, 1)
            for s in second:
                assert await s.cancel()


async def test_a_trainer_that_must_catch_up_joins_its_formed_group_without_data(
    idle_clock: trio.testing.MockClock,
) -> None:
    """``Strategy.join_without_data``, the trainer's catch-up path: the
    group-mate neither waits for the peer nor finds its data in the average,
    and the peer's accumulated gradients are left as they were."""
    async with open_peers(2, seed=16, clock=trio_wall_clock) as peers:
        torch.manual_seed(16)
        params = [torch.nn.Parameter(torch.randn(SIZE - 10)), torch.nn.Parameter(torch.randn(10))]
        trainee = Trainee(
            params=params,
            trained=params,
            optimizer=torch.optim.SGD(params, lr=0.1),
            sync_model=lambda: None,
        )
        strategy = DenseGradients(trainee)
        for p in params:
            p.grad = torch.randn_like(p)
        strategy.accumulate(4)
        accumulated = [a.clone() for a in strategy.averaged]
        mine = _values(1, 16)[0]
        expected = mine.clone()
        averagers = [
            Averager(peers.alive[0], [mine], prefix="catch", config=CONFIG, grid=MoshpitGrid(1, 4)),
            Averager(
                peers.alive[1],
                strategy.averaged,
                prefix="catch",
                config=CONFIG,
                grid=MoshpitGrid(1, 4),
            ),
        ]
        groups: list = [None, None]

        async def find(i: int) -> None:
            # the trainer's prematch: the group found ahead, held on its own
            groups[i] = await averagers[i].find_group(round=7, expected_peers=2)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(find, i)
        assert groups[0] is not None and groups[1] is not None
        results: list[StepResult | None] = [None, None]
        started = trio.current_time()

        async def average() -> None:
            results[0] = await averagers[0].average(groups[0], 1.0)

        async def catch_up() -> None:
            results[1] = await strategy.join_without_data(averagers[1], groups[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(average)
            nursery.start_soon(catch_up)
        assert trio.current_time() - started < SENDER_TIMEOUT / 2
        me = peers.alive[0].peer_id
        for result in results:
            assert result is not None and result.contributors == frozenset({me})
            assert result.allreduce is not None and not result.allreduce.failed_senders
            assert not result.allreduce.failed_reducers
        torch.testing.assert_close(mine, expected, atol=0, rtol=0)
        for acc, before in zip(strategy.averaged, accumulated, strict=True):
            torch.testing.assert_close(acc, before, atol=0, rtol=0)
