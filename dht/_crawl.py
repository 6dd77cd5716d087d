"""Look-ups: node look-ups and record look-ups that merge replies.

Both subclass kademlia's ``SpiderCrawl`` (its ``NodeHeap`` of nearest
candidates) and replace its lock-step rounds. kademlia sends alpha requests,
waits for all of them, then sends the next alpha, so one dead node stalls every
round for a full RPC timeout. Here alpha requests stay in flight: as soon as
one answers (or times out), the next-closest uncontacted candidate is asked.
A dead node costs one slot for one timeout, not the whole look-up.

``RecordCrawl`` replaces ``ValueSpiderCrawl``, which stops at the first nodes
that return a value and keeps the most common one. For sub-keyed, expiring
records that is wrong: ten writers' sub-keys may sit on different nodes, and the
most common version may be the stale one. ``RecordCrawl`` validates every
record it receives and merges them per sub-key (latest expiration wins):

- ``latest=False`` stops once the ``quorum`` closest live nodes it has found
  have answered. Every writer stores to the k closest nodes its own look-up
  found; those look-ups converge on the very closest nodes first, so these few
  hold every writer's sub-keys even where the outer part of the k-sets differs.
  Stopping at the first node that holds anything would not: it may be a node
  that only one writer counted among its k closest.
- ``latest=True`` asks every one of the k closest nodes it can reach, so the
  newest version that any responsible node holds is returned.

It also remembers which responders returned less than the merged result, so
the caller can write the freshest records back to them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from kademlia.crawling import SpiderCrawl
from kademlia.node import Node

from swarm._clock import WallClock
from swarm._errors import RecordRejectedError

from ._records import Record, RecordLimits, merge, validate
from ._routing import NearestNodes

log = logging.getLogger(__name__)

#: ``rpc(node_to_ask, target, on_result)`` (``SwarmProtocol.request_find_*``)
RPC = Callable[[Node, Node, Callable[[tuple[bool, Any]], None]], None]


class LookupCrawl(SpiderCrawl):
    """Iterative look-up with ``alpha`` requests in flight (Kademlia paper, 2.3)."""

    def __init__(
        self, protocol: Any, node: Node, peers: list[Node], ksize: int, alpha: int
    ) -> None:
        super().__init__(protocol, node, [], ksize, alpha)
        self.nearest = NearestNodes(node, ksize)
        self.nearest.push(peers)

    async def _lookup(self, rpc: RPC) -> None:
        """Crawl until no candidate is left uncontacted or ``_satisfied()``.

        Driven by the replies themselves: ``rpc`` reports each result to a
        callback that handles it and sends the next request, so a request
        costs no asyncio task and the look-up wakes up once, when it is done
        (with all of trio-asyncio's loop rounds that saves). An exception
        raised while handling a reply is raised here. On cancellation, replies
        still in flight are ignored.
        """
        finished: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        in_flight = 0

        def send() -> None:
            nonlocal in_flight
            if self._satisfied():
                finished.set_result(None)
                return
            for peer in self.nearest.get_uncontacted():
                if in_flight >= self.alpha:
                    break
                self.nearest.mark_contacted(peer)
                in_flight += 1
                rpc(peer, self.node, functools.partial(on_result, peer))
            if not in_flight:
                finished.set_result(None)

        def on_result(peer: Node, result: tuple[bool, Any]) -> None:
            nonlocal in_flight
            if finished.done():
                return
            in_flight -= 1
            try:
                ok, answer = result
                if ok:
                    self._answered(peer, answer)
                else:
                    self.nearest.remove([peer.id])
                send()
            except Exception as e:  # raised in the awaiting look-up, not lost
                finished.set_exception(e)

        send()
        await finished

    def _answered(self, peer: Node, answer: Any) -> None:
        raise NotImplementedError

    def _satisfied(self) -> bool:
        """True to stop before every one of the k nearest was asked."""
        return False


class NodeCrawl(LookupCrawl):
    """Find the k closest live nodes to a key."""

    async def find(self) -> list[Node]:
        await self._lookup(self.protocol.request_find_node)
        return list(self.nearest)

    def _answered(self, peer: Node, answer: Any) -> None:
        self.nearest.push([Node(*c) for c in answer if c[0] not in self.nearest])


class RecordCrawl(LookupCrawl):
    """Find and merge the records of a key (see the module docstring)."""

    def __init__(
        self,
        protocol: Any,
        node: Node,
        peers: list[Node],
        ksize: int,
        alpha: int,
        *,
        latest: bool,
        limits: RecordLimits,
        clock: WallClock,
        quorum: int = 3,
    ) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.latest = latest
        self.quorum = quorum
        self._limits = limits
        self._clock = clock
        self.merged: dict[bytes | None, Record] = {}
        #: responder -> (node, what it returned by sub-key, whether it truncated)
        self.replies: dict[bytes, tuple[Node, dict[bytes | None, Record], bool]] = {}

    async def find(self) -> dict[bytes | None, Record]:
        """Crawl and return the merged records by sub-key (empty if none found)."""
        await self._lookup(self.protocol.request_find_value)
        return self.merged

    def _answered(self, peer: Node, answer: Any) -> None:
        records, contacts, truncated = answer
        kept: dict[bytes | None, Record] = {}
        now = self._clock()
        for record in records:
            if record.key_id != self.node.id:
                continue
            try:
                validate(record, now, self._limits)
            except RecordRejectedError as e:
                log.info("node %s served a bad record: %s", peer.id.hex()[:8], e)
                continue
            merge(kept, record)
        for record in kept.values():
            merge(self.merged, record)
        self.replies[peer.id] = (peer, kept, truncated)
        self.nearest.push([Node(*c) for c in contacts if c[0] not in self.nearest])

    def _satisfied(self) -> bool:
        if self.latest:
            return False
        closest = list(self.nearest)[: self.quorum]
        return all(n.id in self.replies for n in closest)

    def stale_responders(self, limit: int) -> list[tuple[Node, list[Record]]]:
        """Responders (closest first) that lack some of the merged records, with
        the records each lacks. Truncated replies are skipped: they may hold more."""
        stale = []
        for node, kept, truncated in self.replies.values():
            if truncated:
                continue
            missing = [r for sk, r in self.merged.items() if kept.get(sk) != r]
            if missing:
                stale.append((node, missing))
        stale.sort(key=lambda item: item[0].distance_to(self.node))
        return stale[:limit]
