"""The peer facade: identity, DHT node and peer connections on one port.

``open_peer`` (async) is the primary API; ``Peer`` (sync) runs the same thing
in one background thread that runs trio, for synchronous training loops.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import trio
from prometheus_client.registry import Collector

from dht import DHTConfig, DHTNode, DHTValue, open_dht_node

from ._address import Address, format_address, parse_address
from ._announce import announce_host, is_wildcard
from ._bans import BanConfig, BanList
from ._clock import WallClock, system_clock
from ._connections import ConnectionConfig, Connections, open_connections
from ._errors import (
    ClosedError,
    ConfigError,
    PeerCrashedError,
    SwarmError,
    collapse_exception_groups,
    unwrap_single,
)
from ._identity import Identity, PeerID
from ._punch import AutoPunch, PunchConfig, PunchError, punch, serve_dht_punch, serve_punch
from ._reachability import (
    Reachability,
    ReachabilityConfig,
    Verdict,
    check_reachability,
    serve_dial_back,
)
from ._relay import Relay, RelayConfig, keep_relay, serve_relay

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Attempts to find a port number free for both TCP and UDP when port=0.
_PORT_ATTEMPTS = 8
#: Seconds before an unchecked peer whose check nobody answered asks again.
_FIRST_RECHECK = 2.0
#: Seconds between looks at an unchecked peer's contacts (a founder's: empty until a peer joins).
_CONTACT_POLL = 1.0


#: Most seconds a call that found the peer's run finishing waits for its
#: thread to record how it ended (it is only unwinding by then).
_FINISHING_TIMEOUT = 10.0


@dataclass(frozen=True)
class PeerConfig:
    """How a peer listens, whom it joins, and the settings of its parts.

    ``host`` is the address to listen on; ``announce`` (``HOST:PORT``) is the
    address others are told to dial, when it differs (NAT, 0.0.0.0).
    ``client_mode`` peers accept no incoming connections for averaging: they
    connect out only (peers behind NAT); their DHT node is a client too
    (``DHTConfig.client_mode``), so nobody keeps it as a contact.

    ``swarm_key`` (``swarm._swarm_key``) makes the peer a member of a private
    swarm: it is copied into ``connections`` and ``dht``, so every handshake
    and every DHT datagram proves it. ``bans`` sets how long misbehaving peers
    are ignored (``swarm._bans``); the connections and the DHT node of one peer
    share one ban list.

    ``reachability`` says when the peer asks others to dial it back and
    becomes a client if they cannot (``swarm._reachability``): by default when
    it listens on a wildcard host with no ``announce`` and joins a swarm.

    ``relay`` says whether and how much this peer relays for peers that
    nobody can dial (``swarm._relay``; its circuits use this peer's port).
    ``punch`` says whether it punches direct connections by itself to the
    peers it reaches only through a relay (``swarm._punch.AutoPunch``).
    """

    host: str = "127.0.0.1"
    port: int = 0
    initial_peers: tuple[str, ...] = ()
    announce: str | None = None
    client_mode: bool = False
    dht: DHTConfig = field(default_factory=DHTConfig)
    connections: ConnectionConfig = field(default_factory=ConnectionConfig)
    swarm_key: bytes | None = field(default=None, repr=False)
    bans: BanConfig = field(default_factory=BanConfig)
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    punch: PunchConfig = field(default_factory=PunchConfig)

    def __post_init__(self) -> None:
        if self.swarm_key is not None:
            for part in ("connections", "dht"):
                current = getattr(self, part).swarm_key
                if current is not None and current != self.swarm_key:
                    raise ConfigError(
                        f"PeerConfig.{part}.swarm_key differs from PeerConfig.swarm_key: "
                        "set the key in one place"
                    )
            object.__setattr__(
                self, "connections", replace(self.connections, swarm_key=self.swarm_key)
            )
            object.__setattr__(self, "dht", replace(self.dht, swarm_key=self.swarm_key))
        if self.client_mode and not self.dht.client_mode:
            object.__setattr__(self, "dht", replace(self.dht, client_mode=True))
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port {self.port} is outside 0-65535")
        if isinstance(self.initial_peers, str):
            raise ConfigError("initial_peers is a sequence of HOST:PORT strings, not one string")
        for address in self.initial_peers:
            parse_address(address)
        if self.announce is not None:
            parse_address(self.announce)

    @property
    def checks_reachability(self) -> bool:
        """Whether the peer asks others to dial it back: when it joins, and
        (``AsyncPeer.recheck_reachability``) later."""
        mode = self.reachability.check
        if mode == "never" or self.client_mode:
            return False
        return mode == "always" or (self.announce is None and is_wildcard(self.host))


class AsyncPeer:
    """A running peer (made by ``open_peer``): ``.dht``, ``.connections``, ``.address``."""

    def __init__(
        self,
        identity: Identity,
        config: PeerConfig,
        dht: DHTNode,
        connections: Connections,
        services: trio.Nursery,
        relay: Relay | None = None,
    ) -> None:
        self.identity = identity
        #: what this peer relays for others (``swarm._relay``)
        self.relay = relay
        self.config = config
        self.dht = dht
        self.connections = connections
        self._services = services
        #: set as the peer begins to stop: no service starts after it
        self._stopping = False
        #: the host others dial when none is announced (``_announce``)
        self._dial_host = config.host
        if config.announce is None and is_wildcard(config.host):
            self._dial_host = self._guess_host()
        #: whether others can dial this peer (``swarm._reachability``)
        self.reachability = Reachability.CLIENT if config.client_mode else Reachability.UNCHECKED
        #: set once a check found a verdict (REACHABLE or UNREACHABLE)
        self.reachability_found = trio.Event()
        #: the relay this unreachable peer is registered with (its peer id and
        #: the address of its circuits), while registered (``keep_relay``)
        self.relayed_by: tuple[PeerID, Address] | None = None
        #: set once this peer first registered with a relay
        self.relay_found = trio.Event()
        #: the address the reachability helpers saw this peer come from (its
        #: NAT's public address, behind one); None until a check was answered
        self.observed_host: str | None = None
        #: punches direct connections to peers dialed through a relay
        #: (``swarm._punch``; runs from ``open_peer``), and counts them
        self.auto_punch = AutoPunch(connections, self, config.punch, dht)

    def _guess_host(self) -> str:
        initial = self.config.initial_peers
        return announce_host(self.config.host, parse_address(initial[0])[0] if initial else None)

    async def check_reachability(self) -> Verdict:
        """Ask peers to dial this one back and act on the verdict: UNREACHABLE
        makes this peer a client (``client_mode`` turns True, its DHT node a
        client), REACHABLE a full member again, announcing the host the helpers
        reached unless ``config.announce`` is set; UNCHECKED (nobody answered)
        changes nothing. Returns the verdict; raises nothing but
        ``trio.Cancelled`` (then nothing changes). A configured client stays one.
        """
        initial = [parse_address(a) for a in self.config.initial_peers]
        silent = self.dht.client_mode
        if silent:  # others must get an answer to their dial-back's ping
            self.dht.set_client_mode(True, answer_pings=True)
        try:
            verdict = await check_reachability(
                self.connections,
                self.dht,
                self.peer_id,
                self.port,
                initial,
                self.config.reachability,
            )
        finally:
            if silent:
                self.dht.set_client_mode(True)
        if verdict.host is not None:
            self.observed_host = verdict.host
        if self.config.client_mode:
            return verdict
        if verdict.reachability is not Reachability.UNCHECKED:
            self.reachability = verdict.reachability
            self.reachability_found.set()
            if verdict.reachability is Reachability.REACHABLE and self.config.announce is None:
                assert verdict.host is not None  # decide() names the host it was reached at
                self._dial_host = verdict.host
        if silent and self.reachability is not Reachability.UNREACHABLE:
            # joined as a client until the verdict (``open_peer``); a full node
            # now (UNCHECKED too: nobody could tell, so as before checks existed)
            await self._become_full_node()
        elif not silent and self.reachability is Reachability.UNREACHABLE:
            self.dht.set_client_mode(True)
        return verdict

    async def _become_full_node(self) -> None:
        """Turn the DHT node full and make it known: bootstrapping again pings
        the initial peers and looks up this node's id, without the client flag,
        so the nodes asked keep it as a contact."""
        self.dht.set_client_mode(self.config.dht.client_mode)
        if self.config.dht.client_mode or not self.config.initial_peers:
            return
        try:
            await self.dht.bootstrap(self.config.initial_peers)
        except SwarmError as e:  # known from its next requests anyway
            log.info("could not announce this DHT node to its initial peers: %s", e)

    async def recheck_reachability(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Check again whenever the verdict may be stale; runs until cancelled.

        While the verdict is UNCHECKED (the swarm's first peer, or nobody
        answered yet): as soon as the DHT has a contact to ask (the table is
        looked at every ``_CONTACT_POLL`` seconds, which costs no traffic), so
        a founder learns its verdict when the first peer joins; after a check
        that nobody answered, again after ``_FIRST_RECHECK`` seconds, doubling
        up to ``recheck_interval``. Once checked: every ``recheck_interval``
        seconds, if the guessed host changed (a new network, a new lease; only
        while nothing is announced explicitly), until a check gets an answer.
        """
        interval = self.config.reachability.recheck_interval
        guessing = self.config.announce is None and is_wildcard(self.config.host)
        # the guess, not ``_dial_host``: a check may have replaced that with
        # the address the helpers reached (a forwarded port)
        guessed = self._guess_host() if guessing else self._dial_host
        task_status.started()
        backoff = min(_FIRST_RECHECK, interval)
        next_try = trio.current_time()
        while self.reachability is Reachability.UNCHECKED:
            await trio.sleep(_CONTACT_POLL)
            if trio.current_time() < next_try or not self.dht.contacts():
                continue
            await self.check_reachability()
            next_try = trio.current_time() + backoff
            backoff = min(2 * backoff, interval)
        if not guessing:
            return  # the address is given: nothing can change it
        pending = False  # the address changed and no check has answered since
        while True:
            await trio.sleep(interval)
            try:
                now = self._guess_host()
            except ConfigError:  # no address at all for now: keep the last verdict
                continue
            if now != guessed:
                log.info("this machine's address changed (%s to %s): checking again", guessed, now)
                guessed = self._dial_host = now
                pending = True
            if pending:
                # connections made from the old address may be dead: a check
                # nobody answered is tried again at the next interval
                verdict = await self.check_reachability()
                pending = verdict.reachability is Reachability.UNCHECKED

    async def keep_relay(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """While this peer is UNREACHABLE, stay registered with one relay
        (``swarm._relay``): the DHT's contacts (full nodes, so reachable ones)
        in turn until one accepts, and another when it goes; runs until
        cancelled. ``relayed_by`` names the relay while registered. The
        verdict is looked at every ``_CONTACT_POLL`` seconds; after every
        contact refused or none was known, it waits ``_FIRST_RECHECK``
        seconds, doubling up to ``recheck_interval``, before trying again.
        A registration is kept if the verdict later turns REACHABLE.
        """
        task_status.started()
        cap = max(self.config.reachability.recheck_interval, _FIRST_RECHECK)
        backoff = _FIRST_RECHECK
        while True:
            if self.reachability is not Reachability.UNREACHABLE:
                await trio.sleep(_CONTACT_POLL)
                continue
            for relay_peer, host, port in self.dht.contacts():
                if relay_peer == self.peer_id:
                    continue
                try:
                    await self._keep_one_relay(relay_peer, (host, port))
                except SwarmError as e:
                    log.info("relay %s: %s", relay_peer.short(), e)
                else:
                    backoff = _FIRST_RECHECK  # it was registered and then ended
                finally:
                    self.relayed_by = None
            await trio.sleep(backoff)
            backoff = min(2 * backoff, cap)

    async def _keep_one_relay(self, relay_peer: PeerID, address: Address) -> None:
        # collapsed: the caller moves on to another relay on a SwarmError,
        # which a nursery would otherwise wrap in an ExceptionGroup
        with collapse_exception_groups():
            await self._registered_with(relay_peer, address)

    async def _registered_with(self, relay_peer: PeerID, address: Address) -> None:
        async with trio.open_nursery() as nursery:
            circuits = await nursery.start(keep_relay, self.connections, relay_peer, address)
            self.relayed_by = (relay_peer, circuits)
            self.relay_found.set()
            log.info("unreachable: others reach this peer through %s", relay_peer.short())

    async def punch(self, peer_id: PeerID, address: Address, *, timeout: float = 5.0) -> None:
        """Punch a direct connection to ``peer_id`` (which this peer reaches at
        ``address`` or through a relay route) for this peer's next streams to
        it (``swarm._punch``). Raises ``PunchError`` if none was made (also when
        this peer does not know the address others see it at: no reachability
        check answered yet); streams then go as before, through the relay."""
        if self.observed_host is None:
            raise PunchError("this peer does not know the address others see it at")
        await punch(self.connections, peer_id, address, self.observed_host, timeout=timeout)

    async def start_service(
        self, fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> trio.CancelScope:
        """Run ``fn(*args, task_status=...)`` as a service of this peer.

        Starts it with ``nursery.start`` (so it is ready when this returns) in a
        nursery the peer owns: it stops when the peer stops, or earlier when the
        returned cancel scope is cancelled. ``ClosedError`` once the peer has
        begun to stop (a task that outlived it, such as an optimizer's step
        racing the peer's end, learns that the peer stopped, as its next call
        on the peer's connections would say).
        """
        if self._stopping:
            raise ClosedError("the peer stopped")
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await fn(*args, task_status=task_status)

        await self._services.start(run)
        return scope

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    @property
    def port(self) -> int:
        return self.connections.port

    @property
    def endpoint(self) -> Address:
        """``(host, port)`` others dial: the announced address, else the bound
        one, where a wildcard host (``0.0.0.0``) is replaced by the address
        ``swarm._announce`` picks, never loopback unless the initial peer is."""
        if self.config.announce is not None:
            return parse_address(self.config.announce)
        return (self._dial_host, self.port)

    @property
    def address(self) -> str:
        """``host:port`` that other peers pass as ``--initial-peer``."""
        return format_address(*self.endpoint)

    @property
    def client_mode(self) -> bool:
        """Configured a client, or found unreachable (``check_reachability``)."""
        return self.config.client_mode or self.reachability is Reachability.UNREACHABLE

    @property
    def relay_route(self) -> Address | None:
        """Where others reach this peer when they cannot dial ``endpoint``: the
        circuit address of its relay (``swarm._relay``), while it is
        UNREACHABLE and registered with one; else None. Layers that announce
        this peer (matchmaking) announce it through that relay, so it can do
        what a reachable peer does (reduce a part) although ``client_mode``."""
        if self.reachability is not Reachability.UNREACHABLE or self.relayed_by is None:
            return None
        return self.relayed_by[1]

    def can_relay(self) -> bool:
        """Whether this peer may relay for others: not while it is a client or
        unreachable itself (its relay port would be no easier to reach than
        the peers it relays for)."""
        return not self.client_mode

    @property
    def metrics(self) -> tuple[Collector, ...]:
        """The metric objects this peer's layers keep their figures in (bytes,
        connections, DHT contacts and keys; ``_counters``), for a registry to
        expose: the figures themselves, not copies."""
        relay = () if self.relay is None else self.relay.metrics
        return (*self.connections.metrics, *self.dht.metrics, *relay, *self.auto_punch.metrics)

    def __repr__(self) -> str:
        return f"<AsyncPeer {self.peer_id.short()} at {self.address}>"


@asynccontextmanager
async def open_peer(
    identity: Identity | None = None,
    config: PeerConfig | None = None,
    *,
    clock: WallClock = system_clock,
) -> AsyncIterator[AsyncPeer]:
    """Run a peer for the duration of the block.

    Listens on TCP and UDP at the same port (``config.port``, or one free for
    both when 0) and bootstraps the DHT from ``config.initial_peers``, then (see
    ``PeerConfig.checks_reachability``) asks peers to dial it back, which takes
    at most ``ReachabilityConfig.call_timeout``. Raises
    ``ConfigError`` if the port cannot be bound and ``BootstrapError`` if no
    initial peer answers, and (listening on a wildcard host with no
    ``announce``) if this machine has no address that others could dial.
    Leaving the block (or cancellation) stops the DHT node and closes every
    connection.
    """
    identity = identity or Identity.generate()
    config = config or PeerConfig()
    bans = BanList(config.bans, clock=trio.current_time)
    attempts = _PORT_ATTEMPTS if config.port == 0 else 1
    with collapse_exception_groups():
        for attempt in range(attempts):
            stack = AsyncExitStack()
            dht_config = config.dht
            if config.checks_reachability and config.initial_peers:
                # join as a client until others tell whether they can reach this
                # peer: a full node that others cannot reach costs each of them
                # a timeout before they drop it
                dht_config = replace(dht_config, client_mode=True)
            try:
                connections = await stack.enter_async_context(
                    open_connections(
                        identity, config.host, config.port, config.connections, bans=bans
                    )
                )
                dht = await stack.enter_async_context(
                    open_dht_node(
                        identity,
                        host=config.host,
                        port=connections.port,
                        initial_peers=config.initial_peers,
                        config=dht_config,
                        clock=clock,
                        bans=bans,
                    )
                )
            except BaseException as raised:
                await stack.aclose()
                e = unwrap_single(raised)
                # With port 0, the TCP port was free but its UDP twin may be taken.
                taken = (isinstance(e, OSError) and e.errno == errno.EADDRINUSE) or (
                    isinstance(e, ConfigError) and "cannot listen" in str(e)
                )
                if taken and attempt + 1 < attempts:
                    continue
                if isinstance(e, OSError):
                    where = format_address(config.host, config.port)
                    raise ConfigError(f"cannot listen on {where}: {e.strerror or e}") from e
                raise e from e.__cause__
            stopping = False
            try:
                async with (
                    stack,
                    serve_relay(connections, config.relay) as relay,
                    trio.open_nursery() as services,
                ):
                    peer = AsyncPeer(identity, config, dht, connections, services, relay)
                    relay.set_usable(peer.can_relay)
                    serve_dial_back(connections, dht, config.reachability)
                    serve_punch(connections, peer, timeout=config.punch.timeout)
                    serve_dht_punch(connections, dht, peer, timeout=config.punch.timeout)
                    await peer.start_service(peer.auto_punch.serve)
                    if config.checks_reachability:
                        if config.initial_peers:
                            await peer.check_reachability()
                        if config.reachability.recheck_interval > 0:
                            await peer.start_service(peer.recheck_reachability)
                        await peer.start_service(peer.keep_relay)
                    try:
                        yield peer
                    finally:
                        # also when cancelled: the services nursery closes next
                        peer._stopping = True
                    stopping = True
                    services.cancel_scope.cancel()
            except* SwarmError as failed:
                if not stopping:
                    raise
                _log_stopping_failures(failed)
            return


def _log_stopping_failures(failed: BaseExceptionGroup[SwarmError]) -> None:
    """A service that failed with a ``SwarmError`` while the peer stopped
    (its relay closed their connection as it finished too, say) failed
    because it was stopping: the peer stopped as asked, not crashed. It was
    once reported as a crash at the end of a run that had finished."""
    for leaf in failed.exceptions:
        log.debug("while the peer stopped: %s: %s", type(leaf).__name__, leaf)


class SyncDHT:
    """Blocking ``store``/``get`` for code outside trio (see ``Peer``)."""

    def __init__(self, peer: Peer) -> None:
        self._peer = peer

    def store(
        self,
        key: str | bytes,
        value: Any,
        expiration_time: float,
        *,
        subkey: str | bytes | int | None = None,
    ) -> bool:
        async def store() -> bool:
            return await self._peer.async_peer.dht.store(key, value, expiration_time, subkey=subkey)

        return self._peer.run(store)

    def get(self, key: str | bytes, *, latest: bool = False) -> DHTValue | None:
        async def get() -> DHTValue | None:
            return await self._peer.async_peer.dht.get(key, latest=latest)

        return self._peer.run(get)


class Peer:
    """A peer for synchronous code: trio runs in one background thread it owns.

    ``with Peer(config=...) as peer:`` starts the thread and waits until the peer
    listens and has bootstrapped (re-raising its error otherwise); leaving the
    block stops the peer and joins the thread. ``peer.run(async_fn, *args)``
    runs a coroutine function on the peer's trio loop and returns its result.
    """

    def __init__(
        self,
        identity: Identity | None = None,
        config: PeerConfig | None = None,
        *,
        clock: WallClock = system_clock,
    ) -> None:
        self._identity = identity or Identity.generate()
        self._config = config or PeerConfig()
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        #: whether a caller has been told of ``_error`` (after the start)
        self._error_reported = False
        self._async_peer: AsyncPeer | None = None
        self.dht = SyncDHT(self)

    def __enter__(self) -> Peer:
        self._thread = threading.Thread(target=self._main, name="swarm-peer", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the peer and join its thread. Idempotent.

        Raises ``PeerCrashedError`` (caused by the error, traceback and all) if the
        peer's thread crashed after it started and no call has reported that yet,
        so a crash is never lost in a background thread.
        """
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            with suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()
        self._thread = None
        if self._error is not None and not self._error_reported:
            raise self._stopped() from self._error

    def _stopped(self) -> ClosedError:
        """The error for a call that found the peer's trio run over (raise it
        ``from self._error``, the crash that ended the run, if one did)."""
        self._error_reported = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # trio refuses calls as soon as the run is finishing, a moment
            # before ``_main`` records the crash that ended it
            thread.join(_FINISHING_TIMEOUT)
        if self._error is None:
            return ClosedError("the peer stopped")
        return PeerCrashedError(self._error)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # handed to the thread that called __enter__
            self._error = e
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_peer(self._identity, self._config, clock=self._clock) as peer:
            self._async_peer = peer
            self._ready.set()
            await self._stop.wait()

    @property
    def async_peer(self) -> AsyncPeer:
        if self._async_peer is None or self._thread is None:
            raise ClosedError("the peer is not running")
        return self._async_peer

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` on the peer's trio loop, blocking until done."""
        if self._token is None or self._thread is None:
            raise ClosedError("the peer is not running")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise self._stopped() from self._error

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run plain ``fn(*args)`` on the peer's trio thread, blocking until done.

        Code that mutates state which the peer's services read (e.g. a donor's
        state snapshot) runs here, so the two never interleave.
        """
        if self._token is None or self._thread is None:
            raise ClosedError("the peer is not running")
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise self._stopped() from self._error

    @property
    def peer_id(self) -> PeerID:
        return self._identity.peer_id

    @property
    def metrics(self) -> tuple[Collector, ...]:
        """``AsyncPeer.metrics``: thread-safe objects, readable from any thread."""
        return self.async_peer.metrics

    @property
    def address(self) -> str:
        return self.async_peer.address
