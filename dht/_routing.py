"""Faster versions of kademlia's nearest-node searches (routing table, look-ups).

``NeighborTable``: kademlia's routing table with a fast, exact ``find_neighbors``.

kademlia's ``RoutingTable.find_neighbors`` walks the buckets outward from the
target's bucket through a ``TableTraverser`` (one generator step, one
``same_home_as`` and one heap push per contact) and stops after the first
``k`` contacts it meets; it runs on every find_node/find_value request we answer
and for every stored key each time a new node is welcomed, so in a swarm that
all lives in one process it is a large share of the CPU of an RPC. Stopping
after ``k`` contacts in bucket order also means it can miss closer contacts in
a bucket it did not reach (and when the right-hand buckets run out on its
turn, it stops with fewer than ``k`` although more are known).

``NeighborTable`` answers with exactly what the Kademlia paper (section 2.3)
asks for: the ``k`` contacts in the table closest to the target by XOR
distance, over all buckets: one int XOR per contact and ``heapq.nsmallest``.
It excludes what kademlia excludes (the target's own id, and every contact at
the ``exclude`` node's ip and port) and, like kademlia's traverser, marks the
target's bucket as used so that bucket refreshes see the same activity.
``hands_over`` answers welcome_if_new's question for a stored key without
building that list. Buckets, splitting, replacement lists and eviction are
kademlia's, untouched.

``NearestNodes``: kademlia's ``NodeHeap`` (a look-up's candidates) with a set
of the ids it holds. kademlia's tests membership by scanning the whole heap for
every contact a reply brings, so one look-up costs O(replies x contacts x heap).
"""

from __future__ import annotations

import heapq

from kademlia.node import Node, NodeHeap
from kademlia.routing import RoutingTable


class NeighborTable(RoutingTable):
    def find_neighbors(
        self, node: Node, k: int | None = None, exclude: Node | None = None
    ) -> list[Node]:
        """The ``k`` (default ``ksize``) contacts closest to ``node``, closest first.

        Never returns a contact with ``node``'s id, nor one at ``exclude``'s ip
        and port. Returns fewer than ``k`` only when the table holds fewer.
        """
        k = k or self.ksize
        self.buckets[self.get_bucket_for(node)].touch_last_updated()
        target, target_id = node.long_id, node.id
        if exclude is None:
            contacts = [
                (n.long_id ^ target, n)
                for bucket in self.buckets
                for n in bucket.nodes.values()
                if n.id != target_id
            ]
        else:
            home = (exclude.ip, exclude.port)
            contacts = [
                (n.long_id ^ target, n)
                for bucket in self.buckets
                for n in bucket.nodes.values()
                if n.id != target_id and (n.ip, n.port) != home
            ]
        # distances are unique (ids are), so the Node is never compared
        return [n for _, n in heapq.nsmallest(k, contacts)]

    def hands_over(self, key: Node, newcomer: Node) -> bool:
        """Whether we push our records of ``key`` to ``newcomer``, a node not in
        the table yet (Kademlia paper, section 2.5): when we are closer to the key
        than every contact and ``newcomer`` is closer than the farthest of
        ``find_neighbors(key)``, or when that is empty. The same answer as
        kademlia's ``welcome_if_new`` computes from ``find_neighbors``, without
        building its list for the many keys where we are not the closest."""
        self.buckets[self.get_bucket_for(key)].touch_last_updated()
        target, target_id = key.long_id, key.id
        distances = [
            n.long_id ^ target
            for bucket in self.buckets
            for n in bucket.nodes.values()
            if n.id != target_id
        ]
        if not distances:
            return True
        if self.node.long_id ^ target >= min(distances):
            return False
        farthest = heapq.nsmallest(self.ksize, distances)[-1]
        return bool(newcomer.long_id ^ target < farthest)


class NearestNodes(NodeHeap):
    def __init__(self, node: Node, maxsize: int) -> None:
        super().__init__(node, maxsize)
        self._ids: set[bytes] = set()

    def push(self, nodes: Node | list[Node]) -> None:
        """Add contacts whose id is not held yet (kademlia's rule, in O(1) each)."""
        for node in nodes if isinstance(nodes, list) else [nodes]:
            if node.id not in self._ids:
                self._ids.add(node.id)
                heapq.heappush(self.heap, (self.node.distance_to(node), node))

    def remove(self, peers: list[bytes]) -> None:
        super().remove(peers)
        self._ids = {node.id for _, node in self.heap}

    def popleft(self) -> Node | None:
        node: Node | None = super().popleft()
        if node is not None:
            self._ids.discard(node.id)
        return node

    def __contains__(self, node: Node) -> bool:
        return node.id in self._ids
