"""A man in the middle between two peers of a real all-reduce (127.0.0.1).

A TCP proxy (mitm_harness) sits in front of member 1: every byte member 0
sends to it, or receives from it, crosses the proxy, which flips one bit at a
seeded offset after the handshake, in an encrypted and in a plaintext
(authenticated) session. The session fails with a typed error, the tampered
frame is never used, and the all-reduce's fault rules apply: every chunk of
every member's result is the exact mean of the *original* inputs of the
members it names as contributors (a member cut off by the corruption is left
out; a reducer cut off leaves local values), and the side that received the
tampered frame bans the peer it came from.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
import trio
from mitm_harness import HOST, serve_proxy

from averaging import AllReduceConfig, AllReduceResult, Group, GroupMember, MemberMode, all_reduce
from averaging._allreduce import serve_allreduce
from swarm import Identity
from swarm._bans import BanList
from swarm._connections import ConnectionConfig, Connections, open_connections
from swarm._handshake import Handshake

TOTAL = 1000
CONFIG = AllReduceConfig(
    sender_timeout=2.0, reducer_timeout=4.0, round_timeout=15.0, chunk_elements=64
)
IDS = [Identity.from_seed(bytes([0xA0 + i]) * 32) for i in range(2)]


def _handshake_sizes() -> tuple[int, int]:
    """Bytes the dialer and the listener send during a handshake."""
    dialer = Handshake(IDS[0], initiator=True, expected_peer=IDS[1].peer_id)
    listener = Handshake(IDS[1], initiator=False)
    m1 = dialer.start()
    m2 = listener.receive_data(m1)
    m3 = dialer.receive_data(m2)
    return len(m1) + len(m3), len(m2)


@asynccontextmanager
async def two_members(encrypt: bool) -> AsyncIterator[list[Connections]]:
    async with AsyncExitStack() as stack:
        nets = [
            await stack.enter_async_context(
                open_connections(
                    identity,
                    config=ConnectionConfig(encrypt=encrypt),
                    bans=BanList(clock=trio.current_time),
                )
            )
            for identity in IDS
        ]
        for net in nets:
            serve_allreduce(net)
        yield nets


def _inputs() -> list[torch.Tensor]:
    # Small integers: every mean of two is exact in float32, so "the mean of
    # the original inputs" is an exact comparison.
    g = torch.Generator().manual_seed(7)
    return [torch.randint(-1000, 1000, (TOTAL,), generator=g).float() for _ in range(2)]


def _check_only_original_data_landed(
    inputs: list[torch.Tensor], outputs: list[torch.Tensor], results: list[AllReduceResult]
) -> set[int]:
    """Every chunk is the mean of its contributors' original inputs; returns the
    members whose result lacks the other member somewhere."""
    cut_off = set()
    for me, result in enumerate(results):
        for part, (start, end) in enumerate(result.part_bounds):
            for chunk, who in enumerate(result.contributors[part]):
                a = start + chunk * result.chunk_elements
                b = min(end, a + result.chunk_elements)
                expected = torch.stack([inputs[i][a:b] for i in sorted(who)]).mean(dim=0)
                assert torch.equal(outputs[me][a:b], expected), (me, part, chunk, who)
                if who != {0, 1}:
                    cut_off.add(me)
    return cut_off


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plaintext"])
@pytest.mark.parametrize("direction", ["to_reducer", "to_sender"])
@pytest.mark.parametrize("seed", [1, 2])
async def test_flipped_bit_between_members_is_never_averaged_in(
    encrypt: bool, direction: str, seed: int
) -> None:
    dialer_bytes, listener_bytes = _handshake_sizes()
    rng = random.Random(seed)
    # Somewhere in what member 0 sends to member 1's reducer (its part is
    # 500 floats: about 2 KB of frames), or in the averaged part coming back.
    # Between two members that both reduce a part, each reducer's results
    # travel with its own data, dialer to listener; only a member that
    # reduces nothing (a client) gets them back, listener to dialer.
    mode = MemberMode.CLIENT if direction == "to_sender" else MemberMode.NODE
    if direction == "to_reducer":
        flips = (dialer_bytes + rng.randrange(2000), None)
    else:
        flips = (None, listener_bytes + rng.randrange(2000))
    inputs = _inputs()
    tensors = [x.clone() for x in inputs]
    async with two_members(encrypt) as nets, trio.open_nursery() as nursery:
        proxy_port = await nursery.start(serve_proxy, nets[1].port, *flips)
        members = (
            GroupMember(nets[0].peer_id, HOST, nets[0].port, 1.0, mode),
            GroupMember(nets[1].peer_id, HOST, proxy_port),  # everyone dials 1 via the proxy
        )
        results: list[AllReduceResult] = []

        async def member(i: int) -> None:
            group = Group(b"mitm", members, i)
            results.append(await all_reduce(nets[i], group, [tensors[i]], config=CONFIG))

        async with trio.open_nursery() as members_nursery:
            for i in range(2):
                members_nursery.start_soon(member, i)
        results.sort(key=lambda r: r.local_index)
        cut_off = _check_only_original_data_landed(inputs, tensors, results)
        assert cut_off, "the tampering went unnoticed"
        # The receiver of the tampered frame bans the peer it came from (and
        # closes every connection with it, so how much of part 0 was averaged
        # depends on timing; what was averaged is exact, as checked above).
        victim, culprit = (1, 0) if direction == "to_reducer" else (0, 1)
        assert nets[victim].bans.is_banned(IDS[culprit].peer_id)
        assert not nets[culprit].bans.is_banned(IDS[victim].peer_id)
        nursery.cancel_scope.cancel()
