"""Hole punching: a direct TCP connection between two peers behind NATs.

Two unreachable peers X and Y (``_reachability``) cannot dial each other, but
each can reach the other through a relay's circuit (``_relay``), a
connection both already hold through a third peer. Over it they coordinate a
TCP simultaneous open (RFC 793 section 3.4; Ford et al., "Peer-to-Peer
Communication Across Network Address Translators", 2005, section 4):

1. X binds a fresh TCP socket (``SO_REUSEADDR``/``SO_REUSEPORT``, so the
   port can be bound again for every attempt) to a port ``p`` and opens the
   stream ``PUNCH`` to Y (through the relay), sending ``["punch", host, p]``:
   ``host`` is the address the reachability helpers saw X come from (its
   NAT's public address, ``AsyncPeer.observed_host``).
2. Y binds its own fresh port ``q`` and replies ``["punch", host, q]``; from
   then on both connect to the other's ``(host, port)`` from their own port,
   again every ``ATTEMPT`` seconds until ``timeout``. A port-preserving NAT
   maps ``p`` to the public port ``p``, so the SYN that X sends opens X's NAT
   for Y's SYN (conntrack matches it as the reply) and the other way round:
   the two SYNs cross and the sockets connect. A symmetric NAT maps each
   destination to another public port, so each side dials a port nobody
   opened and the punch fails (``PunchError``); the peers go on through the
   relay.
3. On the punched socket X runs the handshake as the dialer (Y must prove its
   peer id) and pools the connection (``Connections.adopt_outbound``): X's
   next streams to Y use it before any relay. Y serves it like an inbound
   connection. It is direct: the relay, and the peer that relayed, may leave.

Only the dialer opens streams on a connection (``_connections``), so a peer
punches for its own streams; the other punches for its own. The peer asked
to punch dials only the port it is told at the host it is told: at most
``MAX_PUNCHES`` punches run at once per peer, each a few SYNs for ``timeout``
seconds, and the connection they make is useless to anyone but the
authenticated peer that asked (the handshake must prove it).

When to punch (``AutoPuncher``): an unreachable peer that opened a stream
to another peer over a relay's circuit, and has no direct connection to it,
punches one in the background as soon as that stream ended (the first relayed
exchange shows that the other peer is alive and relayed). One punch per pair
runs at a time; after a punch that failed (a symmetric NAT, say) the next to
that peer waits ``PunchConfig.backoff`` seconds, doubled after every further
failure up to ``max_backoff``, so a pair that cannot punch costs a few SYNs
every few minutes, not every round. After a success the pair punches again
only when its direct connection was lost (closed idle, or a failed stream). A
reachable peer does not punch: it is dialed directly, or relays.

Each direction punches for itself: a punched connection carries the streams
of the peer that asked for the punch only, since only the dialer opens
streams on a connection. The other peer's streams go through the relay until
its own first relayed stream makes it punch, one round later.

A punched connection is preferred to a relay's circuit for every stream
(``Connections``), and waited for briefly when its last stream's handler has
not ended yet: it cannot be dialed again. When the relay (and with it the
DHT's only reachable node) leaves, peers that punched to each other go on
averaging over their punched connections (``AsyncPeer.punched_peers``;
``averaging._matchmaking``, "Without the DHT").

Not done yet: punching UDP for the DHT (a relayed peer's DHT node stays a
client, so a NATed peer still needs a reachable DHT node to find peers it
has not averaged with), and keepalives on an idle punched connection (a router that forgets
idle TCP mappings drops it; ``ConnectionConfig.idle_timeout`` closes it first
by default, and the next relayed stream punches anew).
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from prometheus_client import Counter

from ._connections import Address, Connections, Stream
from ._counters import count_of, new_counter
from ._errors import (
    ConfigError,
    PeerUnreachableError,
    ProtocolError,
    StreamResetError,
    SwarmError,
)
from ._identity import PeerID
from ._wire import expect_int, expect_list, expect_str

log = logging.getLogger(__name__)

#: Stream name of the punch request.
PUNCH = "swarm.punch"
#: Seconds one connect attempt of a punch waits before the next begins.
ATTEMPT = 0.5
#: Punches one peer serves at once.
MAX_PUNCHES = 4


class PunchError(PeerUnreachableError):
    """A punch made no direct connection (a NAT that does not preserve ports,
    or the other peer refused); the peers still reach each other as before."""


def encode_offer(host: str, port: int) -> list[Any]:
    return ["punch", host, port]


def decode_offer(message: Any) -> Address:
    """The ``(host, port)`` of a punch offer; ``ProtocolError`` if malformed."""
    kind, host, port = expect_list(message, 3, "punch offer")
    if kind != "punch":
        raise ProtocolError(f"unexpected punch message {kind!r}")
    return (
        expect_str(host, "punch host", max_size=64),
        expect_int(port, "punch port", lo=1, hi=65535),
    )


def _bound_socket(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except BaseException:
        sock.close()
        raise
    return sock


async def _first_socket() -> tuple[trio.socket.SocketType, int]:
    sock = _bound_socket(0)
    try:
        await sock.bind(("0.0.0.0", 0))
    except BaseException:
        sock.close()
        raise
    return sock, sock.getsockname()[1]


async def simultaneous_open(
    sock: trio.socket.SocketType, port: int, remote: Address, timeout: float
) -> trio.SocketStream:
    """Connect from ``port`` to ``remote`` (``sock`` is bound to ``port``)
    again every ``ATTEMPT`` seconds until one attempt connects; raises
    ``PunchError`` after ``timeout`` seconds. Every socket but the connected
    one is closed, also on cancellation."""
    with trio.move_on_after(timeout):
        while True:
            attempt_ends = trio.current_time() + ATTEMPT
            try:
                with trio.move_on_at(attempt_ends):
                    await sock.connect(remote)
                    return trio.SocketStream(sock)
            except OSError as e:  # refused or unreachable for now: the other SYN may come
                log.debug("punch attempt to %s:%d: %s", *remote, e)
            finally:
                if sock.fileno() != -1 and not _connected(sock):
                    sock.close()
            await trio.sleep_until(attempt_ends)
            sock = _bound_socket(port)
            try:
                await sock.bind(("0.0.0.0", port))
            except BaseException:
                sock.close()
                raise
    raise PunchError(f"no direct connection to {remote[0]}:{remote[1]} within {timeout} s")


def _connected(sock: trio.socket.SocketType) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


async def punch(
    connections: Connections,
    peer_id: PeerID,
    address: Address,
    my_host: str,
    *,
    timeout: float = 5.0,
) -> None:
    """Punch a direct connection to ``peer_id`` (reached at ``address``,
    through whatever relay route ``connections`` has for it) and pool it for
    this peer's next streams to ``peer_id`` (module docstring). ``my_host``:
    this peer's address as others see it.

    Raises ``PunchError`` if no direct connection was made within about
    ``timeout`` seconds or the other peer refused (nothing changes: the relay
    still carries the streams), the errors of ``Connections.open_stream`` for
    the coordination, and those of ``Connections.adopt_outbound``.
    Cancellation closes every socket it opened.
    """
    sock, port = await _first_socket()
    opened = False  # from then on simultaneous_open owns the socket
    try:
        # the stream stays open during the punch, so that the other side's
        # handler is not cut off by this side closing it
        async with connections.open_stream(peer_id, address, PUNCH) as stream:
            with trio.fail_after(timeout):
                await stream.send(encode_offer(my_host, port))
                remote = decode_offer(await stream.receive())
            opened = True
            socket_stream = await simultaneous_open(sock, port, remote, timeout)
    except trio.TooSlowError as e:
        raise PunchError(f"{peer_id.short()} did not answer a punch within {timeout} s") from e
    except StreamResetError as e:
        raise PunchError(f"{peer_id.short()} refused to punch: {e}") from e
    finally:
        if not opened:
            sock.close()
    await connections.adopt_outbound(socket_stream, peer_id)
    log.info("punched a direct connection to %s at %s:%d", peer_id.short(), *remote)


class SeenFromOutside(Protocol):
    """What serving punches needs of a peer (``AsyncPeer`` is one)."""

    #: the address others see this peer at (None: unknown)
    observed_host: str | None


def serve_punch(connections: Connections, me: SeenFromOutside, *, timeout: float = 5.0) -> None:
    """Take part in the punches other peers ask for on ``connections``, from
    the address ``me.observed_host`` (refused while it is None). The punched
    connection is served as an inbound one; a punch that fails changes
    nothing (the handler returns, and the asking peer raises ``PunchError``)."""
    running = trio.CapacityLimiter(MAX_PUNCHES)

    async def handle(stream: Stream) -> None:
        remote = decode_offer(await stream.receive())
        host = me.observed_host
        if host is None:
            raise ProtocolError("this peer does not know its public address")
        try:
            running.acquire_nowait()
        except trio.WouldBlock:
            raise ProtocolError(f"{MAX_PUNCHES} punches running") from None
        try:
            sock, port = await _first_socket()
            try:
                await stream.send(encode_offer(host, port))
            except BaseException:
                sock.close()
                raise
            try:
                socket_stream = await simultaneous_open(sock, port, remote, timeout)
            except SwarmError as e:
                log.debug("punch asked by %s failed: %s", stream.remote.short(), e)
                return
            connections.adopt_inbound(socket_stream, relayed=False)
        finally:
            running.release()

    connections.set_handler(PUNCH, handle)


@dataclass(frozen=True)
class PunchConfig:
    """When an unreachable peer punches by itself (``AutoPuncher``); validated
    on construction.

    ``auto=False`` never punches unless asked (``AsyncPeer.punch``).
    ``timeout`` (5 s): how long one punch tries. ``backoff`` (10 s): the wait
    after a failed punch before the next to the same peer, doubled after each
    further failure up to ``max_backoff`` (300 s).
    """

    auto: bool = True
    timeout: float = 5.0
    backoff: float = 10.0
    max_backoff: float = 300.0

    def __post_init__(self) -> None:
        for name in ("timeout", "backoff", "max_backoff"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"PunchConfig.{name}={value} must be a positive finite number")
        if self.max_backoff < self.backoff:
            raise ConfigError(
                f"PunchConfig.max_backoff={self.max_backoff} must be at least "
                f"backoff={self.backoff}"
            )


class AutoPuncher:
    """Punches a direct connection to each peer this peer reaches only through
    a relay, while this peer is unreachable itself (module docstring, "When to
    punch").

    ``my_host`` says the address others see this peer at while it should
    punch (unreachable, and the address known), else None. Install
    ``relayed_stream`` with ``Connections.set_relayed_stream_hook`` and run
    ``serve``.
    """

    def __init__(
        self,
        connections: Connections,
        my_host: Callable[[], str | None],
        config: PunchConfig | None = None,
    ) -> None:
        self.config = config if config is not None else PunchConfig()
        self._connections = connections
        self._my_host = my_host
        self._running: set[PeerID] = set()
        self._failures: dict[PeerID, int] = {}
        self._retry_at: dict[PeerID, float] = {}
        self._punched_peers: set[PeerID] = set()
        # one entry per peer at most (``_running``), so it never holds more
        # than the peers this peer talks to through relays
        self._send, self._receive = trio.open_memory_channel[tuple[PeerID, Address, str]](
            math.inf
        )
        self._punched = new_counter("swarm_punched", "Direct connections punched by this peer")
        self._failed = new_counter("swarm_punch_failed", "Punches of this peer that failed")

    @property
    def punched(self) -> int:
        """Punches that made a direct connection so far."""
        return count_of(self._punched)

    @property
    def failed(self) -> int:
        """Punches that failed so far (the relay went on carrying the streams)."""
        return count_of(self._failed)

    @property
    def metrics(self) -> tuple[Counter, ...]:
        """The counters behind ``punched`` and ``failed`` (``_counters``)."""
        return (self._punched, self._failed)

    def direct_peers(self) -> frozenset[PeerID]:
        """The peers this peer punched a connection to that is still open: it
        reaches them without a relay (until that connection closes)."""
        gone = {p for p in self._punched_peers if not self._connections.direct_connections(p)}
        self._punched_peers -= gone
        return frozenset(self._punched_peers)

    def relayed_stream(self, peer_id: PeerID, address: Address) -> None:
        """A stream to ``peer_id`` went through a relay: punch, unless one
        runs already, a direct connection exists, the back-off of an earlier
        failure has not passed, or this peer should not punch. Never blocks."""
        if not self.config.auto or peer_id in self._running:
            return
        host = self._my_host()
        if host is None or self._connections.direct_connections(peer_id):
            return
        if trio.current_time() < self._retry_at.get(peer_id, -math.inf):
            return
        self._running.add(peer_id)
        self._send.send_nowait((peer_id, address, host))

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the punches ``relayed_stream`` asks for, ``MAX_PUNCHES`` at once,
        until cancelled (which stops the running ones and closes their sockets)."""
        limit = trio.CapacityLimiter(MAX_PUNCHES)
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for peer_id, address, host in self._receive:
                await limit.acquire_on_behalf_of(peer_id)
                nursery.start_soon(self._punch_one, limit, peer_id, address, host)

    async def _punch_one(
        self, limit: trio.CapacityLimiter, peer_id: PeerID, address: Address, host: str
    ) -> None:
        try:
            await punch(self._connections, peer_id, address, host, timeout=self.config.timeout)
        except SwarmError as e:  # per-peer boundary: the relay goes on carrying the streams
            failures = self._failures[peer_id] = self._failures.get(peer_id, 0) + 1
            wait = min(self.config.backoff * 2 ** (failures - 1), self.config.max_backoff)
            self._retry_at[peer_id] = trio.current_time() + wait
            self._failed.inc()
            log.info("punch to %s failed (next try in %.0f s): %s", peer_id.short(), wait, e)
        else:
            self._failures.pop(peer_id, None)
            self._retry_at.pop(peer_id, None)
            self._punched_peers.add(peer_id)
            self._punched.inc()
        finally:
            self._running.discard(peer_id)
            limit.release_on_behalf_of(peer_id)
