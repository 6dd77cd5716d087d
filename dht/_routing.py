"""``NearestNodes``: kademlia's ``NodeHeap`` (a look-up's candidates) with a set
of the ids it holds.

kademlia's ``NodeHeap.push`` tests membership by scanning the whole heap with a
generator for every contact a reply brings, so a look-up costs O(replies x
contacts x heap) generator steps. Here membership is a set look-up; ordering,
size limit, removal and the contacted marks are kademlia's, unchanged.
"""

from __future__ import annotations

import heapq

from kademlia.node import Node, NodeHeap


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
