"""``RecordCrawl``: a value look-up that merges replies instead of trusting one.

kademlia's ``ValueSpiderCrawl`` stops at the first nodes that return a value
and keeps the most common one. For sub-keyed, expiring records that is wrong:
ten writers' sub-keys may sit on different nodes, and the most common version
may be the stale one. This crawl walks toward the key like a node look-up,
validates every record it receives, and merges them per sub-key (latest
expiration wins).

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

import logging
from typing import Any

from kademlia.crawling import SpiderCrawl
from kademlia.node import Node

from swarm._clock import WallClock
from swarm._errors import RecordRejectedError

from ._records import Record, RecordLimits, merge, validate

log = logging.getLogger(__name__)


class RecordCrawl(SpiderCrawl):
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
        #: responder -> what it returned, by sub-key (None: it returned nothing)
        self.replies: dict[bytes, tuple[Node, dict[bytes | None, Record], bool]] = {}

    async def find(self) -> dict[bytes | None, Record]:
        """Crawl and return the merged records by sub-key (empty if none found)."""
        return await self._find(self.protocol.call_find_value)

    async def _nodes_found(self, responses: dict[bytes, Any]) -> dict[bytes | None, Record]:
        failed = []
        now = self._clock()
        for peer_id, (ok, answer) in responses.items():
            if not ok:
                failed.append(peer_id)
                continue
            records, contacts, truncated = answer
            kept: dict[bytes | None, Record] = {}
            for record in records:
                if record.key_id != self.node.id:
                    continue
                try:
                    validate(record, now, self._limits)
                except RecordRejectedError as e:
                    log.info("node %s served a bad record: %s", peer_id.hex()[:8], e)
                    continue
                merge(kept, record)
            for record in kept.values():
                merge(self.merged, record)
            self.replies[peer_id] = (self.nearest.get_node(peer_id), kept, truncated)
            self.nearest.push([Node(*c) for c in contacts])
        self.nearest.remove(failed)
        if self._done():
            return self.merged
        return await self.find()

    def _done(self) -> bool:
        if self.nearest.have_contacted_all():
            return True
        if self.latest:
            return False
        closest = list(self.nearest)[: self.quorum]
        return all(n.id in self.nearest.contacted for n in closest)

    def stale_responders(self, limit: int) -> list[tuple[Node, list[Record]]]:
        """Responders (closest first) that lack some of the merged records, with
        the records each lacks. Truncated replies are skipped: they may hold more."""
        stale = []
        for node, kept, truncated in self.replies.values():
            if truncated or node is None:
                continue
            missing = [r for sk, r in self.merged.items() if kept.get(sk) != r]
            if missing:
                stale.append((node, missing))
        stale.sort(key=lambda item: item[0].distance_to(self.node))
        return stale[:limit]
