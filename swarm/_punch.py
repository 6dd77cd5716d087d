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

When to punch (``AutoPunch``): whenever this peer dials a peer through a
relay (it needs that peer: a group member, a stream it opens), it punches
for a direct connection in the background, at most one attempt at a time per
remote and ``MAX_PUNCHES`` in all, and after a failure not again for
``PunchConfig.retry_after`` seconds (doubling per failure in a row). The pool
then prefers the punched connection to any relayed one (``Connections``).
A stream that ends badly closes its connection, and once the relay is gone
only a punched connection that is left can coordinate another punch: so a
peer keeps ``PunchConfig.connections`` punched connections to each remote,
punches a new one as soon as one ends, and punched connections have no idle
timeout (TCP keepalives instead). Everything a punched connection does when
the remote goes (its handshake, the pool's watcher, the handler serving it)
fails within a per-peer boundary: its errors never reach the peer's nursery.

The DHT (``punch_dht``, stream ``PUNCH_DHT``): a peer found unreachable keeps
a client DHT node, which nobody keeps as a contact, so NATed peers need a
reachable DHT node to find each other. After its first TCP punch to a peer, a
client node punches a UDP path to that peer's node: over the punched
connection both send their public host and port (the peer's own port: one
port for TCP and UDP, kept by a port-preserving NAT), then ping each other
every 0.25 s (``DHTNode.punch``). Each side's first pings open its NAT for
the other's, a later one is answered, and from then on each answers the
other's requests and keeps it as a contact, so their DHT works without any
reachable node. Through a symmetric NAT (a new public port per destination)
no ping gets through: counted as a failure, nothing changes.
"""

from __future__ import annotations

import logging
import math
import socket
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
#: Stream name of the DHT (UDP) punch request.
PUNCH_DHT = "swarm.punch.dht"
#: Seconds one connect attempt of a punch waits before the next begins.
ATTEMPT = 0.5
#: Punches one peer serves at once.
MAX_PUNCHES = 4


@dataclass(frozen=True)
class PunchConfig:
    """When a peer punches by itself (``AutoPunch``); validated on construction.

    ``auto=False`` never punches unasked (``AsyncPeer.punch`` still does).
    ``connections`` (3): punched connections kept to each remote. A stream
    that ends badly (a round cancelled) closes its connection, and without
    the relay that coordinated it nothing can punch another but a punched
    connection that is left: a new one is punched over it at once.
    ``timeout`` (5 s) bounds one attempt's coordination and its connects.
    ``retry_after`` (30 s): after a failed attempt, a remote is not punched
    again for this long, doubled per failure in a row up to
    ``max_retry_after`` (10 min): behind a symmetric NAT every attempt fails,
    and each costs both peers a relay stream and a few SYNs.
    """

    auto: bool = True
    connections: int = 3
    timeout: float = 5.0
    retry_after: float = 30.0
    max_retry_after: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= MAX_PUNCHES:
            raise ConfigError(f"connections={self.connections} must be in [1, {MAX_PUNCHES}]")
        for name in ("timeout", "retry_after", "max_retry_after"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value} must be a positive number of seconds")
        if self.max_retry_after < self.retry_after:
            raise ConfigError(
                f"max_retry_after={self.max_retry_after} must be at least "
                f"retry_after={self.retry_after}"
            )


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


class PunchableDHT(Protocol):
    """What a UDP punch needs of a DHT node (``dht.DHTNode`` is one)."""

    @property
    def client_mode(self) -> bool: ...

    async def punch(self, address: Address, peer_id: PeerID, *, timeout: float = 5.0) -> bool: ...


async def punch_dht(
    connections: Connections,
    dht: PunchableDHT,
    peer_id: PeerID,
    address: Address,
    my_host: str,
    *,
    timeout: float = 5.0,
) -> None:
    """Punch a UDP path between this peer's DHT node and ``peer_id``'s
    (module docstring, "The DHT"), coordinated over a stream to it (as
    ``punch``). Raises ``PunchError`` if no ping got through within about
    ``timeout`` seconds or the other peer refused (nothing changes), and the
    errors of ``Connections.open_stream``."""
    try:
        async with connections.open_stream(peer_id, address, PUNCH_DHT) as stream:
            with trio.fail_after(timeout):
                await stream.send(encode_offer(my_host, connections.port))
                remote = decode_offer(await stream.receive())
            # the stream stays open while both ping, as in ``punch``
            punched = await dht.punch(remote, peer_id, timeout=timeout)
    except trio.TooSlowError as e:
        raise PunchError(f"{peer_id.short()} did not answer a DHT punch within {timeout} s") from e
    except StreamResetError as e:
        raise PunchError(f"{peer_id.short()} refused to punch for the DHT: {e}") from e
    if not punched:
        raise PunchError(f"no DHT ping got through to {peer_id.short()} at {remote[0]}:{remote[1]}")
    log.info("punched a DHT path to %s at %s:%d", peer_id.short(), *remote)


def serve_dht_punch(
    connections: Connections, dht: PunchableDHT, me: SeenFromOutside, *, timeout: float = 5.0
) -> None:
    """Take part in the DHT punches other peers ask for on ``connections``
    (``punch_dht``), from ``me.observed_host`` and this peer's port (refused
    while the host is unknown). One that fails changes nothing."""
    running = trio.CapacityLimiter(MAX_PUNCHES)

    async def handle(stream: Stream) -> None:
        remote = decode_offer(await stream.receive())
        host = me.observed_host
        if host is None:
            raise ProtocolError("this peer does not know its public address")
        try:
            running.acquire_nowait()
        except trio.WouldBlock:
            raise ProtocolError(f"{MAX_PUNCHES} DHT punches running") from None
        try:
            await stream.send(encode_offer(host, connections.port))
            if not await dht.punch(remote, stream.remote, timeout=timeout):
                log.debug("DHT punch asked by %s failed", stream.remote.short())
        finally:
            running.release()

    connections.set_handler(PUNCH_DHT, handle)


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


class _Remote:
    """What ``AutoPunch`` remembers of one remote: whether an attempt runs,
    and after failures, when it may try again."""

    __slots__ = ("address", "dht_punched", "failures", "kept", "retry_at", "running")

    def __init__(self, address: Address) -> None:
        self.address = address  # what the dial through the relay was given
        self.running = False
        self.failures = 0
        self.retry_at = -math.inf
        #: punched before: punch again when its connections end
        self.kept = False
        self.dht_punched = False


class AutoPunch:
    """Punches by itself for the remotes this peer dials through a relay
    (module docstring, "When to punch") while ``serve`` runs.

    ``attempts``, ``successes`` and ``failures`` count this peer's punches
    (``metrics`` holds the counters behind them).
    """

    def __init__(
        self,
        connections: Connections,
        me: SeenFromOutside,
        config: PunchConfig,
        dht: PunchableDHT | None = None,
    ) -> None:
        self._connections = connections
        self._me = me
        self._dht = dht
        self._config = config
        self._remotes: dict[PeerID, _Remote] = {}
        self._running = trio.CapacityLimiter(MAX_PUNCHES)
        self._nursery: trio.Nursery | None = None
        self._attempts = new_counter("swarm_punch_attempts", "Hole punches this peer began")
        self._successes = new_counter(
            "swarm_punch_successes", "Hole punches that made a direct connection"
        )
        self._failures = new_counter("swarm_punch_failures", "Hole punches that failed")
        self._dht_successes = new_counter(
            "swarm_dht_punch_successes", "UDP punches that made a DHT node a contact"
        )
        self._dht_failures = new_counter("swarm_dht_punch_failures", "UDP punches that failed")

    @property
    def attempts(self) -> int:
        return count_of(self._attempts)

    @property
    def successes(self) -> int:
        return count_of(self._successes)

    @property
    def failures(self) -> int:
        return count_of(self._failures)

    @property
    def dht_successes(self) -> int:
        return count_of(self._dht_successes)

    @property
    def dht_failures(self) -> int:
        return count_of(self._dht_failures)

    @property
    def metrics(self) -> tuple[Counter, ...]:
        return (
            self._attempts,
            self._successes,
            self._failures,
            self._dht_successes,
            self._dht_failures,
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Punch for every dial of the connections through a relay, until
        cancelled. Attempts run in a nursery of this call, so cancelling it
        stops them, and no dial asks for one once it has returned."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._connections.watch_relayed_dials(self.want_direct)
            self._connections.watch_punched_drops(self._dropped)
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._connections.watch_relayed_dials(None)
                self._connections.watch_punched_drops(None)

    def want_direct(self, peer_id: PeerID, address: Address) -> None:
        """This peer needs ``peer_id`` and reaches it only through a relay:
        punch in the background, unless an attempt to it runs, it failed too
        recently, this peer does not know the address others see it at, or
        auto-punching is off or stopped. Never blocks or raises."""
        if not self._config.auto or self._nursery is None:
            return
        remote = self._remotes.get(peer_id)
        if remote is None:
            self._forget_expired(trio.current_time())
            remote = self._remotes[peer_id] = _Remote(address)
        remote.address = address
        self._start(peer_id, remote)

    def _dropped(self, peer_id: PeerID) -> None:
        """A punched connection to ``peer_id`` ended: punch another (over one
        that is left, or the relay) if it was punched before."""
        remote = self._remotes.get(peer_id)
        if remote is not None and remote.kept and self._nursery is not None:
            self._start(peer_id, remote)

    def _start(self, peer_id: PeerID, remote: _Remote) -> None:
        host = self._me.observed_host
        if remote.running or trio.current_time() < remote.retry_at or host is None:
            return
        if self._connections.punched_count(peer_id) >= self._config.connections:
            return
        assert self._nursery is not None
        remote.running = True
        self._attempts.inc()
        self._nursery.start_soon(self._attempt, peer_id, remote, host)

    def _forget_expired(self, now: float) -> None:
        """Drop remotes that are free to try again and hold no punched
        connection: what is left is bounded by the remotes that failed within
        ``max_retry_after`` and those this peer keeps punched connections to."""
        for peer_id, remote in list(self._remotes.items()):
            if not (remote.running or remote.kept) and now >= remote.retry_at:
                del self._remotes[peer_id]

    async def _attempt(self, peer_id: PeerID, remote: _Remote, host: str) -> None:
        """Punch from ``host`` until ``config.connections`` punched connections
        to ``peer_id`` are live, one punch failed, or it made that many; the
        boundary of everything it does with ``peer_id``."""
        try:
            async with self._running:
                for punched in range(1, self._config.connections + 1):
                    try:
                        await punch(
                            self._connections,
                            peer_id,
                            remote.address,
                            host,
                            timeout=self._config.timeout,
                        )
                    except Exception as e:  # per-peer boundary: a failed punch leaves the relay
                        self._failed(peer_id, remote, e)
                        return
                    self._successes.inc()
                    remote.failures = 0
                    remote.retry_at = -math.inf
                    remote.kept = True
                    if not remote.dht_punched:
                        remote.dht_punched = await self._punch_dht(peer_id, remote.address, host)
                    enough = self._connections.punched_count(peer_id) >= self._config.connections
                    if enough or punched == self._config.connections:
                        return
                    self._attempts.inc()
        finally:
            remote.running = False

    async def _punch_dht(self, peer_id: PeerID, address: Address, host: str) -> bool:
        """After a TCP punch, punch for the DHT too while this node is a
        client (a full node answers anyone already): over the punched
        connection, so it works once the relay is gone. Whether it is done."""
        if self._dht is None or not self._dht.client_mode:
            return True
        try:
            await punch_dht(
                self._connections, self._dht, peer_id, address, host, timeout=self._config.timeout
            )
        except Exception as e:  # per-peer boundary, as for the TCP punch
            self._dht_failures.inc()
            log.info("no DHT path to %s: %s", peer_id.short(), e)
            return False
        self._dht_successes.inc()
        return True

    def _failed(self, peer_id: PeerID, remote: _Remote, error: Exception) -> None:
        self._failures.inc()
        if self._connections.punched_count(peer_id) == 0:
            remote.kept = False  # nothing left to punch over but a relay
        delay = min(
            self._config.retry_after * 2**remote.failures, self._config.max_retry_after
        )
        remote.failures += 1
        remote.retry_at = trio.current_time() + delay
        if isinstance(error, SwarmError):
            log.info(
                "no direct connection to %s (%s): through the relay, again in %.0f s",
                peer_id.short(),
                error,
                delay,
            )
        else:
            log.warning(
                "punch to %s failed unexpectedly", peer_id.short(), exc_info=error
            )
