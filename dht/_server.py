"""``RecordServer``: kademlia's ``Server`` storing and finding records.

The asyncio half of a DHT node. It keeps kademlia's routing table, node
look-ups and bootstrap crawl, and replaces the value paths: stores go to the k
closest nodes (and here, if this node is one of them) as validated records;
look-ups merge the records of the responsible nodes (``RecordCrawl``) with the
local copy instead of returning the local copy alone. ``save_state`` and
``load_state`` (pickle) are disabled. Scheduling (refresh, expiry) is left to
the trio side (``_node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import OrderedDict
from typing import Any, NoReturn

from kademlia.network import Server
from kademlia.node import Node

from swarm._bans import BanList
from swarm._clock import WallClock
from swarm._errors import RecordRejectedError
from swarm._identity import Identity, PeerID

from ._aio import DatagramSocket
from ._crawl import NodeCrawl, RecordCrawl
from ._protocol import Address, SwarmProtocol
from ._ratelimit import MonotonicClock, RequestRateLimit
from ._records import Record, RecordLimits, merge, validate
from ._storage import RecordStorage, StorageQuota

log = logging.getLogger(__name__)

#: A store's node look-up ends once this many of the closest candidates answered
#: (``NodeCrawl``); the same number a plain read waits for (``RecordCrawl``).
_STORE_QUORUM = 3
#: How long the closest nodes a look-up found stand in for a store's look-up.
_NEAREST_MEMORY = 10.0
#: Most keys whose closest nodes are remembered.
_MAX_NEAREST_KEYS = 256


class RecordServer(Server):
    protocol_class = SwarmProtocol

    def __init__(
        self,
        identity: Identity,
        *,
        ksize: int,
        alpha: int,
        rpc_timeout: float,
        limits: RecordLimits,
        rpc_timeout_floor: float = 0.25,
        max_records: int,
        quota: StorageQuota,
        rate_limit: RequestRateLimit,
        clock: WallClock,
        rate_clock: MonotonicClock,
        proof_key: bytes | None = None,
        bans: BanList | None = None,
        client_mode: bool = False,
    ) -> None:
        storage = RecordStorage(clock, limits, max_records, quota)
        super().__init__(ksize=ksize, alpha=alpha, node_id=identity.peer_id, storage=storage)
        self.storage: RecordStorage = storage
        self.protocol: SwarmProtocol | None = None
        self.socket: DatagramSocket | None = None
        self._identity = identity
        self._limits = limits
        self._rpc_timeout = rpc_timeout
        self._rpc_timeout_floor = rpc_timeout_floor
        self._clock = clock
        self._proof_key = proof_key
        self._bans = bans
        self._rate_limit = rate_limit
        self._rate_clock = rate_clock
        self.client_mode = client_mode
        #: key id -> (when, the closest nodes a look-up of it found), oldest first
        self._nearest: OrderedDict[bytes, tuple[float, list[Node]]] = OrderedDict()

    def _create_protocol(self) -> SwarmProtocol:
        return SwarmProtocol(
            self.node,
            self.storage,
            self.ksize,
            identity=self._identity,
            limits=self._limits,
            rpc_timeout=self._rpc_timeout,
            rpc_timeout_floor=self._rpc_timeout_floor,
            clock=self._clock,
            proof_key=self._proof_key,
            bans=self._bans,
            rate_limit=self._rate_limit,
            rate_clock=self._rate_clock,
            client_mode=self.client_mode,
        )

    @property
    def proto(self) -> SwarmProtocol:
        if self.protocol is None:
            raise RuntimeError("the DHT server is not listening")
        return self.protocol

    async def listen(self, port: int, interface: str = "0.0.0.0") -> int:
        """Bind the UDP socket; returns the bound port (useful with port 0).

        Nothing is received until the trio side runs
        ``self.socket.serve_datagrams(self.proto)`` (``_node`` does). Raises
        ``OSError`` if the address cannot be bound.
        """
        self.socket = DatagramSocket.bind(interface, port)
        self.transport = self.socket
        self.protocol = self._create_protocol()
        self.protocol.connection_made(self.socket)
        return self.socket.port

    def stop(self) -> None:
        if self.protocol is not None:
            self.protocol.close()
        super().stop()

    async def ping_initial(self, addrs: list[Address]) -> list[Node]:
        """Ping every address; returns the nodes that answered (maybe none)."""
        answered = await asyncio.gather(*(self.proto.ping_address(a) for a in addrs))
        return [Node(pid, a[0], a[1]) for pid, a in zip(answered, addrs, strict=True) if pid]

    async def crawl_self(self, nodes: list[Node]) -> None:
        """Look up our own id through ``nodes``, filling the routing table."""
        await NodeCrawl(self.proto, self.node, nodes, self.ksize, self.alpha).find()

    async def _closest_nodes(self, dkey: bytes) -> list[Node]:
        """The k closest candidates to ``dkey`` once the closest have answered
        (``NodeCrawl`` with a quorum); some may be dead.

        A look-up of the same key in the last ``_NEAREST_MEMORY`` seconds (a
        read before a write, as progress and matchmaking do) is used instead:
        its closest nodes answered moments ago, and a store to them checks them
        again. That saves the store its look-up, about half its requests."""
        now = time.monotonic()
        remembered = self._nearest.get(dkey)
        if remembered is not None and now - remembered[0] < _NEAREST_MEMORY:
            return remembered[1]
        target = Node(dkey)
        nearest = self.proto.router.find_neighbors(target)
        if not nearest:
            return []
        spider = NodeCrawl(
            self.proto, target, nearest, self.ksize, self.alpha, quorum=_STORE_QUORUM
        )
        found: list[Node] = await spider.find()
        self._remember_nearest(dkey, found)
        return found

    def _remember_nearest(self, dkey: bytes, nodes: list[Node]) -> None:
        if not nodes:
            return
        self._nearest[dkey] = (time.monotonic(), nodes)
        self._nearest.move_to_end(dkey)
        while len(self._nearest) > _MAX_NEAREST_KEYS:
            self._nearest.popitem(last=False)

    async def store_record(self, record: Record, replicas: int | None = None) -> int:
        """Store ``record`` on the k closest nodes (the ``replicas`` closest of
        them when given); returns how many kept it.

        This node counts when it is among them (or knows fewer nodes), unless
        it is in client mode: nobody asks a client for records.
        Raises ``RecordRejectedError`` if the record is invalid here:
        then nothing is sent.
        """
        dkey = record.key_id
        count = self.ksize if replicas is None else min(replicas, self.ksize)
        nodes = (await self._closest_nodes(dkey))[:count]
        target = Node(dkey)
        kept = 0
        if not self.client_mode and (
            len(nodes) < count
            or self.node.distance_to(target) < max(n.distance_to(target) for n in nodes)
        ):
            kept += self.storage.store(record)
        else:
            validate(record, self._clock(), self._limits)
        kept += await self._store_on(nodes, record)
        return kept

    async def _store_on(self, nodes: list[Node], record: Record) -> int:
        """Send ``record`` to every node in ``nodes``; returns how many kept it.

        Returns once every node has answered or failed, or, as soon as one
        kept it, once the others have answered or are late (``RoundTrips``):
        a dead node then costs a few round trips, not an RPC timeout. A late
        answer that comes before the return is counted. On cancellation,
        answers are ignored.
        """
        if not nodes:
            return 0
        finished: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        unanswered = {n.id for n in nodes}
        on_time = set(unanswered)
        kept = 0

        def check() -> None:
            if finished.done():
                return
            if not unanswered or (kept and not on_time):
                finished.set_result(None)

        def on_late(node_id: bytes) -> None:
            on_time.discard(node_id)
            check()

        def on_result(node_id: bytes, result: tuple[bool, Any]) -> None:
            nonlocal kept
            ok, stored = result
            kept += bool(ok and stored)
            unanswered.discard(node_id)
            on_time.discard(node_id)
            check()

        for node in nodes:
            self.proto.request_store(
                node,
                record,
                functools.partial(on_result, node.id),
                functools.partial(on_late, node.id),
            )
        await finished
        return kept

    async def find_records(
        self, dkey: bytes, latest: bool
    ) -> tuple[list[Record], RecordCrawl | None]:
        """Merge the local records of ``dkey`` with those of the responsible nodes.

        Returns the merged records and the crawl (for write-back), or None when no
        other node is known.
        """
        merged: dict[bytes | None, Record] = {}
        now = self._clock()
        for record in self.storage.records(dkey):
            try:
                validate(record, now, self._limits)
            except RecordRejectedError:
                continue  # never let a bad local record shadow a good remote one
            merge(merged, record)
        target = Node(dkey)
        nearest = self.proto.router.find_neighbors(target)
        if not nearest:
            return list(merged.values()), None
        crawl = RecordCrawl(
            self.proto,
            target,
            nearest,
            self.ksize,
            self.alpha,
            latest=latest,
            limits=self._limits,
            clock=self._clock,
        )
        for record in (await crawl.find()).values():
            merge(merged, record)
        self._remember_nearest(dkey, crawl.nearest.closest(self.ksize, skip=set()))
        return list(merged.values()), crawl

    async def write_back(self, crawl: RecordCrawl, records: list[Record], limit: int) -> None:
        """Send the freshest records to up to ``limit`` responders that lacked them."""
        by_subkey = {r.subkey: r for r in records}
        crawl.merged = by_subkey
        calls = [
            self.proto.call_store(node, record)
            for node, missing in crawl.stale_responders(limit)
            for record in missing
        ]
        await asyncio.gather(*calls)

    async def refresh(self, stale_after: float) -> None:
        """Look up ids in buckets idle for ``stale_after`` seconds, and re-store
        records not written for as long, so replicas follow routing changes."""
        lonely = [
            b for b in self.proto.router.buckets if b.last_updated < time.monotonic() - stale_after
        ]
        lookups = []
        for bucket in lonely:
            rid = _random_id_in(bucket.range)
            target = Node(rid)
            nearest = self.proto.router.find_neighbors(target, self.alpha)
            lookups.append(
                NodeCrawl(self.proto, target, nearest, self.ksize, self.alpha).find()
            )
        await asyncio.gather(*lookups)
        for _dkey, records in self.storage.iter_older_than(stale_after):
            for record in records:
                with contextlib.suppress(RecordRejectedError):  # expired meanwhile
                    await self.store_record(record)

    def routing_table_size(self) -> int:
        if self.protocol is None:
            return 0
        return sum(len(b) for b in self.protocol.router.buckets)

    def contacts(self) -> list[tuple[PeerID, str, int]]:
        if self.protocol is None:
            return []
        return [
            (PeerID(n.id), n.ip, n.port)
            for b in self.protocol.router.buckets
            for n in b.get_nodes()
        ]

    # kademlia's pickle-based persistence must never run.
    def save_state(self, *args: Any) -> NoReturn:
        raise NotImplementedError("pickle-based state files are disabled")

    def save_state_regularly(self, *args: Any) -> NoReturn:
        raise NotImplementedError("pickle-based state files are disabled")

    @classmethod
    async def load_state(cls, *args: Any) -> NoReturn:
        raise NotImplementedError("pickle-based state files are disabled")


def _random_id_in(bounds: tuple[int, int]) -> bytes:
    value = random.randint(bounds[0], min(bounds[1], 2**160 - 1))
    return value.to_bytes(20, "big")
