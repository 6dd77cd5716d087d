"""``DHTNode``: the trio face of a peer's Kademlia node.

``open_dht_node`` binds the UDP socket, bootstraps, runs maintenance (routing
refresh, record expiry) in a nursery it owns, and stops everything on exit.
``store`` and ``get`` are the whole data API; both are trio coroutines that
cross into kademlia's asyncio code through ``_aio``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import trio

from swarm._address import Address, format_address, parse_address
from swarm._bans import BanList
from swarm._clock import WallClock, system_clock
from swarm._counters import new_trio_gauge
from swarm._errors import (
    BootstrapError,
    ClosedError,
    ConfigError,
    collapse_exception_groups,
)
from swarm._identity import Identity, PeerID

from ._aio import AsyncioLoop, open_asyncio_loop
from ._crawl import RecordCrawl
from ._messages import derive_proof_key
from ._ratelimit import MonotonicClock, RequestRateLimit
from ._records import (
    Record,
    RecordLimits,
    Subkey,
    decode_subkey,
    encode_key,
    key_id,
    make_record,
    validate,
)
from ._server import RecordServer
from ._storage import StorageQuota

log = logging.getLogger(__name__)

#: First pause before the initial peers are pinged again (doubling, up to
#: ``rpc_timeout``) while none has answered.
_BOOTSTRAP_RETRY = 0.1
#: Contacts remembered to join again through, should every contact be dropped
_REJOIN_CONTACTS = 8


@dataclass(frozen=True)
class DHTConfig:
    """Kademlia parameters, timeouts and record limits of one node."""

    #: k: replication factor and bucket size (Kademlia paper, section 2.2)
    ksize: int = 20
    #: alpha: concurrent requests per look-up step (section 2.3)
    alpha: int = 3
    #: the longest wait for one UDP reply; kademlia's default of 5 s would make a
    #: bootstrap through dead contacts take minutes. Once replies have been
    #: measured, the wait follows their round trips (``RoundTrips``: srtt +
    #: 4 rttvar, at least ``rpc_timeout_floor``), and a look-up stops waiting
    #: for a reply after srtt + 2 rttvar, asking another node instead.
    rpc_timeout: float = 1.0
    #: the shortest wait learned from round trips: below it, a pause of the
    #: process (not a dead node) is the likely cause of silence. None: 0.25 s,
    #: or ``rpc_timeout`` if that is shorter
    rpc_timeout_floor: float | None = None
    #: how long bootstrapping may take before the initial peers count as unreachable
    bootstrap_timeout: float = 10.0
    #: routing buckets and records untouched this long are refreshed / re-stored
    refresh_interval: float = 600.0
    #: how often expired records are swept from storage
    expiry_sweep_interval: float = 30.0
    limits: RecordLimits = field(default_factory=RecordLimits)
    #: most records one node stores, across all keys; beyond it new records
    #: are refused (nothing stored is evicted to make room)
    max_records: int = 100_000
    #: the pre-shared key of a private swarm (``swarm._swarm_key``): every
    #: datagram proves it, and datagrams that do not are dropped unanswered
    swarm_key: bytes | None = field(default=None, repr=False)
    #: how much of this node's storage one node id / one host may hold
    quota: StorageQuota = field(default_factory=StorageQuota)
    #: datagrams per second one source address / one node id may send us
    rate_limit: RequestRateLimit = field(default_factory=RequestRateLimit)
    #: a client only asks: it answers no requests, stores no records for
    #: others, and flags its requests so that no node pings it back or adds it
    #: to a routing table (hivemind's ``client_mode``). For processes that
    #: live briefly (``swarm status``) or cannot be reached (behind NAT); a
    #: swarm of clients alone cannot store anything.
    client_mode: bool = False

    def __post_init__(self) -> None:
        if self.ksize < 1 or self.alpha < 1:
            raise ConfigError("DHTConfig: ksize and alpha must be at least 1")
        if not 0 < self.rpc_timeout <= 60:
            raise ConfigError("DHTConfig: rpc_timeout must be in (0, 60] seconds")
        if self.rpc_timeout_floor is not None and not (
            0.01 <= self.rpc_timeout_floor <= self.rpc_timeout
        ):
            raise ConfigError(
                f"DHTConfig: rpc_timeout_floor ({self.rpc_timeout_floor}s) must be between "
                f"0.01s and rpc_timeout ({self.rpc_timeout}s)"
            )
        if self.bootstrap_timeout < self.rpc_timeout:
            raise ConfigError(
                f"DHTConfig: bootstrap_timeout ({self.bootstrap_timeout}s) must be at least "
                f"rpc_timeout ({self.rpc_timeout}s), or no initial peer can ever answer in time"
            )
        if self.refresh_interval <= 0 or self.expiry_sweep_interval <= 0:
            raise ConfigError("DHTConfig: refresh_interval and expiry_sweep_interval must be > 0")
        if self.swarm_key is not None and len(self.swarm_key) < 16:
            raise ConfigError(
                "DHTConfig: swarm_key must be at least 16 bytes (use 32 random bytes)"
            )
        if self.max_records < self.quota.max_records_per_host:
            raise ConfigError(
                f"DHTConfig: max_records ({self.max_records}) must be at least "
                f"quota.max_records_per_host ({self.quota.max_records_per_host}), "
                "or one host could fill the whole storage"
            )

    @property
    def timeout_floor(self) -> float:
        """``rpc_timeout_floor``, or its default."""
        if self.rpc_timeout_floor is not None:
            return self.rpc_timeout_floor
        return min(0.25, self.rpc_timeout)


class DHTValue(NamedTuple):
    """A value read from the DHT with its absolute expiration time.

    For a key with sub-keys, ``value`` is a ``dict`` from sub-key to ``DHTValue``
    and ``expiration_time`` is the latest among them.
    """

    value: Any
    expiration_time: float


class RecordDHT(Protocol):
    """What code above the DHT needs to keep records in it: ``DHTNode`` has it.

    Progress tracking, the progress tree and grid agreement depend on this, not
    on ``DHTNode``, so that they name only the three calls they make.
    """

    async def store(
        self,
        key: str,
        value: Any,
        expiration_time: float,
        *,
        subkey: str | None = None,
        replicas: int | None = None,
    ) -> bool: ...

    async def get(self, key: str, *, latest: bool = False) -> DHTValue | None: ...

    def now(self) -> float: ...


@dataclass(frozen=True)
class DHTStats:
    """What a node has sent since it started (requests and replies together)."""

    #: datagrams and their bytes
    sent_datagrams: int
    sent_bytes: int
    #: the largest datagram sent
    largest_datagram: int
    #: requests sent, and those that got no answer in time
    sent_requests: int
    failed_requests: int
    #: smoothed round trip of all replies so far (None before the first)
    round_trip: float | None
    #: datagrams sent with an Ed25519 signature; the others carry the MAC of
    #: a key shared with their receiver (``_sessions``)
    signed_datagrams: int = 0
    #: copies of unanswered requests sent again (each signed: ``_protocol``)
    resent_requests: int = 0


class DHTNode:
    """A running Kademlia node. Create it with ``open_dht_node``."""

    def __init__(
        self,
        server: RecordServer,
        loop: AsyncioLoop,
        identity: Identity,
        host: str,
        port: int,
        config: DHTConfig,
        clock: WallClock,
        nursery: trio.Nursery,
    ) -> None:
        self._server = server
        # a record stored here wakes whoever waits for its key (wait_for_store)
        self._stored: dict[bytes, trio.Event] = {}
        server.storage.on_stored = self._wake_waiters
        self._loop = loop
        self._identity = identity
        self.host = host
        self.port = port
        self.config = config
        self._clock = clock
        self._nursery = nursery
        self._closed = False
        #: where to join again if every contact is dropped (``_rejoin_if_alone``):
        #: the initial peers, then contacts of the last maintenance pass
        self._initial: list[Address] = []
        self._recent: list[Address] = []
        self._next_rejoin = -math.inf
        token = trio.lowlevel.current_trio_token()
        #: the node's gauges, read on its trio thread when collected (``swarm._counters``)
        self.metrics = (
            new_trio_gauge(
                "swarm_dht_contacts",
                "Peers in the DHT routing table",
                self.routing_table_size,
                token,
            ),
            new_trio_gauge(
                "swarm_dht_stored_keys", "Keys this DHT node stores", self.stored_key_count, token
            ),
            *server.proto.counters.metrics,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the DHT node is stopped")

    @property
    def peer_id(self) -> PeerID:
        return self._identity.peer_id

    @property
    def address(self) -> str:
        """``host:port`` that other peers pass as ``--initial-peer``."""
        return format_address(self.host, self.port)

    @property
    def identity(self) -> Identity:
        return self._identity

    def now(self) -> float:
        """The node's wall clock (the one expiration times are compared with)."""
        return self._clock()

    # -- joining ----------------------------------------------------------------

    async def bootstrap(self, initial_peers: Sequence[str | Address]) -> None:
        """Join the swarm through any of ``initial_peers`` (``"host:port"`` or tuples).

        Raises ``ConfigError`` for an address that does not parse and
        ``BootstrapError`` if none of them answers within ``bootstrap_timeout``.
        Unanswered pings are sent again until then: one lost datagram, or an
        initial peer too busy to answer within one ``rpc_timeout``, must not
        keep a newcomer out.
        """
        self._check_open()
        addrs = [parse_address(a) if isinstance(a, str) else a for a in initial_peers]
        addrs = [a for a in addrs if a != (self.host, self.port)]
        if not addrs:
            return
        self._initial = addrs
        deadline = trio.current_time() + self.config.bootstrap_timeout
        answered: list[Any] = []
        pause = _BOOTSTRAP_RETRY
        with trio.move_on_at(deadline):
            while not answered:
                answered = await self._loop.call(self._server.ping_initial, addrs)
                if not answered:
                    await trio.sleep(pause)
                    pause = min(2 * pause, self.config.rpc_timeout)
        if not answered:
            shown = ", ".join(format_address(*a) for a in addrs)
            raise BootstrapError(
                f"no initial peer answered ({shown}); check the address and that a peer runs there"
            )
        # An initial peer answered: we are in. The crawl only fills the routing
        # table, and one through contacts that have died since may outlast the
        # deadline; what it found so far stays in the table.
        with trio.move_on_at(deadline):
            await self._loop.call(self._server.crawl_self, answered)
        log.info(
            "joined through %d of %d initial peers; %d contacts",
            len(answered),
            len(addrs),
            self.routing_table_size(),
        )

    # -- data -----------------------------------------------------------------

    async def store(
        self,
        key: str | bytes,
        value: Any,
        expiration_time: float,
        *,
        subkey: Subkey | None = None,
        replicas: int | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``.

        ``value`` is any msgpack-able object of at most ``limits.max_value_size``
        encoded bytes; ``expiration_time`` is absolute (seconds since the epoch by
        this node's clock) and at most ``limits.max_ttl`` ahead. A key or sub-key
        containing ``owner_marker(peer_id)`` is signed with this node's key; one
        naming another owner cannot be stored.

        It goes to the k (``ksize``) nodes closest to the key, or to the
        ``replicas`` closest of them: a record rewritten every few seconds
        (progress), whose loss costs one refresh, needs a few copies on the
        nodes that readers ask first (a plain ``get`` reads the 3 closest), not
        k; each copy is a request and a reply.

        Returns True if at least one node responsible for the key kept it (False
        if all of them hold a newer version or none answered). Raises
        ``RecordRejectedError`` (nothing sent) if the record is invalid,
        ``ValueError`` (nothing sent) if ``replicas`` is below 1, and
        ``ClosedError`` if the node is stopped.
        """
        self._check_open()
        if replicas is not None and replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        record = make_record(
            key,
            value,
            expiration_time,
            subkey=subkey,
            signer=self._identity,
            limits=self.config.limits,
        )
        validate(record, self._clock(), self.config.limits)
        await self._rejoin_if_alone()
        kept = await self._loop.call(self._server.store_record, record, replicas)
        return kept > 0

    async def store_record(self, record: Record) -> bool:
        """Store a record made elsewhere (``make_record``, signed by its owner
        when it names one): relaying another peer's record, which storing
        nodes verify as they verify any. Returns and raises as ``store``;
        ``RecordRejectedError`` (nothing sent) if it does not validate here."""
        self._check_open()
        validate(record, self._clock(), self.config.limits)
        kept = await self._loop.call(self._server.store_record, record)
        return kept > 0

    async def get(self, key: str | bytes, *, latest: bool = False) -> DHTValue | None:
        """Read ``key``: its value, or a dict of its sub-keys, or None.

        Records of the responsible nodes are merged with the local copy (per
        sub-key, latest expiration wins); every record is verified before it is
        returned. ``latest=True`` asks all of the k closest nodes rather than
        stopping at the first that answer. Nodes seen with stale or missing
        records get the freshest ones written back in the background.
        """
        self._check_open()
        dkey = key_id(encode_key(key))
        await self._rejoin_if_alone()
        records, crawl = await self._loop.call(self._server.find_records, dkey, latest)
        # every record was validated as it arrived; only expiry can have changed
        now = self._clock()
        live = [r for r in records if r.expiration > now]
        if crawl is not None and live and not self._closed:
            self._nursery.start_soon(
                self._write_back, crawl, live, self.config.ksize if latest else 1
            )
        return _to_value(live)

    def get_local(self, key: str | bytes) -> DHTValue | None:
        """``key`` as this node's own storage holds it: no network, so what
        other nodes hold is missing (a node stores only the keys it is among
        the closest to; in a swarm of at most k nodes, all of them)."""
        self._check_open()
        now = self._clock()  # validated when stored; only expiry can have changed
        records = self._server.storage.records(key_id(encode_key(key)))
        return _to_value([r for r in records if r.expiration > now])

    async def wait_for_store(self, key: str | bytes) -> None:
        """Return once a record under ``key`` is stored at this node (a new
        one, or a newer version), whoever sent it; the caller bounds the wait.
        With ``get_local`` it lets a reader that found nothing learn of a
        record the moment it arrives here rather than at its next read. A
        closed node stores nothing more: it waits until the caller's bound."""
        dkey = key_id(encode_key(key))
        event = self._stored.get(dkey)
        if event is None:
            event = self._stored[dkey] = trio.Event()
        try:
            await event.wait()
        finally:  # the last waiter gave up: forget the key
            if not event.is_set() and not event.statistics().tasks_waiting:
                self._stored.pop(dkey, None)

    def _wake_waiters(self, dkey: bytes) -> None:
        event = self._stored.pop(dkey, None)
        if event is not None:
            event.set()

    async def _rejoin_if_alone(self) -> None:
        """With no contact left, join again through the initial peers and the
        contacts of the last maintenance pass (at most once per
        ``rpc_timeout``) before a read or a write.

        The DHT drops a contact that leaves a request unanswered, and a peer
        behind a NAT (a client) knows few: its one public contact, busy for a
        moment, leaves it with none, and nobody adds a client back. Its reads
        then reached nobody and read as empty (a run of peers looked like
        this peer alone), for good."""
        if self._server.routing_table_size() or trio.current_time() < self._next_rejoin:
            return
        self._next_rejoin = trio.current_time() + self.config.rpc_timeout
        addrs = list(dict.fromkeys(self._initial + self._recent))
        if not addrs:
            return
        answered = await self._loop.call(self._server.ping_initial, addrs)
        if answered:
            await self._loop.call(self._server.crawl_self, answered)
            log.info("no contact was left: joined again through %d node(s)", len(answered))

    async def _write_back(self, crawl: RecordCrawl, records: list[Record], limit: int) -> None:
        await self._loop.call(self._server.write_back, crawl, records, limit)

    async def ping(self, address: Address) -> PeerID | None:
        """Ping ``address`` (resent per the RPC timeouts); the peer id of the
        node that answered, None if none did. Nobody is kept as a contact for
        it (a reachability dial-back, ``swarm._reachability``)."""
        self._check_open()
        found: PeerID | None = await self._loop.call(self._server.proto.ping_only, address)
        return found

    async def punch(self, address: Address, peer_id: PeerID, *, timeout: float = 5.0) -> bool:
        """Punch a UDP path through NATs to the node ``peer_id`` at
        ``address`` (the address its packets leave its NAT from), which must
        call this towards this node at the same moment (coordinated over a
        connection both hold, ``swarm._punch``). True if it answered within
        ``timeout`` seconds: it is a contact, and a client node answers its
        requests (``SwarmProtocol.punch``); False changes nothing."""
        self._check_open()
        done: bool = await self._loop.call(
            self._server.proto.punch, address, bytes(peer_id), timeout
        )
        return done

    @property
    def client_mode(self) -> bool:
        return self._server.client_mode

    def set_client_mode(self, client: bool, *, answer_pings: bool = False) -> None:
        """Become a client (answer no requests, and flag ours so that nobody
        keeps this node as a contact) or a full node: for a peer that learns
        whether others can reach it (``swarm._reachability``). A client with
        ``answer_pings`` still answers pings, so that others can check.

        Nodes that kept it as a contact drop it after one unanswered request; a
        client that turns full is kept by the nodes it sends requests to from
        then on (``bootstrap`` again to be known at once)."""
        self._server.client_mode = client
        self._server.proto.client_mode = client
        self._server.proto.answers_pings = client and answer_pings

    # -- introspection --------------------------------------------------------

    def routing_table_size(self) -> int:
        return self._server.routing_table_size()

    def size_estimate(self) -> int:
        """About how many nodes the DHT holds, from this node's routing table
        alone (``estimate_network_size``): no request, so a peer that just
        joined knows it at once."""
        return estimate_network_size(self.peer_id, [peer for peer, _, _ in self.contacts()])

    def stats(self) -> DHTStats:
        """Traffic counters of this node (for benchmarks and tests)."""
        proto = self._server.proto
        return DHTStats(
            proto.sent_datagrams,
            proto.sent_bytes,
            proto.largest_datagram,
            proto.sent_requests,
            proto.failed_requests,
            proto.round_trips.smoothed(),
            proto.signed_datagrams,
            proto.resent_requests,
        )

    def stored_key_count(self) -> int:
        return self._server.storage.key_count()

    def contacts(self) -> list[tuple[PeerID, str, int]]:
        return self._server.contacts()

    @property
    def dropped_datagrams(self) -> int:
        """Datagrams dropped as malformed, unsigned or not a valid request."""
        return self._server.proto.dropped_datagrams

    @property
    def bans(self) -> BanList:
        """Node ids and addresses whose datagrams this node drops (local bans)."""
        bans = self._server.proto.bans
        assert bans is not None  # open_dht_node always passes one
        return bans

    @property
    def rate_limited_datagrams(self) -> int:
        """Datagrams dropped because their source was over its ``RequestRateLimit``."""
        return self._server.proto.rate_limited_datagrams

    # -- maintenance ----------------------------------------------------------

    async def _maintain(self) -> None:
        next_refresh = trio.current_time() + self.config.refresh_interval
        while True:
            await trio.sleep(self.config.expiry_sweep_interval)
            self._server.storage.cull()
            contacts = self._server.contacts()
            if contacts:
                self._recent = [(host, port) for _, host, port in contacts[:_REJOIN_CONTACTS]]
            if trio.current_time() >= next_refresh:
                next_refresh = trio.current_time() + self.config.refresh_interval
                await self._loop.call(self._server.refresh, self.config.refresh_interval)


#: contacts whose distances size the network in ``estimate_network_size``
_SIZE_SAMPLE = 20


def estimate_network_size(own: bytes, contacts: Sequence[bytes]) -> int:
    """The number of nodes of a network in which ``own`` knows ``contacts``.

    Node ids are uniform, so the j-th closest of N - 1 other nodes lies at
    about j / N of the id space: N ~ j * 2^bits / distance_j, from the
    farthest of the 20 closest contacts (a bootstrap's lookup of its own id
    finds them; about 22% error). Never less than the nodes known: a table
    of fewer contacts than that holds the whole small network.
    """
    known = len(set(contacts))
    if known < _SIZE_SAMPLE:
        return known + 1
    mine = int.from_bytes(own, "big")
    distances = sorted({mine ^ int.from_bytes(c, "big") for c in contacts})
    farthest = distances[_SIZE_SAMPLE - 1]
    estimate = _SIZE_SAMPLE * 2 ** (8 * len(own)) // max(1, farthest)
    return max(known + 1, int(estimate))


def _to_value(records: list[Record]) -> DHTValue | None:
    if not records:
        return None
    plain = next((r for r in records if r.subkey is None), None)
    subkeyed = [r for r in records if r.subkey is not None]
    latest_subkey = max((r.expiration for r in subkeyed), default=-math.inf)
    if plain is not None and plain.expiration >= latest_subkey:
        return DHTValue(plain.decoded_value(), plain.expiration)
    entries = {
        decode_subkey(r.subkey): DHTValue(r.decoded_value(), r.expiration)
        for r in subkeyed
        if r.subkey is not None
    }
    return DHTValue(entries, latest_subkey)


@asynccontextmanager
async def open_dht_node(
    identity: Identity | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    initial_peers: Sequence[str | Address] = (),
    config: DHTConfig | None = None,
    clock: WallClock = system_clock,
    bans: BanList | None = None,
    rate_clock: MonotonicClock = time.monotonic,
) -> AsyncIterator[DHTNode]:
    """Run a DHT node listening on UDP ``host:port`` for the duration of the block.

    ``port=0`` picks a free port (see ``node.port``). With ``initial_peers`` the
    node bootstraps before the block starts and raises ``BootstrapError`` if none
    answers. ``clock`` is the wall clock used for expiration times and
    ``rate_clock`` the monotonic clock that refills request budgets. ``bans``
    (the peer facade shares one with its connections, see ``swarm._bans``) is
    consulted for every datagram and records offences; without it nobody is
    banned. On exit (or cancellation) maintenance stops and the socket is closed.
    """
    identity = identity or Identity.generate()
    config = config or DHTConfig()
    with collapse_exception_groups():
        async with open_asyncio_loop() as loop, trio.open_nursery() as nursery:
            server = RecordServer(
                identity,
                ksize=config.ksize,
                alpha=config.alpha,
                rpc_timeout=config.rpc_timeout,
                rpc_timeout_floor=config.timeout_floor,
                limits=config.limits,
                max_records=config.max_records,
                quota=config.quota,
                rate_limit=config.rate_limit,
                clock=clock,
                proof_key=(
                    None if config.swarm_key is None else derive_proof_key(config.swarm_key)
                ),
                bans=bans if bans is not None else BanList.disabled(),
                rate_clock=rate_clock,
                client_mode=config.client_mode,
            )
            try:
                bound = await loop.call(server.listen, port, host)
            except OSError as e:
                raise ConfigError(f"cannot listen on UDP {format_address(host, port)}: {e}") from e
            node = DHTNode(server, loop, identity, host, bound, config, clock, nursery)
            assert server.socket is not None  # listen bound it
            nursery.start_soon(server.socket.serve_datagrams, server.proto)
            try:
                if initial_peers:
                    await node.bootstrap(initial_peers)
                nursery.start_soon(node._maintain)
                yield node
            finally:
                node._closed = True
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await loop.run_sync(server.stop)
