"""Automatic hole punching behind real NATs (``netbed.Nat``, ``swarm._punch``).

Three peers, each in a namespace of its own with a user's defaults (``--host
0.0.0.0``, nothing announced): peer 0 is public, peers 1 and 2 sit behind
routers that drop unsolicited packets (``Nat(stealth=True)``), find out by
dial-back that nobody can reach them and register with peer 0 as their
relay. Nobody asks for a punch: each NATed peer calls the other through the
relay, and ``AutoPunch`` punches a direct connection in the background,
which the pool prefers to the relay from then on. NAT behaviours covered:
port-preserving MASQUERADE (the punch succeeds) and symmetric
(``--random-fully``: it fails, is counted, and the relay goes on).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
from cli_harness import CLIProcess, run_command
from netbed import Link, Nat, NetBed

#: argv: index, initial peer ("" for the founder), port, the public host of
#: the other NATed peer. A NATed peer calls the other through their relay
#: until its automatic punch is over and prints "punch S F" (successes and
#: failures), then calls again ("through the punch: ..."). Once its relay is
#: gone, peer 1 calls peer 2 ("after the relay left: ..."), then calls it
#: until a call fails, waits until no connection from peer 2's host is left,
#: leaves ``open_peer`` and prints "stopped cleanly": an error of the punched
#: connections that reached the peer's nursery would make ``open_peer``
#: raise instead.
PEER = """
import sys, trio
from swarm import Identity, PeerConfig, SwarmError, open_peer

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]

async def who(stream):
    await stream.receive()
    await stream.send(b"here")

async def call(peer, other, label):
    try:
        answer = await peer.connections.call(other, ("10.0.0.1", 1), "who", "?", timeout=10)
        print(label, answer.decode(), flush=True)
        return True
    except SwarmError as e:
        print(label, "failed", type(e).__name__, e, flush=True)
        return False

async def main():
    index, initial, port, other_host = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    index = int(index)
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else ())
    async with open_peer(IDS[index], config) as peer:
        peer.connections.set_handler("who", who)
        print("address", peer.address, flush=True)
        if index == 0:
            await trio.sleep_forever()
        await peer.relay_found.wait()
        print("relayed", flush=True)
        other = IDS[3 - index].peer_id
        # both are relayed by peer 0, at the same circuit address
        peer.connections.set_relay_route(other, peer.relayed_by[1])
        auto = peer.auto_punch
        while auto.successes + auto.failures == 0:
            await call(peer, other, "through the relay:")
            await trio.sleep(0.2)
        print("punch", auto.successes, auto.failures, flush=True)
        await call(peer, other, "through the punch:")
        if index == 2:
            await trio.sleep_forever()
        while peer.relayed_by is not None:
            await trio.sleep(0.1)
        await call(peer, other, "after the relay left:")
        while await call(peer, other, "after the peer left:"):
            await trio.sleep(0.2)
        while peer.connections.inbound_count(other_host):
            await trio.sleep(0.1)
    print("stopped cleanly", flush=True)

trio.run(main)
"""
PORT = 7000


@asynccontextmanager
async def _peers(bed: NetBed) -> AsyncIterator[list[CLIProcess]]:
    founder = f"{bed.addresses[0]}:{PORT}"
    async with AsyncExitStack() as stack:
        peers: list[CLIProcess] = []
        for i in range(3):
            other = bed.public_addresses[3 - i] if i else ""
            argv = [sys.executable, "-c", PEER, str(i), founder if i else "", str(PORT), other]
            peers.append(await stack.enter_async_context(run_command(*bed.exec(i, argv))))
            await peers[i].read_line_containing("address", timeout=60)
        for i in (1, 2):
            await peers[i].read_line_containing("relayed", timeout=60)
        yield peers


@pytest.mark.slow
async def test_natted_peers_punch_by_themselves_and_survive_the_other_leaving() -> None:
    """Behind port-preserving NATs both peers punch by themselves, the pool
    uses the punched connection (it still carries calls once the relay is
    gone), and killing the other peer, which closes every punched connection
    from the remote side, leaves the peer running: it stops cleanly."""
    nats = [None, Nat(stealth=True), Nat(stealth=True)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        async with _peers(bed) as peers:
            for i in (1, 2):
                line = await peers[i].read_line_containing("punch ", timeout=60)
                assert line == "punch 1 0", line
                line = await peers[i].read_line_containing("through the punch:", timeout=30)
                assert line == "through the punch: here", line
            peers[0].process.kill()
            line = await peers[1].read_line_containing("after the relay left:", timeout=30)
            assert line == "after the relay left: here", line
            peers[2].process.kill()
            line = await peers[1].read_line_containing("after the peer left:", timeout=30)
            while line == "after the peer left: here":  # until it notices
                line = await peers[1].read_line_containing("after the peer left:", timeout=30)
            line = await peers[1].read_line_containing("stopped", timeout=60)
            assert line == "stopped cleanly", line
            assert await peers[1].finish(timeout=30) == 0


@pytest.mark.slow
async def test_behind_a_symmetric_nat_a_punch_fails_and_the_relay_carries_on() -> None:
    """A symmetric NAT maps each destination to a new port: the automatic
    punch fails, is counted, and the relay still carries the calls."""
    nats = [None, Nat(stealth=True), Nat(symmetric=True, stealth=True)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        async with _peers(bed) as peers:
            for i in (1, 2):
                line = await peers[i].read_line_containing("punch ", timeout=60)
                assert line == "punch 0 1", line
                line = await peers[i].read_line_containing("through the punch:", timeout=30)
                assert line == "through the punch: here", line
