"""Peers nobody can dial, announced through their relay (``swarm._relay``,
``averaging._matchmaking``): the wire of a relayed member, and averaging on
127.0.0.1 with peers reachable only through a relay's circuits.

On loopback every address is dialable, so the relayed peers announce an
address where nothing listens (``NOWHERE``): every byte anyone sends them
must come through a circuit of the relay, which the relay's counters show.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace

import pytest
import torch
import trio
from peer_harness import averager_config

from averaging import Averager, GroupMember, MemberMode, StepResult
from averaging._matchmaking import (
    Candidate,
    announcement,
    member_from_wire,
    member_to_wire,
    parse_candidates,
)
from averaging._moshpit import MoshpitGrid
from dht import DHTValue, owner_marker
from swarm import (
    AsyncPeer,
    ConfigError,
    Identity,
    PeerConfig,
    PeerUnreachableError,
    ProtocolError,
    Reachability,
    RelayConfig,
    keep_relay,
    open_peer,
)

HOST = "127.0.0.1"
NOWHERE = f"{HOST}:1"
PID = Identity.from_seed(b"m" * 32).peer_id


def _member(**kwargs: object) -> GroupMember:
    return GroupMember(PID, "10.78.1.2", 7000, **kwargs)  # type: ignore[arg-type]


def test_a_relayed_member_round_trips_and_old_entries_still_parse() -> None:
    relayed = _member(relay=("10.77.0.1", 7000))
    measured = _member(upload=1e6, download=2e6, relay=("10.77.0.1", 7000))
    plain = _member()
    for member in (relayed, measured, plain):
        assert member_from_wire(member_to_wire(member)) == member
        assert Candidate.from_wire(Candidate(member, 5.0).to_wire()) == Candidate(member, 5.0)
    # a relay needs the rates before it (0: none measured); a plain member is as before
    assert member_to_wire(relayed)[5:] == [0.0, 0.0, ["10.77.0.1", 7000]]
    assert member_to_wire(plain) == [bytes(PID), "10.78.1.2", 7000, 1.0, "node"]
    found = DHTValue({owner_marker(PID): DHTValue(announcement(measured, 9.0), 60.0)}, 60.0)
    assert parse_candidates(found, Identity.from_seed(b"o" * 32).peer_id) == [
        Candidate(measured, 9.0)
    ]


@pytest.mark.parametrize(
    "relay",
    [["10.77.0.1"], ["10.77.0.1", 0], ["10.77.0.1", 70000], [7000, "10.77.0.1"], "10.77.0.1:7000",
     ["x" * 65, 7000], ["10.77.0.1", 7000, 1], None, [b"h", 1]],
)  # fmt: skip
def test_a_malformed_relay_is_a_protocol_error(relay: object) -> None:
    with pytest.raises(ProtocolError):
        member_from_wire([*member_to_wire(_member(upload=1.0, download=1.0)), relay])


@pytest.mark.parametrize("relay", [("", 7000), ("10.77.0.1", 0), ("10.77.0.1", 65536)])
def test_a_member_s_relay_is_validated(relay: tuple[str, int]) -> None:
    with pytest.raises(ConfigError):
        _member(relay=relay)


CONFIG = averager_config(
    group_size=3,
    min_group_size=3,
    matchmaking_time=3.0,
    request_timeout=2.0,
    poll_interval=None,
    sender_timeout=10.0,
    round_timeout=40.0,
)
VALUES = 30_000


@asynccontextmanager
async def _public_and_two_relayed() -> AsyncIterator[list[AsyncPeer]]:
    """R (dialable) and X, Y announced at ``NOWHERE``, found unreachable and
    registered with R as their relay by themselves (``AsyncPeer.keep_relay``)."""
    async with AsyncExitStack() as stack:
        r = await stack.enter_async_context(open_peer(Identity.from_seed(b"R" * 32)))
        peers = [r]
        for seed in (b"X", b"Y"):
            config = PeerConfig(initial_peers=(r.address,), announce=NOWHERE)
            peer = await stack.enter_async_context(open_peer(Identity.from_seed(seed * 32), config))
            # what a dial-back check finds for a peer behind a NAT
            peer.reachability = Reachability.UNREACHABLE
            await peer.start_service(peer.keep_relay)
            with trio.fail_after(20):
                await peer.relay_found.wait()
            assert peer.relayed_by is not None and peer.relayed_by[0] == r.peer_id
            peers.append(peer)
        yield peers


async def test_peers_behind_a_relay_reduce_parts_and_every_round_has_everyone() -> None:
    async with _public_and_two_relayed() as peers:
        r = peers[0]
        assert r.relay is not None
        gen = torch.Generator().manual_seed(21)
        values = [torch.randn(VALUES, generator=gen) for _ in peers]
        mean = torch.stack(values).mean(0)
        tensors = [v.clone() for v in values]
        averagers = [
            Averager(p, [tensors[i]], prefix="relayed", config=CONFIG, grid=MoshpitGrid(1, 3))
            for i, p in enumerate(peers)
        ]
        for averager in averagers[1:]:
            assert averager.mode is MemberMode.NODE  # a client, but reached through R
        for round in range(2):
            results: dict[int, StepResult] = {}

            async def one(
                i: int, round: int = round, results: dict[int, StepResult] = results
            ) -> None:
                with trio.fail_after(CONFIG.step_bound + 10):
                    results[i] = await averagers[i].step(round=round, expected_peers=3)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            for i in range(len(peers)):
                result = results[i]
                assert result.group is not None and result.allreduce is not None, result.reason
                members = {m.peer_id: m for m in result.group.members}
                assert set(members) == {p.peer_id for p in peers}
                # the relayed peers are announced through R and reduce a part
                for relayed in peers[1:]:
                    member = members[relayed.peer_id]
                    assert member.relay == r.endpoint and member.mode is MemberMode.NODE
                    index = result.group.members.index(member)
                    lo, hi = result.allreduce.part_bounds[index]
                    assert hi > lo
                assert result.contributors == frozenset(members), (i, result.contributors)
                torch.testing.assert_close(tensors[i], mean)
        # nothing reached X or Y but through R's circuits
        assert r.relay.circuits_made > 0


async def test_a_relayed_peer_refuses_to_relay_for_others() -> None:
    async with _public_and_two_relayed() as peers:
        x, y = peers[1], peers[2]
        assert x.relayed_by is not None
        # Y reaches X (through R), but X, unreachable itself, relays for nobody
        y.connections.set_relay_route(x.peer_id, x.relayed_by[1])
        with pytest.raises(PeerUnreachableError, match="cannot be dialed itself"):
            await keep_relay(y.connections, x.peer_id, x.endpoint)


async def test_a_relayed_peer_whose_relay_leaves_registers_with_another() -> None:
    """X registers with one of two reachable peers; that one leaves; X
    registers with the other by itself and is announced through it: it
    averages with the one left, reducing its own part."""
    config = PeerConfig(relay=RelayConfig(keepalive_interval=0.5))
    async with AsyncExitStack() as outer:
        services = await outer.enter_async_context(trio.open_nursery())
        scopes = [trio.CancelScope(), trio.CancelScope()]
        publics: list[AsyncPeer] = []
        for seed, scope in zip((b"R", b"S"), scopes, strict=True):
            initial = (publics[0].address,) if publics else ()
            peer_config = replace(config, initial_peers=initial)
            identity = Identity.from_seed(seed * 32)
            publics.append(await services.start(_serve, identity, peer_config, scope))
        x_config = replace(config, initial_peers=(publics[0].address,), announce=NOWHERE)
        x = await outer.enter_async_context(open_peer(Identity.from_seed(b"X" * 32), x_config))
        x.reachability = Reachability.UNREACHABLE
        await x.start_service(x.keep_relay)
        with trio.fail_after(20):
            await x.relay_found.wait()
        assert x.relayed_by is not None
        leaving = [p.peer_id for p in publics].index(x.relayed_by[0])
        staying = publics[1 - leaving]
        scopes[leaving].cancel()
        for _ in range(400):  # bounded: 20 s
            if x.relayed_by is not None and x.relayed_by[0] == staying.peer_id:
                break
            await trio.sleep(0.05)
        assert x.relay_route == staying.endpoint
        tensors = [torch.zeros(VALUES), torch.ones(VALUES)]
        averagers = [
            Averager(p, [tensors[i]], prefix="moved", config=CONFIG2, grid=MoshpitGrid(1, 2))
            for i, p in enumerate((staying, x))
        ]
        results = await _round(averagers, 0)
        for result in results:
            assert result.group is not None and result.allreduce is not None, result.reason
            member = result.group.members[
                [m.peer_id for m in result.group.members].index(x.peer_id)
            ]
            assert member.relay == staying.endpoint
            lo, hi = result.allreduce.part_bounds[result.group.members.index(member)]
            assert hi > lo
            assert result.contributors == frozenset({staying.peer_id, x.peer_id})
        for tensor in tensors:
            torch.testing.assert_close(tensor, torch.full((VALUES,), 0.5))
        services.cancel_scope.cancel()


async def _serve(
    identity: Identity,
    config: PeerConfig,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[AsyncPeer],
) -> None:
    """Run a peer until ``scope`` is cancelled (it leaves while others stay)."""
    with scope:
        async with open_peer(identity, config) as peer:
            task_status.started(peer)
            await trio.sleep_forever()


CONFIG2 = replace(
    CONFIG, matchmaking=replace(CONFIG.matchmaking, target_group_size=2, min_group_size=2)
)


async def _round(averagers: list[Averager], round: int) -> list[StepResult]:
    results: dict[int, StepResult] = {}

    async def one(i: int) -> None:
        with trio.fail_after(CONFIG.step_bound + 10):
            results[i] = await averagers[i].step(round=round, expected_peers=len(averagers))

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(averagers))]
