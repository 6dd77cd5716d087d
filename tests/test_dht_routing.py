"""``NearestNodes`` against kademlia's ``NodeHeap``: pure code, no network."""

import random

from kademlia.node import Node, NodeHeap

from dht._routing import NearestNodes


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
