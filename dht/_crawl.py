"""Look-ups: node look-ups and record look-ups that merge replies.

Both subclass kademlia's ``SpiderCrawl`` (its ``NodeHeap`` of nearest
candidates) and replace its lock-step rounds. kademlia sends alpha requests,
waits for all of them, then sends the next alpha, so one dead node stalls every
round for a full RPC timeout. Here alpha requests stay in flight: as soon as
one answers (or times out), the next-closest uncontacted candidate is asked.
A dead node costs one slot for one timeout, not the whole look-up.

Nor does it cost a timeout: a request unanswered for longer than the round
trips measured so far suggest (``RoundTrips.hedge_after``, a few round trips)
is *late*. Its slot goes to the next candidate at once (a hedged request),
and the look-up no longer waits for it: it counts among the k closest again
only if its answer still comes. A look-up ends when the k closest candidates
that are not late have answered (for ``RecordCrawl``, see below), so a swarm
that holds dead contacts costs a look-up a few round trips per dead contact
met, in parallel with the other requests, instead of one RPC timeout each.
A record look-up that has found nothing when the rest is done does wait for
its late requests: a slow node near the key may be the one holding it.
The late request's own timeout still runs: if it fails, the node is evicted
from the routing table and left out of look-ups for a while (``_protocol``).

``RecordCrawl`` replaces ``ValueSpiderCrawl``, which stops at the first nodes
that return a value and keeps the most common one. For sub-keyed, expiring
records that is wrong: ten writers' sub-keys may sit on different nodes, and the
most common version may be the stale one. ``RecordCrawl`` validates every
record it receives and merges them per sub-key (latest expiration wins):

- ``latest=False`` stops once the ``quorum`` closest live nodes it has found
  have answered with all their records (a node late or answering in part is
  passed over, or read whole when its late answer comes). Every writer
  stores to the k closest nodes its own look-up found; those look-ups
  converge on the very closest nodes first, so these few hold every writer's
  sub-keys even where the outer part of the k-sets differs.
  Stopping at the first node that holds anything would not: it may be a node
  that only one writer counted among its k closest.
- ``latest=True`` asks every one of the k closest nodes it can reach, so the
  newest version that any responsible node holds is returned.

Replies come in pages (``_protocol``); every page is read from the nodes
whose records the result must hold whole (the quorum closest, or all for
``latest``), only the first page from the others met on the way.

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

#: ``rpc(node_to_ask, target, on_result, on_late)`` (``SwarmProtocol.request_find_*``)
RPC = Callable[[Node, Node, Callable[[tuple[bool, Any]], None], Callable[[], None]], None]


class LookupCrawl(SpiderCrawl):
    """Iterative look-up with ``alpha`` requests in flight (Kademlia paper, 2.3)."""

    def __init__(
        self, protocol: Any, node: Node, peers: list[Node], ksize: int, alpha: int
    ) -> None:
        super().__init__(protocol, node, [], ksize, alpha)
        self.nearest = NearestNodes(node, ksize)
        self.nearest.push(peers)
        #: ids of candidates that answered, and of those whose answer is late
        self.answered: set[bytes] = set()
        self.late: set[bytes] = set()

    async def _lookup(self, rpc: RPC) -> None:
        """Crawl until no candidate among the k closest that are not late is
        left unasked or in flight, or ``_satisfied()``.

        Driven by the replies themselves: ``rpc`` reports each result to a
        callback that handles it and sends the next request, so a request
        costs no asyncio task and the look-up wakes up once, when it is done
        (with all of trio-asyncio's loop rounds that saves). An exception
        raised while handling a reply is raised here. On cancellation, and
        after the look-up ends, replies still in flight are ignored.
        """
        finished: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        in_flight = 0

        def send() -> None:
            nonlocal in_flight
            if finished.done():
                return
            if self._satisfied():
                finished.set_result(None)
                return
            for peer in self.closest():
                if in_flight >= self.alpha:
                    break
                if peer.id in self.nearest.contacted:
                    continue
                self.nearest.mark_contacted(peer)
                in_flight += 1
                rpc(
                    peer,
                    self.node,
                    functools.partial(on_result, peer),
                    functools.partial(on_late, peer),
                )
            if not in_flight and not self._wait_for_late():
                finished.set_result(None)

        def on_late(peer: Node) -> None:
            nonlocal in_flight
            if finished.done():
                return
            in_flight -= 1
            self.late.add(peer.id)
            guarded(send)

        def on_result(peer: Node, result: tuple[bool, Any]) -> None:
            nonlocal in_flight
            if finished.done():
                return
            if peer.id in self.late:
                self.late.discard(peer.id)
            else:
                in_flight -= 1

            def handle() -> None:
                ok, answer = result
                if ok:
                    self.answered.add(peer.id)
                    self._answered(peer, answer)
                else:
                    self.nearest.remove([peer.id])
                send()

            guarded(handle)

        def guarded(step: Callable[[], None]) -> None:
            try:
                step()
            except Exception as e:  # raised in the awaiting look-up, not lost
                if not finished.done():
                    finished.set_exception(e)

        send()
        await finished

    def closest(self) -> list[Node]:
        """The k closest candidates that are not late, closest first."""
        return self.nearest.closest(self.ksize, skip=self.late)

    def _answered(self, peer: Node, answer: Any) -> None:
        raise NotImplementedError

    def _wait_for_late(self) -> bool:
        """True to keep waiting for late answers once nothing else is in flight."""
        return False

    def _satisfied(self) -> bool:
        """True to stop before every one of the k nearest was asked."""
        return False


class NodeCrawl(LookupCrawl):
    """Find the k closest live nodes to a key.

    With ``quorum`` (for a store), the look-up ends as soon as the ``quorum``
    closest candidates have answered, and ``find`` returns the k closest
    candidates, asked or not: the closest ones answered without naming anyone
    closer, so the look-up has converged where it matters (the nodes that every
    reader asks first), and a store to the others doubles as their liveness
    check. That halves the requests of a store in a swarm of a few hundred.
    """

    def __init__(
        self,
        protocol: Any,
        node: Node,
        peers: list[Node],
        ksize: int,
        alpha: int,
        *,
        quorum: int | None = None,
    ) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.quorum = quorum

    async def find(self) -> list[Node]:
        """The k closest nodes that answered (with ``quorum``: the k closest
        candidates not known to be dead, late or not), closest first."""
        await self._lookup(self.protocol.request_find_node)
        if self.quorum is not None:
            # late ones too: a slow node may be one of the very closest, and a
            # reader whose look-up finds it in time must find the record there
            return self.nearest.closest(self.ksize, skip=set())
        return [n for n in self.closest() if n.id in self.answered]

    def _answered(self, peer: Node, answer: Any) -> None:
        self.nearest.push([Node(*c) for c in answer if c[0] not in self.nearest])

    def _satisfied(self) -> bool:
        if self.quorum is None:
            return False
        return all(n.id in self.answered for n in self.closest()[: self.quorum])


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
        #: responder -> (node, what it returned by sub-key, whether it is incomplete)
        self.replies: dict[bytes, tuple[Node, dict[bytes | None, Record], bool]] = {}

    async def find(self) -> dict[bytes | None, Record]:
        """Crawl and return the merged records by sub-key (empty if none found)."""
        rpc = functools.partial(self.protocol.request_find_value, more_pages=self._wants_all)
        await self._lookup(rpc)
        return self.merged

    def _wants_all(self, peer: Node) -> bool:
        """Whether to read every page of ``peer``'s records: for ``latest``,
        always; otherwise only if it is among the ``quorum`` closest candidates
        when its first page arrives, whose records the result must hold whole.
        (A key that k nodes replicate would otherwise be read whole from
        every holder met on the way, several pages each.) A late answer counts
        like any other here: the look-up takes it back among the closest."""
        if self.latest:
            return True
        return any(n.id == peer.id for n in self._quorum(answering=peer.id))

    def _quorum(self, answering: bytes | None = None) -> list[Node]:
        """The ``quorum`` closest candidates whose records the result must hold
        whole: neither late (except ``answering``, whose late answer is coming
        in) nor known to have answered in part (its first page only, or a page
        lost). Counting a partial answer toward the quorum let a look-up end
        without any of the closest nodes' later pages, and the sub-keys sorted
        last went missing from the result: the closest nodes of a hot key are
        busy, so often late, and a late first page was all that was read."""
        skip = {peer for peer, (_, _, partial) in self.replies.items() if partial} | self.late
        if answering is not None:
            skip.discard(answering)
        return self.nearest.closest(self.quorum, skip=skip)

    def _answered(self, peer: Node, answer: Any) -> None:
        records, contacts, incomplete = answer
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
        self.replies[peer.id] = (peer, kept, incomplete)
        self.nearest.push([Node(*c) for c in contacts if c[0] not in self.nearest])

    def _wait_for_late(self) -> bool:
        # Found nothing yet, but slow nodes near the key may hold it: a loaded
        # node is not a dead one. Their answers (or failures) end the wait.
        return not self.merged and bool(self.late)

    def _satisfied(self) -> bool:
        if self.latest:
            return False
        return all(n.id in self.replies for n in self._quorum()) and not self._wait_for_late()

    def stale_responders(self, limit: int) -> list[tuple[Node, list[Record]]]:
        """Responders (closest first) that lack some of the merged records, with
        the records each lacks. Incomplete replies (a page failed to arrive) are
        skipped: they may hold more."""
        stale = []
        for node, kept, incomplete in self.replies.values():
            if incomplete:
                continue
            missing = [r for sk, r in self.merged.items() if kept.get(sk) != r]
            if missing:
                stale.append((node, missing))
        stale.sort(key=lambda item: item[0].distance_to(self.node))
        return stale[:limit]
