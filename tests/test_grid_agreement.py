"""One grid for everyone: peers whose estimates of the swarm differ by a
factor of 2 still compute the same grid, hence the same group keys.

The rule (``choose``) is pure and checked directly; agreement is checked
through real DHT nodes on 127.0.0.1.
"""

from __future__ import annotations

import random

import pytest
import trio
from dht_harness import open_swarm

from averaging import GridAgreement, GridProposal, MoshpitGrid, MoshpitState
from averaging._grid import choose, parse_proposals, rank
from swarm import ConfigError, Identity, ManualClock, ProtocolError

NOW = 1_700_000_000.0
IDS = [Identity.from_seed(random.Random(i).randbytes(32)).peer_id for i in range(12)]


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
        stored = parse_proposals(await peers[0].get(agreement.key, latest=True))
        assert len(stored) == proposed
        # so every peer computes every peer's group key alike
        for member in peers:
            keys = {
                MoshpitState.join(g, member.peer_id, round=epoch).key(g, "run")
                for g in grids
                if g is not None
            }
            assert len(keys) == 1
