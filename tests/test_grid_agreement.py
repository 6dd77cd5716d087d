"""One grid for everyone: peers whose estimates of the swarm differ by a
factor of 2 still compute the same grid, hence the same group keys.

The rule (``choose``) is pure and checked directly; agreement is checked
through real DHT nodes on 127.0.0.1, and meeting through real averagers that
take their grid from a ``GridSchedule`` as the trainer does.
"""

from __future__ import annotations

import random

import pytest
import torch
import trio
import trio.testing
from dht_harness import open_swarm
from peer_harness import open_peers, trio_wall_clock
from test_averager import CONFIG, STEP_BOUND

from averaging import (
    Averager,
    GridAgreement,
    GridProposal,
    GridSchedule,
    MoshpitGrid,
    MoshpitState,
    StepResult,
)
from averaging._grid import choose, parse_proposals, rank
from dht import estimate_network_size
from swarm import ConfigError, Identity, ManualClock, ProtocolError

NOW = 1_700_000_000.0
IDS = [Identity.from_seed(random.Random(i).randbytes(32)).peer_id for i in range(12)]


@pytest.fixture
def idle_clock() -> trio.testing.MockClock:
    """Virtual time that jumps when the process has been idle for 50 ms (as in
    ``test_averager``): every peer lives in this process, on loopback."""
    return trio.testing.MockClock(autojump_threshold=0.05)


def test_the_lowest_ranked_proposal_of_the_epoch_wins() -> None:
    grids = [MoshpitGrid.for_swarm(n, 16) for n in (50, 100, 200, 400)]
    proposals = [GridProposal(IDS[i], 7, grids[i % 4]) for i in range(8)]
    proposals.append(GridProposal(IDS[8], 6, MoshpitGrid(1, 2)))  # another epoch
    winner = min(range(8), key=lambda i: rank(7, IDS[i]))
    assert choose(proposals, 7) == grids[winner % 4]
    # order and duplicates do not matter; other epochs never count
    assert choose(list(reversed(proposals)) + proposals[:3], 7) == grids[winner % 4]
    assert choose(proposals, 6) == MoshpitGrid(1, 2)
    assert choose(proposals, 8) is None
    assert 0 <= rank(7, IDS[0]) < 1 and rank(7, IDS[0]) != rank(8, IDS[0])


def test_proposals_from_the_wire_are_checked() -> None:
    good = GridProposal(IDS[0], 3, MoshpitGrid(2, 12))
    assert GridProposal.from_value(IDS[0], good.to_value()) == good
    for bad in (None, [3, 2], [3, 0, 12], [3, 2, "12"], [-1, 2, 12], [3, 17, 2]):
        with pytest.raises(ProtocolError):
            GridProposal.from_value(IDS[0], bad)
    with pytest.raises(ConfigError):
        GridAgreement("run", target_group_size=1)


async def test_peers_with_estimates_a_factor_of_2_apart_compute_the_same_keys() -> None:
    # 100 and 200 peers: the old rule rounds them to 128 and 256, two grids
    estimates = [100 if i % 2 else 200 for i in range(10)]
    own = {MoshpitGrid.for_swarm(1 << (n - 1).bit_length(), 16) for n in estimates}
    assert len(own) == 2  # without agreement these peers would never meet
    agreement = GridAgreement("run", target_group_size=16, proposers=60)
    epoch = 4
    async with open_swarm(10, ManualClock(NOW), seed=7) as swarm:
        peers = swarm.nodes
        # proposals for the epoch are written while the epoch before runs...
        proposed = 0
        for node, estimate in zip(peers, estimates, strict=True):
            proposed += await agreement.propose(node, node.peer_id, epoch, estimate)
        assert 0 < proposed < len(peers)  # some peers propose, not all
        # ...and read when its matchmaking begins
        grids: list[MoshpitGrid | None] = [None] * len(peers)

        async def agree(i: int) -> None:
            grids[i] = await agreement.agree(peers[i], epoch)

        async with trio.open_nursery() as nursery:
            for i in range(len(peers)):
                nursery.start_soon(agree, i)
        assert grids[0] is not None and all(g == grids[0] for g in grids)
        assert grids[0] in {MoshpitGrid.for_swarm(n, 16) for n in estimates}  # one proposed
        stored = parse_proposals(await peers[0].get(agreement.key(epoch), latest=True))
        assert len(stored) == proposed
        # so every peer computes every peer's group key alike
        for member in peers:
            keys = {
                MoshpitState.join(g, member.peer_id, round=epoch).key(g, "run")
                for g in grids
                if g is not None
            }
            assert len(keys) == 1


