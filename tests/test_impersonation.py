"""Impersonation in the DHT, on real UDP sockets on 127.0.0.1.

A node id is the hash of the key that signs every datagram, so claiming
another node's id needs that node's signature. The remaining trick is to
replay a datagram that node really signed, from another address: the
receiver answers it (the answer is public anyway), but it only adds a node to
its routing table after pinging it back at that address and getting an
answer signed by the claimed key for the fresh message id, which a replayer
cannot produce. (Connections: tests/test_handshake.py and
tests/test_connections.py::test_wrong_peer_id_is_refused.)
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

from dht import DHTConfig, open_dht_node
from dht._messages import Kind, decode, encode, new_msg_id
from swarm import Identity

ALICE = Identity.from_seed(b"i" * 32)
HOST = "127.0.0.1"
CONFIG = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=2.0)


async def _wait_until(condition: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while not condition():
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)


async def test_a_replayed_request_does_not_put_the_claimed_id_at_the_replayers_address() -> None:
    async with open_dht_node(Identity.generate(), config=CONFIG) as node:
        proto = node._server.proto
        mallory = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
        with mallory:
            await mallory.bind((HOST, 0))
            # A request Alice really signed, sent from Mallory's socket.
            replayed = encode(ALICE, Kind.REQUEST, new_msg_id(), ["ping", []])
            await mallory.sendto(replayed, (HOST, node.port))
            answer = decode(await mallory.recv(65536))
            assert answer.kind is Kind.RESPONSE and answer.sender == node.peer_id
            # The node pings "Alice" back at Mallory's address, with a fresh id.
            ping_back = decode(await mallory.recv(65536))
            assert ping_back.kind is Kind.REQUEST and ping_back.body == ["ping", []]
            # Mallory can only answer with her own key, or replay Alice's old answer.
            own = Identity.from_seed(b"m" * 32)
            await mallory.sendto(
                encode(own, Kind.RESPONSE, ping_back.msg_id, None), (HOST, node.port)
            )
            await mallory.sendto(
                encode(ALICE, Kind.RESPONSE, new_msg_id(), None), (HOST, node.port)
            )
            await _wait_until(lambda: not proto._pinging)  # the ping-back timed out
            mallory_port = mallory.getsockname()[1]
        assert all(contact[0] != ALICE.peer_id for contact in node.contacts())
        # The failed ping-back discredits Alice at Mallory's address only: look-ups
        # still follow other nodes to Alice at any other address.
        alice_at = [(bytes(ALICE.peer_id), HOST, port) for port in (mallory_port, mallory_port + 1)]
        assert proto._live(alice_at) == alice_at[1:]

        # Control: the real Alice, answering from her own address, is added.
        async with open_dht_node(ALICE, config=CONFIG, initial_peers=[(HOST, node.port)]):
            await _wait_until(
                lambda: any(contact[0] == ALICE.peer_id for contact in node.contacts())
            )
