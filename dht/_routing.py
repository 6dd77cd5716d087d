"""Two of kademlia's structures, corrected.

``NearestNodes``: kademlia's ``NodeHeap`` (a look-up's candidates) with a set
of the ids it holds. kademlia's ``NodeHeap.push`` tests membership by scanning
the whole heap with a generator for every contact a reply brings, so a look-up
costs O(replies x contacts x heap) generator steps. Here membership is a set
look-up; ordering, size limit, removal and the contacted marks are kademlia's,
unchanged.

``SwarmRoutingTable``: kademlia's ``RoutingTable`` whose ``find_neighbors``
returns the k contacts closest to a target. kademlia's walks the buckets out
from the target's, alternating left and right, and stops at the first empty
bucket on the left once none is left on the right: a node whose table held 25
contacts answered a newcomer's ``find_node`` for an id in its last bucket
with none (the bucket held only the newcomer, the one to its left was empty).
The newcomer's bootstrap then ended with that one contact, and its reads
found a fraction of a key's records, or none (``benchmarks/scale.py``, 256
peers: 1-2 such peers per run; one read the first epoch's grid proposals as
its own alone, and averaged on another grid, alone).
"""

from __future__ import annotations

import heapq
from typing import Any

from kademlia.node import Node, NodeHeap
from kademlia.routing import RoutingTable


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

    def closest(self, count: int, *, skip: set[bytes]) -> list[Node]:
        """The ``count`` closest nodes held whose ids are not in ``skip``, closest first."""
        if not skip:
            return [node for _, node in heapq.nsmallest(count, self.heap)]
        nearest = heapq.nsmallest(count + len(skip), self.heap)
        return [node for _, node in nearest if node.id not in skip][:count]

    def __contains__(self, node: Node | bytes) -> bool:
        """Whether a node (or a node id) is held."""
        return (node if isinstance(node, bytes) else node.id) in self._ids


class SwarmRoutingTable(RoutingTable):
    def find_neighbors(
        self, node: Node, k: int | None = None, exclude: Node | None = None
    ) -> list[Node]:
        """The ``k`` (default: ksize) contacts closest to ``node``, closest first,
        other than ``node`` itself and any at ``exclude``'s address. Every
        bucket counts (see the module docstring); a table holds a few hundred
        contacts at most, so scanning it costs little next to a request's
        signature. The target's bucket counts as looked up, as in kademlia
        (``lonely_buckets``)."""
        self.buckets[self.get_bucket_for(node)].touch_last_updated()
        contacts: list[Any] = [
            contact
            for bucket in self.buckets
            for contact in bucket.get_nodes()
            if contact.id != node.id and (exclude is None or not contact.same_home_as(exclude))
        ]
        return heapq.nsmallest(k or self.ksize, contacts, key=node.distance_to)