def test_a_proposal_keeps_the_grid_in_use_while_it_fits_the_estimate() -> None:
    agreement = GridAgreement("run", target_group_size=16)
    current = MoshpitGrid.for_swarm(100, 16)  # 10x10
    # estimates from half to twice the capacity keep it: no flip between sizes
    for estimate in (50, 80, 100, 150, 200):
        assert agreement.proposal(estimate, current) == current
    assert agreement.proposal(201, current) == MoshpitGrid.for_swarm(201, 16)
    assert agreement.proposal(49, current) == MoshpitGrid.for_swarm(49, 16)
    assert agreement.proposal(100, None) == current
    with pytest.raises(ConfigError):
        GridAgreement("run", target_group_size=16, ahead=1)


async def test_an_epoch_without_proposals_keeps_the_grid_of_the_epoch_before() -> None:
    agreement = GridAgreement("keep", target_group_size=4, proposers=100)
    async with open_swarm(4, ManualClock(NOW), seed=3) as swarm:
        nodes = swarm.nodes
        schedules = [GridSchedule(agreement, node.peer_id) for node in nodes]
        # nothing proposed for epochs 0 and 1: the default, the same for everyone
        for schedule, node in zip(schedules, nodes, strict=True):
            assert await schedule.grid(node, 0, timeout=5.0) == agreement.default
            await schedule.prepare(node, 0, estimate=16)  # proposes for epoch 2
            assert schedule.known(1) == agreement.default
        for schedule, node in zip(schedules, nodes, strict=True):
            await schedule.prepare(node, 1, estimate=16)  # proposes for 3, reads 2
        proposed = MoshpitGrid.for_swarm(16, 4)
        assert all(s.known(2) == proposed for s in schedules)
        # epoch 3's proposals were made from epoch 2's grid, which still fits
        for schedule, node in zip(schedules, nodes, strict=True):
            assert await schedule.resolve(node, 3) == proposed
            # epoch 4: nobody proposed; the grid of epoch 3 goes on
            assert await schedule.resolve(node, 4) == proposed
            assert schedule.fallbacks == {0, 1, 4}
            # epoch 5, not read before its round: the last grid at once
            assert await schedule.grid(node, 5, timeout=5.0) == proposed
            assert 5 in schedule.fallbacks
        # a peer that knows nothing (a newcomer) and finds nothing: the default
        newcomer = GridSchedule(agreement, nodes[0].peer_id)
        assert await newcomer.grid(nodes[0], 9, timeout=5.0) == agreement.default


async def test_averagers_whose_estimates_differ_2x_meet_on_the_agreed_grid(
    idle_clock: trio.testing.MockClock,
) -> None:
    # 8 peers in groups of 4; half think the swarm holds 8 peers (a 3x3 grid),
    # half 16 (4x4): sized from their own estimates, peers that share a row
    # would compute different keys and never meet
    estimates = [8 if i % 2 else 16 for i in range(8)]
    own = {MoshpitGrid.for_swarm(n, 4) for n in estimates}
    assert own == {MoshpitGrid(2, 3), MoshpitGrid(2, 4)}
    agreement = GridAgreement("meet", target_group_size=4, proposers=8)
    epochs = 6
    async with open_peers(8, seed=5, clock=trio_wall_clock) as peers:
        alive = peers.alive
        ids = [p.peer_id for p in alive]
        averagers = [
            Averager(p, [torch.full((16,), float(i))], prefix="meet", config=CONFIG)
            for i, p in enumerate(alive)
        ]
        schedules = [GridSchedule(agreement, p.peer_id) for p in alive]
        grids: dict[int, list[MoshpitGrid | None]] = {e: [None] * 8 for e in range(epochs)}
        results: dict[int, list[StepResult | None]] = {e: [None] * 8 for e in range(epochs)}
        mixed = 0  # groups that hold peers of both estimates
        for epoch in range(epochs):

            async def one(i: int, epoch: int = epoch) -> None:
                # as the trainer does: the grid known ahead of the round, and the
                # next proposal and read in the background while the round runs
                dht = alive[i].dht
                grid = await schedules[i].grid(dht, epoch, timeout=1.0)
                grids[epoch][i] = grid
                averagers[i].set_grid(grid)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(schedules[i].prepare, dht, epoch, estimates[i])
                    with trio.fail_after(STEP_BOUND):
                        results[epoch][i] = await averagers[i].step(round=epoch)

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
            grid = grids[epoch][0]
            assert grid is not None and all(g == grid for g in grids[epoch]), grids[epoch]
            if epoch >= agreement.ahead:  # agreed from a proposal, not a fallback
                assert all(epoch not in s.fallbacks for s in schedules)
            by_key: dict[str, set[int]] = {}
            for i, result in enumerate(results[epoch]):
                assert result is not None
                by_key.setdefault(result.key, set()).add(i)
            for key, sharing in by_key.items():
                for i in sharing:
                    result = results[epoch][i]
                    assert result is not None
                    if len(sharing) == 1:
                        assert result.group is None  # alone under its key
                        continue
                    # everyone under a key of at most 4 peers meets in one group
                    members = {ids.index(p) for p in result.members}
                    if len(sharing) <= 4:
                        assert members == sharing, (epoch, key, members, sharing)
                    assert result.group is not None and members <= sharing
                    mixed += len({estimates[m] for m in members}) == 2
        assert mixed > 0
        # the swarm outgrew the one-axis grid of the first epochs: peers of both
        # estimates met on a two-axis grid, where their own grids would differ
        assert grids[epochs - 1][0] in own


