"""Relays through real NATs (``netbed.Nat``): two peers, each behind its own
home router, reach each other through a public peer (``swarm._relay``).

Every peer runs in a namespace of its own with a user's defaults (``--host
0.0.0.0``, nothing announced), learns by dial-back that it is unreachable
(``swarm._reachability``), and then registers with a reachable peer as its
relay by itself (``AsyncPeer.keep_relay``). NAT behaviours covered:
port-preserving MASQUERADE with address-and-port-dependent filtering, and
symmetric (``--random-fully``): both only dial out, which is all a relay
needs of them.
"""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack

from cli_harness import CLIProcess, run_command
from netbed import Link, Nat, NetBed

#: argv: index, founder address (empty: this is the founder), port, and peer
#: 2's address. Identities come from the index, so peers know each other's ids
#: without a lookup. A NATed peer waits until it registered with a relay, says
#: whether that is the founder (the only reachable peer), and serves "who"
#: (replies the caller's id as the handshake proved it); peer 1 then calls peer
#: 2 once directly, which must fail, and three times through the relay.
PEER = """
import sys, trio
from swarm import Identity, PeerConfig, SwarmError, open_peer

def identity(i):
    return Identity.from_seed(bytes([i + 1]) * 32)

async def who(stream):
    await stream.receive()
    await stream.send(bytes(stream.remote))

async def main():
    index, founder, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(founder,) if founder else ())
    async with open_peer(identity(index), config) as peer:
        peer.connections.set_handler("who", who)
        print("address", peer.address, flush=True)
        if index == 0:
            await trio.sleep_forever()
        await peer.reachability_found.wait()
        print("verdict", peer.reachability.value, flush=True)
        await peer.relay_found.wait()  # registers with a relay by itself
        relay_peer, relay = peer.relayed_by
        print("relayed", relay_peer == identity(0).peer_id, flush=True)
        if index == 1:
            target = identity(2).peer_id
            h, p = sys.argv[4].rsplit(":", 1)
            try:
                await peer.connections.call(target, (h, int(p)), "who", "?", timeout=5)
                print("direct ok", flush=True)
            except SwarmError as e:
                print("direct failed", type(e).__name__, flush=True)
            peer.connections.set_relay_route(target, relay)
            for _ in range(3):
                answer = await peer.connections.call(target, (h, int(p)), "who", "?", timeout=10)
                print("relayed call", answer == bytes(identity(1).peer_id), flush=True)
        await trio.sleep_forever()

trio.run(main)
"""
PORT = 7000
_PEERS = 3


async def test_two_natted_peers_reach_each_other_through_a_public_relay() -> None:
    with NetBed([Link()] * _PEERS, nats=[None, Nat(), Nat(symmetric=True)]) as bed:
        founder = f"{bed.addresses[0]}:{PORT}"
        async with AsyncExitStack() as stack:
            peers: dict[int, CLIProcess] = {}
            # peer 2 first: peer 1 calls it as soon as peer 1 has its relay
            for i in (0, 2, 1):
                target = f"{bed.addresses[2]}:{PORT}"
                argv = [sys.executable, "-c", PEER, str(i), founder if i else "", str(PORT), target]
                peers[i] = await stack.enter_async_context(run_command(*bed.exec(i, argv)))
                await peers[i].read_line_containing("address", timeout=60)
                if i:
                    line = await peers[i].read_line_containing("verdict", timeout=60)
                    assert line.split()[1] == "unreachable", line
                    line = await peers[i].read_line_containing("relayed", timeout=60)
                    assert line == "relayed True", line
            line = await peers[1].read_line_containing("direct", timeout=60)
            assert line.startswith("direct failed"), line
            for _ in range(3):
                line = await peers[1].read_line_containing("relayed call", timeout=60)
                assert line == "relayed call True", line
