"""``SwarmProtocol``: kademlia's protocol, speaking signed datagrams and records.

It subclasses ``kademlia.protocol.KademliaProtocol`` so that kademlia's routing
table and crawlers work unchanged, and replaces what kademlia gets wrong for us:

- the wire: rpcudp's unsigned umsgpack datagrams become authenticated
  envelopes (``_messages``): signed, or MAC'd under a key shared with a peer
  once each holds the other's signed offer (``_sessions``; signing and
  verifying every datagram took more than half a busy node's CPU); a
  datagram that does not verify is dropped, never answered;
- requests are answered synchronously in ``datagram_received`` (every handler
  is a dictionary look-up), so a request costs no asyncio task;
- ``rpc_store`` validates before it stores, ``rpc_find_value`` returns the
  records of a key and the closest nodes together (a crawl can merge the replies
  of several nodes), a page at a time: no datagram exceeds 1,400 bytes
  (``_messages``), a reply says whether more records follow, and
  ``request_find_value`` fetches every page before it reports;
- how long to wait for a reply is learned from the replies (``RoundTrips``),
  and a look-up is told when a reply is late, so it can ask another node;
- every source UDP address and every proven node id has its own request
  budget (``RequestRateLimit``, a token bucket each): a datagram over budget is
  dropped before its signature is checked, so a flood from one source costs
  little and leaves the other sources' budgets untouched; the reply bytes sent
  to one address have a budget too, so a forged source address cannot turn
  the node into an amplifier;
- stored records are charged to the node id and host that sent them
  (``StorageQuota`` in ``_storage``);
- a node that sends us a request is not trusted into the routing table on its
  word: it is pinged back, and added when its signed answer arrives;
- a node in client mode answers no requests and flags its own (the optional
  third element of a request body), so nobody pings it back or adds it to a
  routing table: short-lived processes (``swarm status``) and peers behind NAT
  leave no dead contacts behind; except towards the addresses it punched a
  hole to (``punch``: a peer behind another NAT that pinged it at the same
  moment), which it answers and is kept as a contact by;
- ``welcome_if_new`` pushes stored records, which passed validation, as records;
- in a private swarm every datagram proves the swarm key (``_messages``), and
  datagrams that do not are dropped without a reply;
- datagrams from banned node ids or addresses (``swarm._bans``) are dropped; a
  node that proved its id and then sent a malformed request or a forged record
  is banned.

All methods run on the asyncio loop that ``trio_asyncio`` provides (see ``_aio``),
except ``datagram_received``, which the trio task reading the socket calls
(``_aio.DatagramSocket``); there too ``asyncio.get_event_loop()`` is that loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import socket
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from prometheus_client import Counter, Gauge

from swarm._bans import BanList
from swarm._clock import WallClock
from swarm._counters import count_of, gauge_value, new_counter
from swarm._errors import ProtocolError, RecordRejectedError, RejectReason
from swarm._identity import PEER_ID_SIZE, Identity, PeerID
from swarm._wire import expect_bytes, expect_int, expect_list, expect_str, pack

from . import _messages as messages
from ._ratelimit import MonotonicClock, RateLimiter, RequestRateLimit
from ._records import Record, RecordLimits
from ._routing import SwarmRoutingTable
from ._rtt import RoundTrips
from ._sessions import SessionKeys
from ._storage import RecordStorage, Source

log = logging.getLogger(__name__)

#: Most pages of one key's records read from one node: a node holds at most
#: ``max_subkeys_per_key`` (1,024 by default) records of a key, at least one a page.
_MAX_PAGES = 2048
#: Most contacts we accept in one find_node/find_value reply.
_MAX_NODES_PER_REPLY = 64
#: The flag a client-mode node appends to its requests' ``[method, args]``.
CLIENT_FLAG = 1
#: Most concurrent ping-backs of unknown request senders.
_MAX_PENDING_PINGS = 64
#: How long a node that failed to answer is left out of look-ups when other
#: nodes still list it. Without this, every look-up in a swarm that just lost
#: nodes waits a full RPC timeout on them, again and again.
_FAILURE_MEMORY = 30.0
#: A contact that misses this many requests in a row (the last one a ping sent
#: to confirm) is removed from the routing table and left out of look-ups.
#: kademlia removes it at the first miss: on a link that loses 10% of its
#: packets a request and its reply are lost together one time in five, and a
#: small swarm shed its live members (they came back only after a ping-back,
#: at most once per ``_CONTACT_MEMORY``). A dead node costs one more ping.
_MISSES_TO_EVICT = 2
#: How long a sender pinged back is not pinged back again, and a newcomer sent
#: our records is not sent them again (``_ping_back_if_new``, ``welcome_if_new``).
_CONTACT_MEMORY = 60.0
#: Seconds between the pings of a punch (``SwarmProtocol.punch``).
_PUNCH_INTERVAL = 0.25
#: Most contacts remembered for that.
_MAX_REMEMBERED_CONTACTS = 4096
#: Shortest wait before a look-up asks another node in place of a silent one.
_HEDGE_FLOOR = 0.01
#: Shortest wait before an unanswered request is sent again (``RoundTrips.resend_after``).
_RESEND_FLOOR = 0.02
#: Most times a request is sent again before its deadline; the waits between
#: sends double. On a path that loses a tenth of the datagrams each way, a
#: request and its reply are lost together one time in five; with three more
#: sends one request in 700 fails, where one in five failed and cost its
#: caller the whole timeout (and its contact a confirming ping).
_MAX_RESENDS = 3

Address = tuple[str, int]
Result = tuple[bool, Any]


@dataclass(slots=True)
class _Pending:
    """An outstanding request: its answer must come from ``addr`` (and from
    node ``expected`` when given) before ``deadline`` (loop time). ``on_late``
    (if any) is called once at ``late_at`` if no answer came by then (and is
    None from then on). ``body`` is sent again at ``resend_at`` (math.inf: not
    again), each time ``resend_interval`` later than the last, doubled, and
    each time under a message id of its own: ``copies`` maps each to when it
    left, so an answer times the very copy it answers (no ambiguity for
    Karn's rule to exclude). The first id is the request's key in
    ``SwarmProtocol._deadlines``."""

    on_reply: Callable[[Result], None]
    addr: Address
    expected: bytes | None
    late_at: float
    deadline: float
    on_late: Callable[[], None] | None
    body: Any
    copies: dict[bytes, float]
    resend_at: float
    resend_interval: float
    #: the copies that were signed (they carried our offer), not MAC'd
    signed: set[bytes] = field(default_factory=set)

    @property
    def sends(self) -> int:
        return len(self.copies)

    def next_event(self) -> float:
        """When something is due next: lateness, a resend or the deadline."""
        late_at = self.late_at if self.on_late is not None else math.inf
        return min(late_at, self.resend_at, self.deadline)

    def schedule_resend(self, now: float) -> None:
        """Set ``resend_at`` after a send at ``now``: one ``resend_interval``
        on, unless that is past the deadline or the sends are used up."""
        at = now + self.resend_interval
        self.resend_at = at if self.sends <= _MAX_RESENDS and at < self.deadline else math.inf


def decode_nodes(obj: Any) -> list[tuple[bytes, str, int]]:
    """Validate a list of ``[node_id, ip, port]`` contacts from another node."""
    if not isinstance(obj, list) or len(obj) > _MAX_NODES_PER_REPLY:
        raise ProtocolError("contacts: expected a short list")
    nodes = []
    for item in obj:
        node_id, ip, port = expect_list(item, 3, "contact")
        node_id = expect_bytes(node_id, "contact id", size=PEER_ID_SIZE)
        ip = expect_str(ip, "contact ip", max_size=64)
        if not _is_ip(ip):
            raise ProtocolError(f"contact ip {ip!r} is not an IP address")
        port = expect_int(port, "contact port", lo=1, hi=65535)
        nodes.append((node_id, ip, port))
    return nodes


def decode_find_value_reply(
    obj: Any, limits: RecordLimits
) -> tuple[list[Record], list[tuple[bytes, str, int]], bool]:
    """Decode ``[records, contacts, more]``; records are decoded, not validated.

    Raises ``ProtocolError`` (and nothing else) if it is malformed.
    """
    records_wire, nodes, more = expect_list(obj, 3, "find_value reply")
    if not isinstance(records_wire, list):
        raise ProtocolError("find_value reply: records must be a list")
    if not isinstance(more, bool):
        raise ProtocolError("find_value reply: 'more' must be a bool")
    records = [Record.from_wire(w, limits) for w in records_wire]
    return records, decode_nodes(nodes), more


def page_key(record: Record) -> bytes:
    """Where a record comes in the pages of a find_value reply: by sub-key,
    the plain value (no sub-key) first. Sub-keys are never empty msgpack."""
    return record.subkey if record.subkey is not None else b""


def parse_request(body: Any) -> tuple[Any, Any, bool]:
    """Split a request body ``[method, args]`` or ``[method, args, CLIENT_FLAG]``
    into ``(method, args, from_client)``; raises ``ProtocolError`` otherwise."""
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise ProtocolError("request: expected [method, args] or [method, args, flag]")
    if len(body) == 3 and body[2] != CLIENT_FLAG:
        raise ProtocolError(f"request: unknown flag {body[2]!r}")
    return body[0], body[1], len(body) == 3


def _is_ping(body: Any) -> bool:
    return isinstance(body, list) and len(body) in (2, 3) and body[0] == "ping"


def _awaitable(start: Callable[..., None], *args: Any) -> asyncio.Future[Result]:
    """A future for the result that ``start(*args, on_result)`` reports."""
    future: asyncio.Future[Result] = asyncio.get_event_loop().create_future()

    def on_result(result: Result) -> None:
        if not future.done():  # the awaiting caller may have been cancelled
            future.set_result(result)

    start(*args, on_result)
    return future


def _is_ip(text: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, text)
        except (OSError, ValueError):
            continue
        return True
    return False


class DatagramCounters:
    """A DHT node's traffic figures, as ``prometheus_client`` objects
    (``swarm._counters``): the one copy, which a peer's metrics registry
    exposes and ``SwarmProtocol``'s integer properties read."""

    def __init__(self) -> None:
        self.failed_requests = new_counter(
            "swarm_dht_failed_requests", "DHT requests that got no answer in time"
        )
        self.sent_requests = new_counter("swarm_dht_sent_requests", "DHT requests sent")
        self.resent_requests = new_counter(
            "swarm_dht_resent_requests",
            "DHT requests sent again, unanswered after a few round trips",
        )
        self.sent_datagrams = new_counter(
            "swarm_dht_sent_datagrams", "DHT datagrams sent, requests and replies together"
        )
        self.sent_bytes = new_counter(
            "swarm_dht_sent_bytes", "DHT bytes sent, requests and replies together"
        )
        self.signed_datagrams = new_counter(
            "swarm_dht_signed_datagrams",
            "DHT datagrams sent with an Ed25519 signature (the others carry a pair's MAC)",
        )
        self.received_datagrams = new_counter(
            "swarm_dht_received_datagrams", "DHT datagrams received"
        )
        self.dropped_datagrams = new_counter(
            "swarm_dht_dropped_datagrams",
            "DHT datagrams dropped as malformed, unsigned or not a valid request",
        )
        self.ignored_requests = new_counter(
            "swarm_dht_ignored_requests", "DHT requests a client-mode node left unanswered"
        )
        self.rate_limited_datagrams = new_counter(
            "swarm_dht_rate_limited_datagrams",
            "DHT datagrams dropped because their source was over its request budget",
        )
        self.unsent_replies = new_counter(
            "swarm_dht_unsent_replies",
            "DHT replies not sent because their address was over its reply byte budget",
        )
        self.largest_datagram = Gauge(
            "swarm_dht_largest_datagram_bytes", "The largest DHT datagram sent", registry=None
        )

    @property
    def metrics(self) -> tuple[Counter | Gauge, ...]:
        """Every figure, for a metrics registry."""
        return (
            self.failed_requests,
            self.sent_requests,
            self.resent_requests,
            self.sent_datagrams,
            self.sent_bytes,
            self.signed_datagrams,
            self.received_datagrams,
            self.dropped_datagrams,
            self.ignored_requests,
            self.rate_limited_datagrams,
            self.unsent_replies,
            self.largest_datagram,
        )


class SwarmProtocol(KademliaProtocol):
    def __init__(
        self,
        source_node: Node,
        storage: RecordStorage,
        ksize: int,
        *,
        identity: Identity,
        limits: RecordLimits,
        rpc_timeout: float,
        clock: WallClock,
        rpc_timeout_floor: float = 0.25,
        rate_limit: RequestRateLimit,
        rate_clock: MonotonicClock,
        proof_key: bytes | None = None,
        bans: BanList | None = None,
        client_mode: bool = False,
    ) -> None:
        super().__init__(source_node, storage, ksize)
        # kademlia's table may leave contacts out of a neighbour list (``_routing``)
        self.router = SwarmRoutingTable(self, ksize, source_node)
        self.client_mode = client_mode
        #: a client that still answers pings: while peers check whether they
        #: can reach it (``swarm._reachability``)
        self.answers_pings = False
        #: addresses a client answers and flags no request to (``punch``)
        self.punched: set[Address] = set()
        self._proof_key = proof_key
        self.bans = bans
        self.storage: RecordStorage = storage
        self._identity = identity
        self._limits = limits
        #: measured round trips; the deadlines of requests follow from them
        self.round_trips = RoundTrips(
            cap=rpc_timeout,
            floor=rpc_timeout_floor,
            hedge_floor=min(rpc_timeout_floor, _HEDGE_FLOOR),
            resend_floor=min(rpc_timeout_floor, _RESEND_FLOOR),
        )
        self._clock = clock
        #: MAC keys shared with the peers that hold our offer (``_sessions``)
        self.sessions = SessionKeys(identity.public_key)
        #: msg_id of each copy sent -> its request: what to call with the
        #: answer, whom it must come from, and when it is late and when to give up
        self._outstanding: dict[bytes, _Pending] = {}
        #: (when, sequence, msg_id) of every pending request's next event
        #: (``_Pending.next_event``); entries of requests answered since are
        #: skipped when they come up
        self._deadlines: list[tuple[float, int, bytes]] = []
        self._sequence = 0
        #: this node's traffic figures (``DatagramCounters``), read through the
        #: properties below and registered as they are by a peer's metrics
        self.counters = DatagramCounters()
        #: the gauge's value, compared with every datagram sent: reading a
        #: ``prometheus_client`` gauge back collects it (3% of scale.py's CPU)
        self._largest_sent = 0
        #: the one timer that handles due deadlines (armed for the earliest)
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pinging: set[bytes] = set()
        #: (node id, ip, port) -> when it was last pinged back / sent our
        #: records as a newcomer (``welcome_if_new``), oldest first
        self._pinged_back: OrderedDict[tuple[bytes, str, int], float] = OrderedDict()
        self._welcomed: OrderedDict[tuple[bytes, str, int], float] = OrderedDict()
        #: (node id, ip, port) -> when it last failed to answer. By address too:
        #: a request replayed from elsewhere, whose ping-back fails, must not
        #: hide the real node at its real address.
        self._failed: dict[tuple[bytes, str, int], float] = {}
        #: contacts that missed their last request, with a confirming ping in
        #: flight (at most ``_MAX_PENDING_PINGS``): -> misses in a row
        self._missed: dict[tuple[bytes, str, int], int] = {}
        self._closed = False
        self._by_address = RateLimiter.for_requests(rate_limit, rate_clock)
        self._by_node = RateLimiter.for_requests(rate_limit, rate_clock)
        self._reply_bytes = RateLimiter.for_reply_bytes(rate_limit, rate_clock)
        self._handlers: dict[str, Callable[[Node, list[Any]], Any]] = {
            "ping": self._rpc_ping,
            "find_node": self._rpc_find_node,
            "find_value": self._rpc_find_value,
            "store": self._rpc_store,
        }

    # -- lifecycle -------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as an asyncio task owned by this protocol (cancelled by ``close``)."""
        if self._closed:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._deadlines = []
        # one entry per copy sent: each request once
        pending = list({id(p): p for p in self._outstanding.values()}.values())
        self._outstanding = {}
        for request in pending:
            request.on_reply((False, None))
        if self.transport is not None:
            self.transport.close()

    # -- receiving -------------------------------------------------------------

    def datagram_received(self, data: bytes, addr: Address) -> None:
        bans = self.bans
        self.counters.received_datagrams.inc()
        if bans is not None and bans.is_banned((addr[0], addr[1])):
            self.counters.dropped_datagrams.inc()
            return
        if not self._by_address.allow((addr[0], addr[1])):
            self.counters.rate_limited_datagrams.inc()
            return
        try:
            datagram = messages.decode(
                data, proof_key=self._proof_key, mac_keys=self.sessions.verifying_key
            )
        except ProtocolError as e:
            # No ban: the source address of an unverified datagram is unproven,
            # and banning it would let anyone get an honest node ignored.
            self.counters.dropped_datagrams.inc()
            log.debug("dropped datagram from %s: %s", addr, e)
            return
        if bans is not None and bans.is_banned(datagram.sender):
            self.counters.dropped_datagrams.inc()
            return
        if datagram.mac:
            self.sessions.confirm(datagram.sender)
        else:
            self.sessions.offered(datagram.sender, datagram.public_key, datagram.offer)
        if datagram.kind is messages.Kind.REQUEST:
            answers = addr in self.punched or (self.answers_pings and _is_ping(datagram.body))
            if self.client_mode and not answers:
                self.counters.ignored_requests.inc()
                return
            if not self._by_node.allow(bytes(datagram.sender)):
                self.counters.rate_limited_datagrams.inc()
                return
            self._answer(datagram, (addr[0], addr[1]))
        else:
            self._resolve(datagram, (addr[0], addr[1]))

    def _answer(self, datagram: messages.Datagram, addr: Address) -> None:
        sender = Node(datagram.sender, addr[0], addr[1])
        try:
            method, args, from_client = parse_request(datagram.body)
            handler = self._handlers.get(expect_str(method, "method", max_size=32))
            if handler is None or not isinstance(args, list):
                raise ProtocolError(f"unknown method {method!r}")
            response = handler(sender, args)
        except ProtocolError as e:
            self.counters.dropped_datagrams.inc()
            log.debug("malformed request from %s: %s", addr, e)
            self._offence(datagram.sender, f"malformed DHT request: {e}")
            return
        # a signed request's sender may not hold our offer: the answer carries it
        mac_key = self.sessions.mac_key(datagram.sender) if datagram.mac else None
        reply = messages.encode(
            self._identity,
            messages.Kind.RESPONSE,
            datagram.msg_id,
            response,
            proof_key=self._proof_key,
            offer=self.sessions.offer,
            mac_key=mac_key,
        )
        if mac_key is None:
            self.counters.signed_datagrams.inc()
        if self._reply_bytes.allow((addr[0], addr[1]), len(reply)):
            self._sendto(reply, addr)
        else:
            self.counters.unsent_replies.inc()
        if sender.id != self.source_node.id and not from_client:
            self._ping_back_if_new(sender)

    def _resolve(self, datagram: messages.Datagram, addr: Address) -> None:
        pending = self._outstanding.get(datagram.msg_id)
        if pending is None:
            return
        if addr != pending.addr or (
            pending.expected is not None and datagram.sender != pending.expected
        ):
            # someone else answered, or the address now belongs to another node
            return
        self._forget(pending)
        if datagram.msg_id in pending.signed:  # it verified our offer before it answered
            self.sessions.confirm(datagram.sender)
        sent_at = pending.copies[datagram.msg_id]
        self.round_trips.sample(addr, asyncio.get_event_loop().time() - sent_at)
        pending.on_reply((True, (datagram.sender, datagram.body)))

    # -- sending ---------------------------------------------------------------

    def _offence(self, sender: PeerID, reason: str) -> None:
        """``sender`` proved its id and broke the protocol: ban it locally."""
        if self.bans is not None and sender != self.source_node.id:
            period = self.bans.offend(sender, reason)
            log.info("banned DHT node %s for %.0f s: %s", sender.short(), period, reason)

    # -- traffic figures (``self.counters``), as integers ------------------------

    @property
    def failed_requests(self) -> int:
        """DHT requests that got no answer in time."""
        return count_of(self.counters.failed_requests)

    @property
    def sent_requests(self) -> int:
        """DHT requests sent."""
        return count_of(self.counters.sent_requests)

    @property
    def resent_requests(self) -> int:
        """DHT requests sent again, unanswered after a few round trips."""
        return count_of(self.counters.resent_requests)

    @property
    def sent_datagrams(self) -> int:
        """DHT datagrams sent, requests and replies together."""
        return count_of(self.counters.sent_datagrams)

    @property
    def sent_bytes(self) -> int:
        """DHT bytes sent, requests and replies together."""
        return count_of(self.counters.sent_bytes)

    @property
    def signed_datagrams(self) -> int:
        """DHT datagrams sent signed rather than MAC'd (``_sessions``)."""
        return count_of(self.counters.signed_datagrams)

    @property
    def received_datagrams(self) -> int:
        """DHT datagrams received."""
        return count_of(self.counters.received_datagrams)

    @property
    def dropped_datagrams(self) -> int:
        """DHT datagrams dropped as malformed, unsigned or not a valid request."""
        return count_of(self.counters.dropped_datagrams)

    @property
    def ignored_requests(self) -> int:
        """DHT requests a client-mode node left unanswered."""
        return count_of(self.counters.ignored_requests)

    @property
    def rate_limited_datagrams(self) -> int:
        """DHT datagrams dropped because their source was over its request budget."""
        return count_of(self.counters.rate_limited_datagrams)

    @property
    def unsent_replies(self) -> int:
        """DHT replies not sent because their address was over its reply byte budget."""
        return count_of(self.counters.unsent_replies)

    @property
    def largest_datagram(self) -> int:
        """The largest DHT datagram sent, in bytes."""
        return int(gauge_value(self.counters.largest_datagram))

    def _sendto(self, data: bytes, addr: Address) -> None:
        if self.transport is None or self._closed:
            return
        self.counters.sent_datagrams.inc()
        self.counters.sent_bytes.inc(len(data))
        if len(data) > self._largest_sent:
            self._largest_sent = len(data)
            self.counters.largest_datagram.set(len(data))
        self.transport.sendto(data, addr)

    def call(
        self, addr: Address, method: str, args: list[Any], expected: bytes | None = None
    ) -> asyncio.Future[Result]:
        """Send a request; the future resolves to ``(True, (sender, body))`` or
        ``(False, None)`` after the request's timeout (``RoundTrips.timeout``)
        without a verified answer from ``addr`` (and from node ``expected`` when
        given)."""
        return _awaitable(self.request, addr, method, args, expected)

    def request(
        self,
        addr: Address,
        method: str,
        args: list[Any],
        expected: bytes | None,
        on_reply: Callable[[Result], None],
        on_late: Callable[[], None] | None = None,
    ) -> None:
        """Send a request and call ``on_reply`` once with what ``call``'s future
        would hold: from the datagram handler when the answer arrives, from the
        expiry timer after the timeout learned for ``addr``, from ``close``, or
        soon (never from within this call) if the protocol is closed already.
        ``on_late``, if given, is called once (before any failure) when the
        answer has not come within ``RoundTrips.hedge_after``, so a look-up can
        ask another node meanwhile.

        Raises ``DatagramTooLargeError`` (nothing sent) if the request does not
        fit in one datagram. Costs no asyncio task and no timer of its own: one
        timer per protocol handles every deadline (``_expire_due``), and each
        asyncio callback is a round of trio-asyncio's loop.
        """
        loop = asyncio.get_event_loop()
        if self._closed:
            loop.call_soon(on_reply, (False, None))
            return
        client = self.client_mode and addr not in self.punched
        body = [method, args, CLIENT_FLAG] if client else [method, args]
        mac_key = self.sessions.mac_key(expected)
        msg_id = messages.new_msg_id()
        datagram = messages.encode(
            self._identity,
            messages.Kind.REQUEST,
            msg_id,
            body,
            proof_key=self._proof_key,
            offer=self.sessions.offer,
            mac_key=mac_key,
        )
        now = loop.time()
        timeout = self.round_trips.timeout(addr)
        late = self.round_trips.hedge_after(addr) if on_late is not None else timeout
        resend = self.round_trips.resend_after(addr)
        pending = _Pending(
            on_reply, addr, expected, now + late, now + timeout, on_late,
            body, {msg_id: now}, math.inf, resend,
        )  # fmt: skip
        pending.schedule_resend(now)
        if mac_key is None:
            pending.signed.add(msg_id)
        self._outstanding[msg_id] = pending
        self._push_deadline(pending.next_event(), msg_id)
        self.counters.sent_requests.inc()
        if mac_key is None:
            self.counters.signed_datagrams.inc()
        self._sendto(datagram, addr)

    def _push_deadline(self, when: float, msg_id: bytes) -> None:
        self._sequence += 1
        heapq.heappush(self._deadlines, (when, self._sequence, msg_id))
        if when < self._expiry_at:
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry = asyncio.get_event_loop().call_at(when, self._expire_due)
            self._expiry_at = when

    def _expire_due(self) -> None:
        """Tell late requests' owners, send unanswered requests again, fail
        the requests past their deadline, and re-arm the timer for the
        earliest event left."""
        self._expiry = None
        self._expiry_at = math.inf
        loop = asyncio.get_event_loop()
        now = loop.time()
        due: list[bytes] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            due.append(heapq.heappop(self._deadlines)[2])
        for msg_id in due:
            pending = self._outstanding.get(msg_id)
            if pending is None:
                continue  # answered meanwhile
            on_late = pending.on_late if now >= pending.late_at else None
            if on_late is not None:
                pending.on_late = None
            if now >= pending.deadline:
                self._forget(pending)
            else:
                if now >= pending.resend_at:
                    self._resend(pending, now)
                self._push_deadline(pending.next_event(), msg_id)
            if on_late is not None:
                on_late()
            if now >= pending.deadline:
                self.counters.failed_requests.inc()
                if pending.expected is not None:
                    # it may have lost our session and dropped a MAC'd request:
                    # the next one is signed, with our offer
                    self.sessions.forget(pending.expected)
                pending.on_reply((False, None))
        # The callbacks above may have armed the timer for a later deadline
        # than the earliest one left.
        if self._deadlines and not self._closed and self._deadlines[0][0] < self._expiry_at:
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry_at = self._deadlines[0][0]
            self._expiry = loop.call_at(self._expiry_at, self._expire_due)

    def _resend(self, pending: _Pending, now: float) -> None:
        """Send an unanswered request again, under a fresh message id: a lost
        request or reply costs its caller ``RoundTrips.resend_after`` (a few
        round trips) rather than the whole timeout. Every request is
        idempotent (a ping, a look-up, a store of records merged by
        expiration), so a node that got two copies answers both, and the
        first answer resolves the request. A copy is signed, with our offer:
        the receiver may have dropped a MAC'd one because it lost our session
        (it restarted), and then a resend sets that right at once."""
        msg_id = messages.new_msg_id()
        datagram = messages.encode(
            self._identity,
            messages.Kind.REQUEST,
            msg_id,
            pending.body,
            proof_key=self._proof_key,
            offer=self.sessions.offer,
        )
        pending.copies[msg_id] = now
        pending.signed.add(msg_id)
        self.counters.signed_datagrams.inc()
        self._outstanding[msg_id] = pending
        pending.resend_interval *= 2
        pending.schedule_resend(now)
        self.counters.resent_requests.inc()
        self._sendto(datagram, pending.addr)

    def _forget(self, pending: _Pending) -> None:
        """Stop expecting an answer to any copy of ``pending``."""
        for msg_id in pending.copies:
            self._outstanding.pop(msg_id, None)

    # -- handlers (remote side) ------------------------------------------------

    def _rpc_ping(self, sender: Node, args: list[Any]) -> Any:
        return None

    def _rpc_find_node(self, sender: Node, args: list[Any]) -> Any:
        (target,) = expect_list(args, 1, "find_node args")
        target = expect_bytes(target, "find_node target", size=PEER_ID_SIZE)
        return self._contacts_near(sender, target, messages.MAX_BODY_SIZE)

    def _contacts_near(self, sender: Node, target: bytes, budget: int) -> list[list[Any]]:
        """The k contacts closest to ``target`` (not ``sender``), closest first,
        as many as encode to ``budget`` bytes: all 20 of IPv4 contacts fit in a
        datagram, about 17 of IPv6 ones; the farthest are the ones a look-up
        needs least, and it asks the closest for more anyway."""
        contacts: list[list[Any]] = []
        used = 3  # the list header
        for n in self.router.find_neighbors(Node(target), exclude=sender):
            contact = [n.id, n.ip, n.port]
            size = len(pack(contact))
            if used + size > budget:
                break
            used += size
            contacts.append(contact)
        return contacts

    def _rpc_find_value(self, sender: Node, args: list[Any]) -> Any:
        """One page of a key's records: ``[records, contacts, more]``.

        ``[key]`` asks for the first page, which carries the closest contacts
        too; ``[key, None]`` for all records from the first, without contacts;
        ``[key, after]`` for those whose sort key (``page_key``) follows
        ``after``. Records come in sort key order, as many as fit in one
        datagram; ``more`` says whether others follow (the reader asks for them
        with the last sort key it got). Nothing is ever left out unannounced.
        """
        if not isinstance(args, list) or len(args) not in (1, 2):
            raise ProtocolError("find_value args: expected [key] or [key, after]")
        dkey = expect_bytes(args[0], "find_value key", size=PEER_ID_SIZE)
        after: bytes | None = None
        if len(args) == 2 and args[1] is not None:
            limit = self._limits.max_subkey_size
            after = expect_bytes(args[1], "find_value cursor", max_size=limit)
        # the reply's list header, the records' list header, the ``more`` flag
        budget = messages.MAX_BODY_SIZE - 1 - 3 - 1
        nodes: list[list[Any]] = []
        if len(args) == 1:
            nodes = self._contacts_near(sender, dkey, budget // 2)
        budget -= len(pack(nodes))
        ordered = self.storage.page(dkey, after)
        records: list[Any] = []
        for record in ordered:
            wire = record.to_wire()
            size = len(pack(wire))
            if size > budget:
                break
            budget -= size
            records.append(wire)
        return [records, nodes, len(records) < len(ordered)]

    def _rpc_store(self, sender: Node, args: list[Any]) -> Any:
        (wire,) = expect_list(args, 1, "store args")
        try:
            record = Record.from_wire(wire, self._limits)
        except ProtocolError as e:
            # the sender proved its identity; tell it what was wrong instead of
            # letting it time out
            log.debug("malformed record from %s: %s", sender, e)
            return [False, RejectReason.MALFORMED.name]
        try:
            kept = self.storage.store(record, Source(bytes(sender.id), sender.ip))
        except RecordRejectedError as e:
            log.debug("refused record from %s: %s", sender, e)
            if e.reason is RejectReason.FORGED:
                self._offence(PeerID(sender.id), f"forged DHT record: {e}")
            return [False, e.reason.name]
        return [kept, None]

    # -- calls (local side), in the shape kademlia's crawlers expect ------------

    async def call_ping(self, node_to_ask: Node) -> Result:
        ok, _ = await self.call((node_to_ask.ip, node_to_ask.port), "ping", [], node_to_ask.id)
        return self.handle_call_response((ok, None), node_to_ask)

    async def ping_address(self, addr: Address) -> PeerID | None:
        """Ping an address whose node id we do not know yet (bootstrap)."""
        ok, answer = await self.call(addr, "ping", [])
        if not ok:
            return None
        sender: PeerID = answer[0]
        self.handle_call_response((True, None), Node(sender, addr[0], addr[1]))
        return sender

    async def ping_only(self, addr: Address) -> PeerID | None:
        """Ping ``addr``; the id of the node that answered, None without an
        answer. Unlike ``ping_address`` it keeps nobody as a contact: a
        reachability dial-back may get through a NAT mapping only this node
        can use."""
        ok, answer = await self.call(addr, "ping", [])
        return answer[0] if ok else None

    async def punch(self, addr: Address, node_id: bytes, timeout: float) -> bool:
        """Open a path through NATs to node ``node_id`` at ``addr`` (its NAT's
        address and port), which pings this node at the same time: ping it
        until it answers or ``timeout`` seconds pass. Each side's first pings
        open its own NAT for the other's (a port-preserving NAT's filter
        admits replies from the address it sent to), so a later one gets
        through. On an answer it is a contact, and a client answers it and
        flags no requests to it from then on (True); else nothing changes
        (False: e.g. a symmetric NAT, which maps each destination to another
        port)."""
        loop = asyncio.get_event_loop()
        deadline = loop.time() + timeout
        known = addr in self.punched
        self.punched.add(addr)  # its pings are answered while this runs
        answered: asyncio.Future[None] = loop.create_future()

        def on_reply(result: Result) -> None:
            if result[0] and not answered.done():
                answered.set_result(None)

        # a ping every _PUNCH_INTERVAL, not one per request timeout: the first
        # ones are dropped by the other NAT until the other side's have left
        while not self._closed and loop.time() < deadline:
            self.request(addr, "ping", [], node_id, on_reply)
            try:
                await asyncio.wait_for(asyncio.shield(answered), _PUNCH_INTERVAL)
            except TimeoutError:
                continue
            self.handle_call_response((True, None), Node(node_id, addr[0], addr[1]))
            return True
        if not known:
            self.punched.discard(addr)
        return False

    async def call_find_node(self, node_to_ask: Node, node_to_find: Node) -> Result:
        return await _awaitable(self.request_find_node, node_to_ask, node_to_find)

    async def call_find_value(self, node_to_ask: Node, node_to_find: Node) -> Result:
        """``(True, (records, contacts, incomplete))``; records are decoded, not validated."""
        return await _awaitable(self.request_find_value, node_to_ask, node_to_find)

    def request_find_node(
        self,
        node_to_ask: Node,
        node_to_find: Node,
        on_result: Callable[[Result], None],
        on_late: Callable[[], None] | None = None,
    ) -> None:
        """``call_find_node`` for look-ups: ``on_result`` gets its result, and
        ``on_late`` is called if it is late (see ``request``)."""

        def decode(body: Any) -> Any:
            return self._live(decode_nodes(body))

        self._ask(node_to_ask, "find_node", node_to_find, decode, on_result, on_late)

    def request_find_value(
        self,
        node_to_ask: Node,
        node_to_find: Node,
        on_result: Callable[[Result], None],
        on_late: Callable[[], None] | None = None,
        *,
        more_pages: Callable[[Node], bool] | None = None,
    ) -> None:
        """``call_find_value`` for look-ups: ``on_result`` gets its result, and
        ``on_late`` is called if the first page is late (see ``request``).

        Fetches every page of the node's records (``_rpc_find_value``) before
        it reports ``(True, (records, contacts, incomplete))``, unless
        ``more_pages(node_to_ask)``, asked when the first page arrives, says
        not to (a look-up that needs only the closest nodes' records whole).
        ``incomplete`` is True when pages were left unread, a later page failed
        to arrive or the node broke the paging rules, so the caller knows it
        holds part of the node's records. A first page that fails is
        ``(False, None)``.
        """
        addr = (node_to_ask.ip, node_to_ask.port)
        records: list[Record] = []
        contacts: list[tuple[bytes, str, int]] = []
        pages = 0

        def ask(cursor: list[Any]) -> None:
            args = [node_to_find.id, *cursor]
            late = on_late if not cursor else None
            self.request(addr, "find_value", args, node_to_ask.id, on_page, late)

        def on_page(reply: Result) -> None:
            nonlocal pages, contacts
            page: tuple[list[Record], list[tuple[bytes, str, int]], bool] | None = None
            if reply[0]:
                try:
                    page = decode_find_value_reply(reply[1][1], self._limits)
                except ProtocolError as e:
                    log.debug("bad find_value reply from %s: %s", node_to_ask, e)
            if pages == 0:
                if page is None:
                    on_result(self.handle_call_response((False, None), node_to_ask))
                    return
                self.handle_call_response((True, None), node_to_ask)
                contacts = self._live(page[1])
            elif page is None:
                on_result((True, (records, contacts, True)))
                return
            pages += 1
            got, _, more = page
            keys = [page_key(r) for r in got]
            previous = page_key(records[-1]) if records else None
            ordered = all(a < b for a, b in itertools.pairwise(keys))
            if not ordered or (previous is not None and keys and keys[0] <= previous):
                # not in page order: a broken or lying node; keep what came in
                # order and say that more may remain
                on_result((True, (records, contacts, True)))
                return
            records.extend(got)
            if pages == 1 and more and more_pages is not None and not more_pages(node_to_ask):
                on_result((True, (records, contacts, True)))
                return
            if more and pages < _MAX_PAGES and (got or pages == 1):
                ask([keys[-1] if keys else None])
                return
            on_result((True, (records, contacts, more)))

        ask([])

    def _ask(
        self,
        node_to_ask: Node,
        method: str,
        node_to_find: Node,
        decode: Callable[[Any], Any],
        on_result: Callable[[Result], None],
        on_late: Callable[[], None] | None = None,
    ) -> None:
        """Send ``method`` about ``node_to_find``; after ``handle_call_response``,
        ``on_result`` gets ``(True, decode(answer))``, or ``(False, None)`` if
        there was no answer or ``decode`` raised ``ProtocolError``."""

        def on_reply(reply: Result) -> None:
            result: Result = (False, None)
            if reply[0]:
                try:
                    result = (True, decode(reply[1][1]))
                except ProtocolError as e:
                    log.debug("bad %s reply from %s: %s", method, node_to_ask, e)
            on_result(self.handle_call_response(result, node_to_ask))

        addr = (node_to_ask.ip, node_to_ask.port)
        self.request(addr, method, [node_to_find.id], node_to_ask.id, on_reply, on_late)

    async def call_store(self, node_to_ask: Node, key: Any, value: Any = None) -> Result:
        """Store a ``Record`` (passed as ``key``; kademlia's signature is kept for
        its own callers) on ``node_to_ask``. ``(True, kept)`` if it answered."""
        record = key if isinstance(key, Record) else value
        if not isinstance(record, Record):
            raise TypeError("SwarmProtocol.call_store takes a Record")
        return await _awaitable(self.request_store, node_to_ask, record)

    def request_store(
        self,
        node_to_ask: Node,
        record: Record,
        on_result: Callable[[Result], None],
        on_late: Callable[[], None] | None = None,
    ) -> None:
        """``call_store`` by callback: ``on_result`` gets ``(True, kept)`` or
        ``(False, None)``, and ``on_late`` is called if it is late (see ``request``)."""

        def on_reply(reply: Result) -> None:
            result: Result = (False, None)
            if reply[0]:
                answer = reply[1][1]
                kept = isinstance(answer, list) and len(answer) == 2 and answer[0] is True
                result = (True, kept)
            on_result(self.handle_call_response(result, node_to_ask))

        addr = (node_to_ask.ip, node_to_ask.port)
        self.request(addr, "store", [record.to_wire()], node_to_ask.id, on_reply, on_late)

    # -- routing table maintenance ---------------------------------------------

    def handle_call_response(self, result: Result, node: Node) -> Result:
        """Keep the routing table by answers: an answer (re)admits its node; a
        contact of the table that misses a request gets a confirming ping, and
        one that misses ``_MISSES_TO_EVICT`` requests in a row, the last of
        them confirming pings, is removed and left out of look-ups for
        ``_FAILURE_MEMORY`` (a node not in the table, such as a sender pinged
        back, at its first miss). While a confirming ping is in flight, the
        misses of other requests are not counted: they were sent before it,
        and a loss burst that took several of them is one miss, not several.
        Returns ``result``."""
        contact = (node.id, node.ip, node.port)
        if result[0]:
            self._failed.pop(contact, None)
            self._missed.pop(contact, None)
            return super().handle_call_response(result, node)
        if contact in self._missed:
            return result  # its confirming ping decides
        known = not self.router.is_new_node(node)  # a contact, not a sender pinged back
        if known and self._confirm(node, contact, misses=1):
            return result
        return self._evict(node, contact)

    def _evict(self, node: Node, contact: tuple[bytes, str, int]) -> Result:
        """Remove a contact that missed, and leave it out of look-ups."""
        now = asyncio.get_event_loop().time()
        self._missed.pop(contact, None)
        self._failed[contact] = now
        if len(self._failed) > 4096:
            self._failed = {k: t for k, t in self._failed.items() if now - t < _FAILURE_MEMORY}
        return super().handle_call_response((False, None), node)

    def _confirm(self, node: Node, contact: tuple[bytes, str, int], misses: int) -> bool:
        """Ping a contact that missed ``misses`` requests in a row; an answer
        readmits it, a miss pings it again or evicts it. False (evict now) if
        the protocol is closed or too many confirmations are in flight."""
        if misses >= _MISSES_TO_EVICT or self._closed:
            return False
        if contact not in self._missed and len(self._missed) >= _MAX_PENDING_PINGS:
            return False
        self._missed[contact] = misses

        def on_reply(reply: Result) -> None:
            if contact not in self._missed:
                return  # answered meanwhile
            if self._closed:
                self._missed.pop(contact, None)
            elif reply[0]:
                self.handle_call_response((True, None), node)
            elif not self._confirm(node, contact, misses + 1):
                self._evict(node, contact)

        self.request((node.ip, node.port), "ping", [], node.id, on_reply)
        return True

    def _live(self, contacts: list[tuple[bytes, str, int]]) -> list[tuple[bytes, str, int]]:
        """Drop contacts that failed to answer us recently."""
        if not self._failed:
            return contacts
        now = asyncio.get_event_loop().time()
        return [
            c for c in contacts if now - self._failed.get(c, -_FAILURE_MEMORY) >= _FAILURE_MEMORY
        ]

    def _ping_back_if_new(self, node: Node) -> None:
        """Ping a request's sender that is not in the routing table; its
        signed answer adds it (``handle_call_response``).

        A contact is pinged back at most once per ``_CONTACT_MEMORY``: one
        that answered but found its bucket full stays "new" (kademlia keeps it
        as a replacement), and pinging it after each of its requests would
        double the traffic of a busy swarm for nothing.
        """
        if not self.router.is_new_node(node) or node.id in self._pinging:
            return
        if len(self._pinging) >= _MAX_PENDING_PINGS or not self._has_room_for(node):
            return
        if self._recently(self._pinged_back, node):
            return
        self._pinging.add(node.id)

        def on_reply(reply: Result) -> None:
            self._pinging.discard(node.id)
            if not self._closed:
                self.handle_call_response((reply[0], None), node)

        self.request((node.ip, node.port), "ping", [], node.id, on_reply)

    def _closest_known(self, target: Node) -> bool:
        """True if no contact in the routing table is closer to ``target`` than
        this node is.

        A contact closer than this node shares the target's bits above the
        highest bit where this node differs from the target, so only the
        buckets overlapping that range of ids are scanned (for a key stored
        here, a few buckets next to this node's own).
        """
        mine = self.source_node.long_id ^ target.long_id
        free_bits = mine.bit_length()
        lo = (target.long_id >> free_bits) << free_bits
        hi = lo | ((1 << free_bits) - 1)
        for bucket in self.router.buckets:
            if bucket.range[1] < lo or bucket.range[0] > hi:
                continue
            for contact in bucket.nodes.values():
                if contact.long_id ^ target.long_id < mine and contact.id != target.id:
                    return False
        return True

    def welcome_if_new(self, node: Node) -> None:
        """Add a node that answered us; push it the records it is now responsible for
        (Kademlia paper, section 2.5). Only validated records are ever stored, so
        only validated records are pushed."""
        if not self.router.is_new_node(node):
            self.router.add_contact(node)  # refresh its position in the bucket
            return
        if not self._recently(self._welcomed, node):
            # A node whose bucket is full stays "new" (kademlia keeps it as a
            # replacement): push to it once a while, not after every answer.
            self._push_records_to(node)
        self.router.add_contact(node)

    def _has_room_for(self, node: Node) -> bool:
        """Whether ``node`` could enter the routing table now: its bucket has
        room or would be split (kademlia's ``add_contact`` rule, section 4.2 of
        the paper). Otherwise it could only become a replacement, which is
        learned from the answers to our own requests at no extra cost."""
        bucket = self.router.buckets[self.router.get_bucket_for(node)]
        return (
            len(bucket) < bucket.ksize
            or bucket.has_in_range(self.source_node)
            or bucket.depth() % 5 != 0
        )

    def _recently(self, memory: OrderedDict[tuple[bytes, str, int], float], node: Node) -> bool:
        """True if ``node`` is in ``memory`` from the last ``_CONTACT_MEMORY``
        seconds; otherwise enters it (now) and returns False."""
        contact = (node.id, node.ip, node.port)
        now = asyncio.get_event_loop().time()
        last = memory.get(contact)
        if last is not None and now - last < _CONTACT_MEMORY:
            return True
        memory[contact] = now
        memory.move_to_end(contact)
        if len(memory) > _MAX_REMEMBERED_CONTACTS:
            memory.popitem(last=False)
        return False

    def _push_records_to(self, node: Node) -> None:
        for dkey in self.storage.key_ids():
            keynode = Node(dkey)
            # This node must be the closest it knows to the key; that test scans
            # a few contacts, so the k-nearest search runs only for the few
            # keys that pass it, not for every key stored.
            if not self._closest_known(keynode):
                continue
            neighbors = self.router.find_neighbors(keynode)
            if not neighbors or node.distance_to(keynode) < neighbors[-1].distance_to(keynode):
                for record in self.storage.records(dkey):
                    self.spawn(self.call_store(node, record))
