"""``NeighborTable.find_neighbors`` against a brute-force search and kademlia's own,
and ``NearestNodes`` against kademlia's ``NodeHeap``: pure code, no network.
Tables are filled by kademlia's bucket rules (splits, replacement lists) from
seeded random ids."""

import random

from kademlia.node import Node, NodeHeap
from kademlia.routing import RoutingTable

from dht._routing import NearestNodes, NeighborTable


def _fill(table: RoutingTable, nodes: list[Node]) -> None:
    """kademlia's ``add_contact`` without the ping of a full bucket's head
    (which needs a network; the newcomer is kept as a replacement either way)."""
    for node in nodes:
        while True:
            index = table.get_bucket_for(node)
            bucket = table.buckets[index]
            if bucket.add_node(node):
                break
            if not (bucket.has_in_range(table.node) or bucket.depth() % 5 != 0):
                break
            table.split_bucket(index)


def _random_table(rng: random.Random, size: int, ksize: int) -> NeighborTable:
    table = NeighborTable(None, ksize, Node(rng.randbytes(20)))
    # a few contacts share an address (a node that restarted with another id)
    nodes = [
        Node(rng.randbytes(20), "127.0.0.1", rng.randrange(1000, 1000 + 3 * size))
        for _ in range(size)
    ]
    _fill(table, nodes)
    return table


def _distance(a: Node, b: Node) -> int:
    return a.long_id ^ b.long_id


def test_find_neighbors_returns_the_k_closest_contacts() -> None:
    rng = random.Random(1)
    for trial in range(120):
        ksize = rng.choice([3, 8, 20])
        table = _random_table(rng, rng.randrange(0, 400), ksize)
        contacts = [n for b in table.buckets for n in b.nodes.values()]
        targets = [Node(rng.randbytes(20)) for _ in range(3)] + rng.sample(
            contacts, min(3, len(contacts))
        )
        for target in targets:
            for k in (None, 1, rng.randrange(1, 30)):
                exclude = rng.choice([None, *contacts[:5]])
                expected = sorted(
                    (
                        n
                        for n in contacts
                        if n.id != target.id and (exclude is None or not n.same_home_as(exclude))
                    ),
                    key=lambda n: _distance(n, target),
                )[: k or ksize]
                assert table.find_neighbors(target, k, exclude) == expected, trial


def test_find_neighbors_is_never_farther_than_kademlias() -> None:
    """Same table, same arguments: kademlia's traversal stops after the first k
    contacts in bucket order, so it may miss closer ones; ours never does."""
    rng = random.Random(2)
    differs = 0
    for _ in range(200):
        table = _random_table(rng, rng.randrange(1, 300), 20)
        stock = RoutingTable(None, 20, table.node)
        stock.buckets = table.buckets
        contacts = [n for b in table.buckets for n in b.nodes.values()]
        target = rng.choice([Node(rng.randbytes(20)), rng.choice(contacts)])
        exclude = rng.choice([None, rng.choice(contacts)])
        ours = table.find_neighbors(target, exclude=exclude)
        theirs = stock.find_neighbors(target, exclude=exclude)
        assert len(ours) >= len(theirs)
        assert all(
            _distance(a, target) <= _distance(b, target) for a, b in zip(ours, theirs, strict=False)
        )
        differs += ours != theirs
    assert differs > 0  # the comparison is not vacuous


def test_hands_over_agrees_with_the_find_neighbors_rule() -> None:
    """welcome_if_new's rule (Kademlia paper, 2.5), written with find_neighbors."""
    rng = random.Random(6)
    pushed = 0
    for _ in range(150):
        table = _random_table(rng, rng.randrange(0, 120), rng.choice([3, 20]))
        contacts = [n for b in table.buckets for n in b.nodes.values()]
        for _ in range(10):
            # keys near our own id too, so that we are sometimes the closest
            key = Node(rng.choice([rng.randbytes(20), table.node.id[:18] + rng.randbytes(2)]))
            if contacts and rng.random() < 0.1:
                key = rng.choice(contacts)
            newcomer = Node(rng.choice([rng.randbytes(20), key.id[:19] + rng.randbytes(1)]))
            neighbors = table.find_neighbors(key)
            expected = not neighbors or (
                _distance(newcomer, key) < _distance(neighbors[-1], key)
                and _distance(table.node, key) < _distance(neighbors[0], key)
            )
            assert table.hands_over(key, newcomer) == expected
            pushed += expected
    assert 0 < pushed < 1500  # both answers occur


def test_find_neighbors_marks_the_targets_bucket_used() -> None:
    table = _random_table(random.Random(3), 200, 8)
    assert len(table.buckets) > 2
    for bucket in table.buckets:
        bucket.last_updated = 0.0
    target = Node(random.Random(4).randbytes(20))
    table.find_neighbors(target)
    touched = [i for i, b in enumerate(table.buckets) if b.last_updated > 0.0]
    assert touched == [table.get_bucket_for(target)]


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
