"""Routing code against plain scans and kademlia's own: pure code, no network."""

import random

from kademlia.node import Node, NodeHeap
from kademlia.routing import RoutingTable

from dht import RecordLimits, RequestRateLimit
from dht._protocol import SwarmProtocol
from dht._routing import NearestNodes
from dht._storage import RecordStorage
from swarm import Identity, ManualClock


def test_nearest_nodes_behaves_like_kademlias_node_heap() -> None:
    rng = random.Random(5)
    for _ in range(60):
        target = Node(rng.randbytes(20))
        ours, stock = NearestNodes(target, 20), NodeHeap(target, 20)
        seen: list[Node] = []
        for _ in range(40):
            op = rng.random()
            if op < 0.6 or not seen:
                # replies repeat contacts, as new Node objects with the same id
                batch = [
                    Node(rng.choice(seen).id, "127.0.0.1", 1)
                    if seen and rng.random() < 0.5
                    else Node(rng.randbytes(20), "127.0.0.1", 2)
                    for _ in range(rng.randrange(0, 25))
                ]
                seen += batch
                # kademlia's push takes a list or a single node
                pushed: Node | list[Node] = batch[0] if batch and rng.random() < 0.2 else batch
                ours.push(pushed)
                stock.push(pushed)
            elif op < 0.8:
                gone = [n.id for n in rng.sample(seen, min(len(seen), 3))]
                ours.remove(gone)
                stock.remove(gone)
            elif op < 0.9:
                assert ours.popleft() is stock.popleft()
            else:
                for n in list(stock)[:2]:
                    ours.mark_contacted(n)
                    stock.mark_contacted(n)
            assert list(ours) == list(stock)
            assert ours.get_uncontacted() == stock.get_uncontacted()
            assert len(ours) == len(stock)
            probe = rng.choice(seen)
            assert (probe in ours) == (probe in stock)


def _protocol(own: Identity) -> SwarmProtocol:
    clock = ManualClock(0.0)
    return SwarmProtocol(
        Node(own.peer_id),
        RecordStorage(clock, RecordLimits()),
        20,
        identity=own,
        limits=RecordLimits(),
        rpc_timeout=1.0,
        clock=clock,
        rate_limit=RequestRateLimit(),
        rate_clock=ManualClock(0.0),
    )


def test_closest_known_agrees_with_a_scan_of_the_whole_routing_table() -> None:
    rng = random.Random(11)
    proto = _protocol(Identity.from_seed(b"r" * 32))
    own = proto.source_node
    answers = set()
    for n in range(400):
        contact = Node(_near(own.id, rng), "127.0.0.1", 1000 + n)
        # a full bucket would ping its head; this node is never its own contact
        bucket = proto.router.buckets[proto.router.get_bucket_for(contact)]
        room = (
            len(bucket) < bucket.ksize or bucket.has_in_range(own) or bucket.depth() % 5 != 0
        )
        if room and contact.id != own.id:
            proto.router.add_contact(contact)
        contacts = [c for b in proto.router.buckets for c in b.get_nodes()]
        for target in (Node(_near(own.id, rng)), Node(rng.randbytes(20))):
            # as in kademlia's find_neighbors, a contact with the key's own id is left out
            scan = all(
                c.distance_to(target) > own.distance_to(target)
                for c in contacts
                if c.id != target.id
            )
            assert proto._closest_known(target) == scan
            answers.add(scan)
    assert answers == {True, False}
    assert len(proto.router.buckets) > 5  # the table did split


def test_neighbors_are_the_k_closest_contacts_of_the_whole_table() -> None:
    # kademlia's walk out from the target's bucket stopped at an empty bucket
    # on the left once none was left on the right: a node of 25 contacts once
    # answered a newcomer's find_node with none, and the newcomer's bootstrap
    # ended with one contact (``dht._routing``)
    rng = random.Random(19)
    short = 0
    for _ in range(40):
        proto = _protocol(Identity.from_seed(rng.randbytes(32)))
        own = proto.source_node
        for n in range(rng.randrange(20, 120)):
            contact = Node(_near(own.id, rng), "127.0.0.1", 1000 + n)
            bucket = proto.router.buckets[proto.router.get_bucket_for(contact)]
            room = len(bucket) < bucket.ksize or bucket.has_in_range(own) or bucket.depth() % 5 != 0
            if room and contact.id != own.id:
                proto.router.add_contact(contact)
        contacts = [c for b in proto.router.buckets for c in b.get_nodes()]
        for _ in range(20):
            target = Node(
                rng.choice([_near(own.id, rng), rng.randbytes(20), rng.choice(contacts).id])
            )
            sender = rng.choice(contacts)
            for exclude in (None, sender):
                scan = sorted(
                    (
                        c
                        for c in contacts
                        if c.id != target.id and (exclude is None or c.port != exclude.port)
                    ),
                    key=target.distance_to,
                )[:20]
                assert proto.router.find_neighbors(target, exclude=exclude) == scan
                assert proto.router.find_neighbors(target, 3, exclude) == scan[:3]
                if exclude is not None:  # what a find_node from ``sender`` is answered
                    answer = proto._rpc_find_node(sender, [target.id])
                    assert [contact[0] for contact in answer] == [c.id for c in scan]
                stock = RoutingTable.find_neighbors(proto.router, target, exclude=exclude)
                short += len(stock) < len(scan)
    assert short > 0  # the layouts include those that kademlia's walk cut short


def _near(node_id: bytes, rng: random.Random) -> bytes:
    """An id at a random XOR distance from ``node_id``, of any length."""
    distance = rng.getrandbits(rng.randrange(1, 161))
    return (int.from_bytes(node_id, "big") ^ distance).to_bytes(20, "big")
