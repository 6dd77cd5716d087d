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

Not done yet: punching UDP for the DHT (a relayed peer's DHT node stays a
client, so two NATed peers still need a reachable DHT node to find each
other), and deciding when to punch (callers call ``punch``).
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Protocol

import trio

from ._connections import Address, Connections, Stream
from ._errors import PeerUnreachableError, ProtocolError, StreamResetError, SwarmError
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
