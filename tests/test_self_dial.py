"""A peer that dials an address leading back to itself (another peer announced
127.0.0.1, say) learns exactly that: ``SelfDialError``, blaming nobody, and an
all-reduce reports that member's part as self-dialed, kept local, not as a
failed reducer and not as averaged. Real sockets on 127.0.0.1."""

from __future__ import annotations

import pytest
import torch
from test_allreduce import member_data, open_peers, run_round

from averaging._allreduce import AllReduceConfig, AllReduceResult
from averaging._group import Group, GroupMember, MemberMode
from swarm import Identity, PeerUnreachableError, SelfDialError
from swarm._connections import open_connections

CONFIG = AllReduceConfig(
    sender_timeout=1.0, reducer_timeout=2.0, round_timeout=10.0, chunk_elements=64
)


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
async def test_dialing_own_address_is_a_self_dial_that_bans_nobody(encrypt: bool) -> None:
    from swarm._connections import ConnectionConfig

    me = Identity.from_seed(b"\x01" * 32)
    other = Identity.from_seed(b"\x02" * 32)
    async with open_connections(me, config=ConnectionConfig(encrypt=encrypt)) as net:
        with pytest.raises(SelfDialError) as info:
            async with net.open_stream(other.peer_id, ("127.0.0.1", net.port), "anything"):
                pass
        assert isinstance(info.value, PeerUnreachableError)
        assert other.peer_id.short() in str(info.value)
        assert net.bans.banned() == []


async def test_self_dialed_member_is_reported_not_failed_and_not_averaged() -> None:
    async with open_peers(3) as nets:
        members = tuple(
            GroupMember(net.peer_id, "127.0.0.1", net.port, 1.0, MemberMode.NODE) for net in nets
        )
        # Member 0 sees member 2 at member 0's own address, as when member 2
        # announced 127.0.0.1 and both listen on the same port number.
        wrong = list(members)
        wrong[2] = GroupMember(nets[2].peer_id, "127.0.0.1", nets[0].port, 1.0, MemberMode.NODE)
        groups = [
            Group(b"self-dial", tuple(wrong), 0),
            Group(b"self-dial", members, 1),
            Group(b"self-dial", members, 2),
        ]
        weights = [1.0, 1.0, 1.0]
        inputs = [member_data(i) for i in range(3)]
        outcome = await run_round(nets, groups, weights, inputs=inputs, config=CONFIG)
    results = outcome.results
    assert all(isinstance(r, AllReduceResult) for r in results)
    r0, r1, r2 = (r for r in results if isinstance(r, AllReduceResult))
    assert r0.self_dialed == frozenset({2})
    assert r0.failed_reducers == frozenset()
    assert r1.self_dialed == r2.self_dialed == frozenset()
    # member 0's share never reached part 2's reducer, which sent its result
    # over {1, 2} on its own stream to member 0 (``results_on_reducer_stream``):
    # nobody's result claims what did not happen
    assert r0.part_contributors(2) == r1.part_contributors(2) == frozenset({1, 2})
    assert r2.part_contributors(2) == frozenset({1, 2})
    assert r2.failed_senders == frozenset({0})
    for r in (r0, r1, r2):
        assert r.part_contributors(0) == r.part_contributors(1) == frozenset({0, 1, 2})
    a, b = r0.part_bounds[2]
    for output in outcome.outputs:
        torch.testing.assert_close(output[a:b], (inputs[1][a:b] + inputs[2][a:b]) / 2)
    a, b = r0.part_bounds[0]
    torch.testing.assert_close(outcome.outputs[0][a:b], sum(x[a:b] for x in inputs) / 3)