def test_the_network_size_is_estimated_from_the_closest_contacts() -> None:
    rng = random.Random(11)
    for size in (300, 1_000, 5_000):
        ids = [rng.randbytes(20) for _ in range(size)]
        own, others = ids[0], ids[1:]
        mine = int.from_bytes(own, "big")
        by_distance = sorted(others, key=lambda c: mine ^ int.from_bytes(c, "big"))
        # what a routing table holds: the closest nodes and a few far ones
        contacts = by_distance[:20] + rng.sample(by_distance[20:], 60)
        rng.shuffle(contacts)
        assert size / 2 <= estimate_network_size(own, contacts) <= 2 * size
    # a table of fewer contacts than the sample holds the whole small network
    assert estimate_network_size(IDS[0], IDS[1:6]) == 6
    assert estimate_network_size(IDS[0], []) == 1


async def test_a_new_run_proposes_its_first_grids_as_its_peers_join() -> None:
    # 16 peers in groups of 4, estimates 24 and 40: every joiner is a proposer
    # of epochs 0 and 1 (proposers=64), yet only the first writes; the grid is
    # then three-axis from epoch 0 on, the same for everyone
    estimates = [40 if i % 2 else 24 for i in range(16)]
    agreement = GridAgreement("cold", target_group_size=4, proposers=64)
    grid = MoshpitGrid.for_swarm(24, 4)
    assert grid == MoshpitGrid(3, 3)
    async with open_swarm(16, ManualClock(NOW), seed=9) as swarm:
        nodes = swarm.nodes
        schedules = [GridSchedule(agreement, node.peer_id) for node in nodes]
        stored = [
            await schedule.cold_start(node, 0, estimate)
            for schedule, node, estimate in zip(schedules, nodes, estimates, strict=True)
        ]
        # later joiners change nothing: the grid fits their estimates
        assert stored == [agreement.ahead] + [0] * 15
        assert await schedules[1].cold_start(nodes[1], 3, 16) == 0  # not a new run
        assert parse_proposals(await nodes[5].get(agreement.key(3), latest=True)) == []
        for schedule, node, estimate in zip(schedules, nodes, estimates, strict=True):
            assert await schedule.grid(node, 0, timeout=5.0) == grid
            await schedule.prepare(node, 0, estimate)  # reads epoch 1's
            assert schedule.known(1) == grid
            assert schedule.fallbacks == set()
        # so the first round's keys spread the peers over the grid's lines
        keys = {MoshpitState.join(grid, node.peer_id, round=0).key(grid, "cold") for node in nodes}
        assert len(keys) > 1
    # a grid sized for a swarm less than half as large is outgrown: the run's
    # first peer, alone, proposed one axis; a peer that finds 32 proposes its
    # own (and the rank decides)
    async with open_swarm(2, ManualClock(NOW), seed=2) as small:
        first, second = small.nodes
        alone = GridSchedule(agreement, first.peer_id)
        assert await alone.cold_start(first, 0, 1) == agreement.ahead
        joiner = GridSchedule(agreement, second.peer_id)
        assert await joiner.cold_start(second, 0, 32) == agreement.ahead
        proposals = parse_proposals(await first.get(agreement.key(0), latest=True))
        assert sorted(p.grid.dimensions for p in proposals) == [1, 3]


async def test_cold_start_proposals_written_together_agree() -> None:
    # peers of a new run join at once: proposers may write before any sees
    # another's proposal; the lowest rank decides alike for every reader
    estimates = [12 if i % 2 else 24 for i in range(12)]
    agreement = GridAgreement("together", target_group_size=4, proposers=12)
    async with open_swarm(12, ManualClock(NOW), seed=4) as swarm:
        nodes = swarm.nodes
        schedules = [GridSchedule(agreement, node.peer_id) for node in nodes]
        stored = [0] * 12

        async def join(i: int) -> None:
            stored[i] = await schedules[i].cold_start(nodes[i], 0, estimates[i])

        async with trio.open_nursery() as nursery:
            for i in range(12):
                nursery.start_soon(join, i)
        written = [
            len(parse_proposals(await nodes[0].get(agreement.key(e), latest=True)))
            for e in range(agreement.ahead)
        ]
        assert min(written) >= 1 and sum(written) == sum(stored)
        grids = [
            await schedule.grid(node, 0, timeout=5.0)
            for schedule, node in zip(schedules, nodes, strict=True)
        ]
        assert all(g == grids[0] for g in grids)
        assert grids[0] in {MoshpitGrid.for_swarm(n, 4) for n in estimates}
