"""Relays: a reachable peer forwards connections to a peer nobody can dial.

A peer behind a NAT (``_reachability``'s UNREACHABLE verdict) can dial out but
cannot be dialed. A reachable peer that serves relaying (``serve_relay``)
lends it a way in:

1. The unreachable peer X opens a stream ``REGISTER`` to the relay R over a
   normal peer connection (so R knows it is X: the handshake proved it) and
   keeps it open (``keep_relay``). R replies ``["registered", relay_port,
   keepalive]`` (``keepalive``: seconds; a relay that predates keepalives
   sent only the port), or ``["refused", reason]`` beyond
   ``RelayConfig.max_relayed_peers``, when it does not serve relaying, or
   when it cannot be dialed itself (``Relay.set_usable``).
2. A peer D that wants X dials R's relay port and sends ``RAW_MAGIC`` and
   the preamble ``["connect", X]`` (``open_circuit``). R picks a fresh random
   token, sends ``["circuit", token]`` on X's register stream, and X opens a
   new TCP connection to the relay port with ``RAW_MAGIC`` and the preamble
   ``["accept", token]``. R answers D ``["ok"]`` (or ``["refused", reason]``) and from then
   on copies bytes between the two sockets, unchanged, both ways.
3. Over that spliced byte stream D and X run the normal handshake of
   ``_handshake`` (D dials, X listens) and then the normal frames of
   ``_framing``: the relay sees only the handshake's public keys and
   ciphertext (or GMAC-authenticated plaintext when encryption is off). It
   can drop, delay or cut the circuit; it cannot forge: a changed byte fails
   the handshake's signature or a frame's tag, which raises ``ProtocolError``
   at the receiver, and D's handshake must prove X's peer id, so a relay
   cannot answer in X's place.

Keepalive: on an idle register stream both sides send ``["ping"]`` every
``keepalive`` seconds, and each ends the registration when it heard nothing
for ``KEEPALIVE_MISSES`` intervals. The pings keep the NAT's mapping of the
register connection alive (a home router forgets an idle TCP mapping, often
within minutes, and then drops the relay's next circuit offer), and they let
each side notice a peer that vanished without closing the connection: the
relayed peer then registers with another relay (``AsyncPeer.keep_relay``).

The relay port is the relay's own peer port: a connection that begins with
``RAW_MAGIC`` (two zero bytes, which no handshake begins with) goes to the
relay instead of a handshake (``Connections.set_raw_handler``), so a relay
needs no second port forwarded, and relay connections count against the
peer's inbound limits (``ConnectionConfig.max_connections_per_address`` also
caps the circuits one relayed peer can take at once).

The token travels only on X's authenticated stream, so nobody else can take
X's side of a circuit. Preambles are a 2-byte big-endian length and a msgpack
document of at most ``MAX_PREAMBLE`` bytes; anything else closes the socket.

Bounds (``RelayConfig``): at most ``max_relayed_peers`` registered peers and
``max_circuits`` circuits (pending or spliced) at once; all circuits together
forward at most ``max_bytes_per_second`` (a shared token bucket, so relaying
cannot take a relay's whole uplink). ``serve=False`` refuses every
registration and every circuit.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter

from ._counters import count_of, new_counter
from ._errors import (
    ConfigError,
    EndOfStreamError,
    PeerUnreachableError,
    ProtocolError,
    SwarmError,
    collapse_exception_groups,
)
from ._identity import PEER_ID_SIZE, PeerID
from ._wire import expect_bytes, expect_float, expect_int, expect_list, expect_str, pack, unpack

if TYPE_CHECKING:
    from ._connections import Address, Connections, Stream

logger = logging.getLogger(__name__)

#: The stream an unreachable peer keeps open to its relay.
REGISTER = "relay/register"
MAX_PREAMBLE = 256
TOKEN_SIZE = 16
#: What a connection to the relay port begins with, before its preamble.
RAW_MAGIC = b"\x00\x00"
_LENGTH = struct.Struct(">H")
_CHUNK = 64 * 1024
#: Keepalive intervals without a message after which a register stream is dead.
KEEPALIVE_MISSES = 3
#: The keepalive intervals a relayed peer accepts from a relay (seconds).
_KEEPALIVE_RANGE = (0.1, 3600.0)
_MAX_REASON = 200


@dataclass(frozen=True)
class RelayConfig:
    """What a reachable peer lends to unreachable ones; validated on construction.

    ``serve=False`` refuses to relay for anyone. ``max_relayed_peers`` (16)
    registered peers at once, ``max_circuits`` (64) circuits at once,
    ``max_bytes_per_second`` (10 MB/s) forwarded by all circuits together (both
    directions count). ``circuit_timeout`` (5 s): how long a circuit waits for
    the relayed peer to take its side, and how long a preamble may take.
    ``keepalive_interval`` (15 s): how often an idle register stream carries a
    ping each way (module docstring), well under the minutes after which home
    routers forget an idle TCP mapping.
    """

    serve: bool = True
    max_relayed_peers: int = 16
    max_circuits: int = 64
    max_bytes_per_second: float = 10e6
    circuit_timeout: float = 5.0
    keepalive_interval: float = 15.0

    def __post_init__(self) -> None:
        for name in ("max_relayed_peers", "max_circuits"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("max_bytes_per_second", "circuit_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value} must be a positive finite number")
        lo, hi = _KEEPALIVE_RANGE
        if not lo <= self.keepalive_interval <= hi:
            raise ConfigError(
                f"keepalive_interval={self.keepalive_interval} must be in [{lo}, {hi}] seconds"
            )


# The preamble codec: pure.


def encode_preamble(message: list[Any]) -> bytes:
    """One preamble message as it goes on the wire (length and msgpack)."""
    payload = pack(message)
    if len(payload) > MAX_PREAMBLE:
        raise ValueError(f"a preamble of {len(payload)} bytes exceeds {MAX_PREAMBLE}")
    return _LENGTH.pack(len(payload)) + payload


async def _receive_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        if not chunk:
            raise PeerUnreachableError("the remote closed the connection during a relay preamble")
        data += chunk
    return bytes(data)


async def receive_preamble(stream: trio.SocketStream) -> list[Any]:
    """Read exactly one preamble message (nothing after it).

    Raises ``ProtocolError`` (oversized or malformed) or
    ``PeerUnreachableError`` (the remote closed first)."""
    (size,) = _LENGTH.unpack(await _receive_exactly(stream, _LENGTH.size))
    if not 0 < size <= MAX_PREAMBLE:
        raise ProtocolError(f"relay preamble of {size} bytes (limit {MAX_PREAMBLE})")
    message = unpack(await _receive_exactly(stream, size), max_size=MAX_PREAMBLE)
    if not isinstance(message, list) or not message:
        raise ProtocolError("a relay preamble is a non-empty list")
    return message


def _refused_reason(message: list[Any]) -> str:
    fields = expect_list(message, 2, "relay refusal")
    return expect_str(fields[1], "relay refusal reason", max_size=_MAX_REASON * 4)


# The relay's side.


@dataclass
class _Circuit:
    taken: trio.Event
    finished: trio.Event
    relayed_side: trio.SocketStream | None = None


class Relay:
    """The relaying a reachable peer does; made by ``serve_relay``.

    ``port`` is the relay port that dialers and relayed peers connect to (the
    peer's own port); 0 when not serving.
    """

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.port = 0
        self._registered: dict[PeerID, trio.MemorySendChannel[bytes]] = {}
        self._registrations: dict[PeerID, trio.CancelScope] = {}
        self._circuits: dict[bytes, _Circuit] = {}
        self._active = 0
        self._free_at = 0.0
        self._usable: Callable[[], bool] = lambda: True
        self._bytes = new_counter("swarm_relay_bytes", "Bytes this peer relayed, both directions")
        self._made = new_counter("swarm_relay_circuits", "Circuits this peer relayed")

    @property
    def bytes_relayed(self) -> int:
        """Bytes forwarded by all circuits so far, both directions (never decreases)."""
        return count_of(self._bytes)

    @property
    def circuits_made(self) -> int:
        """Circuits spliced so far (both sides connected)."""
        return count_of(self._made)

    @property
    def metrics(self) -> tuple[Counter, ...]:
        """The counters behind ``bytes_relayed`` and ``circuits_made``, for a
        peer's registry to expose (``_counters``)."""
        return (self._bytes, self._made)

    @property
    def relayed_peers(self) -> frozenset[PeerID]:
        """The peers registered now."""
        return frozenset(self._registered)

    def set_usable(self, usable: Callable[[], bool]) -> None:
        """Refuse new registrations while ``usable()`` is False (a peer that is
        itself unreachable or a client: ``AsyncPeer.can_relay``), so a relayed
        peer is never chosen as a relay. A registration already held ends at
        its next keepalive or circuit once ``usable()`` turned False."""
        self._usable = usable

    async def _throttle(self, size: int) -> None:
        # A shared token bucket with no burst: each chunk books its share of
        # the relay's rate, and waits until its slot begins.
        now = trio.current_time()
        start = max(now, self._free_at)
        self._free_at = start + size / self.config.max_bytes_per_second
        if start > now:
            await trio.sleep_until(start)

    async def handle_register(self, stream: Stream) -> None:
        """Serve one relayed peer's register stream until it ends.

        Refuses (a reply, then the end of the stream) when not serving, or
        when ``max_relayed_peers`` other peers are registered. A peer that
        registers again replaces its earlier registration (whose connection
        may be dead without the relay knowing yet). Cancellation unregisters it.
        """
        peer = stream.remote
        if not self.config.serve:
            await stream.send(["refused", "this peer does not relay"])
            return
        if not self._usable():
            await stream.send(["refused", "this peer cannot be dialed itself"])
            return
        earlier = self._registrations.pop(peer, None)
        if earlier is not None:
            earlier.cancel()
            self._registered.pop(peer, None)
        if len(self._registered) >= self.config.max_relayed_peers:
            await stream.send(
                ["refused", f"already relaying for {self.config.max_relayed_peers} peers"]
            )
            return
        send, receive = trio.open_memory_channel[bytes](self.config.max_circuits)
        self._registered[peer] = send
        scope = self._registrations[peer] = trio.CancelScope()
        try:
            await stream.send(["registered", self.port, self.config.keepalive_interval])
            with scope:
                await self._serve_registration(stream, receive)
        finally:
            if self._registered.get(peer) is send:
                del self._registered[peer]
            if self._registrations.get(peer) is scope:
                del self._registrations[peer]

    async def _serve_registration(
        self, stream: Stream, receive: trio.MemoryReceiveChannel[bytes]
    ) -> None:
        interval = self.config.keepalive_interval
        async with trio.open_nursery() as nursery:

            async def watch_end() -> None:
                # The relayed peer sends only pings; its EOF, a lost
                # connection, anything else, or silence ends the registration.
                with suppress(SwarmError, trio.TooSlowError):
                    while True:
                        with trio.fail_after(KEEPALIVE_MISSES * interval):
                            message = await stream.receive()
                        if message != ["ping"]:
                            break
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_end)
            while True:
                token: bytes | None = None
                with trio.move_on_after(interval):
                    token = await receive.receive()
                if not self._usable():
                    # found unreachable since: the peer must find a relay others can dial
                    nursery.cancel_scope.cancel()
                    return
                await stream.send(["ping"] if token is None else ["circuit", token])

    async def handle_tcp(self, socket_stream: trio.SocketStream) -> None:
        """Serve one connection to the relay port (after its ``RAW_MAGIC``): a
        dialer's ``connect`` or a relayed peer's ``accept``. Failures end this
        connection only."""
        try:
            with trio.fail_after(self.config.circuit_timeout):
                message = await receive_preamble(socket_stream)
            kind = expect_str(message[0], "relay preamble kind", max_size=16)
            if kind == "connect":
                fields = expect_list(message, 2, "relay connect")
                target = PeerID(expect_bytes(fields[1], "relay target", size=PEER_ID_SIZE))
                await self._connect(socket_stream, target)
            elif kind == "accept":
                fields = expect_list(message, 2, "relay accept")
                token = expect_bytes(fields[1], "circuit token", size=TOKEN_SIZE)
                await self._accept(socket_stream, token)
            else:
                raise ProtocolError(f"unknown relay preamble {kind!r}")
        except (
            SwarmError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            OSError,
        ) as e:
            logger.debug("relay connection ended: %s: %s", type(e).__name__, e)

    async def _refuse(self, socket_stream: trio.SocketStream, reason: str) -> None:
        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await socket_stream.send_all(encode_preamble(["refused", reason[:_MAX_REASON]]))

    async def _connect(self, dialer_side: trio.SocketStream, target: PeerID) -> None:
        channel = self._registered.get(target)
        if channel is None:
            await self._refuse(dialer_side, f"{target.short()} is not relayed here")
            return
        if self._active >= self.config.max_circuits:
            await self._refuse(dialer_side, f"already {self.config.max_circuits} circuits")
            return
        token = os.urandom(TOKEN_SIZE)
        circuit = _Circuit(trio.Event(), trio.Event())
        self._active += 1
        self._circuits[token] = circuit
        try:
            try:
                channel.send_nowait(token)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                await self._refuse(dialer_side, f"{target.short()} is not taking circuits")
                return
            with trio.move_on_after(self.config.circuit_timeout):
                await circuit.taken.wait()
            relayed_side = circuit.relayed_side
            if relayed_side is None:
                await self._refuse(dialer_side, f"{target.short()} did not take the circuit")
                return
            await dialer_side.send_all(encode_preamble(["ok"]))
            self._made.inc()
            await self._splice(dialer_side, relayed_side)
        finally:
            self._circuits.pop(token, None)
            self._active -= 1
            circuit.finished.set()

    async def _accept(self, relayed_side: trio.SocketStream, token: bytes) -> None:
        circuit = self._circuits.pop(token, None)
        if circuit is None:
            raise ProtocolError("no circuit waits for this token")
        circuit.relayed_side = relayed_side
        circuit.taken.set()
        # serve_tcp closes the socket when this returns: wait for the splice.
        await circuit.finished.wait()

    async def _splice(self, a: trio.SocketStream, b: trio.SocketStream) -> None:
        """Copy bytes both ways until both sides have sent EOF, or either fails."""

        async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            while True:
                data = await source.receive_some(_CHUNK)
                if not data:
                    with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await sink.send_eof()
                    return
                await self._throttle(len(data))
                await sink.send_all(data)
                self._bytes.inc(len(data))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, a, b)
                nursery.start_soon(copy, b, a)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # either side went away: the circuit ends, both sockets close


@asynccontextmanager
async def serve_relay(
    connections: Connections, config: RelayConfig | None = None
) -> AsyncIterator[Relay]:
    """Relay for unreachable peers until the block ends.

    Serves ``REGISTER`` streams and, when ``config.serve``, circuits on the
    port of ``connections`` (``Relay.port``). Leaving the block cancels every
    circuit and registration and stops serving circuits.
    """
    relay = Relay(config if config is not None else RelayConfig())
    connections.set_handler(REGISTER, relay.handle_register)
    async with trio.open_nursery() as nursery:
        if relay.config.serve:
            relay.port = connections.port

            async def handle(socket_stream: trio.SocketStream) -> None:
                # in this nursery, so that leaving the block ends every circuit
                done = trio.Event()

                async def serve() -> None:
                    try:
                        await relay.handle_tcp(socket_stream)
                    finally:
                        done.set()

                nursery.start_soon(serve)
                await done.wait()

            connections.set_raw_handler(handle)
        try:
            yield relay
        finally:
            connections.set_raw_handler(None)
            nursery.cancel_scope.cancel()


# The relayed peer's side.


async def keep_relay(
    connections: Connections,
    relay_peer: PeerID,
    relay_address: Address,
    *,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Register with the relay and take every circuit it offers, until the
    relay ends the registration or the connection is lost.

    Started with ``await nursery.start(keep_relay, ...)``, it reports the relay
    port address (host of ``relay_address``, the relay's port) that others
    pass to ``open_circuit``. Each circuit becomes an inbound connection of
    ``connections`` (its handshake and streams as if dialed directly). It
    pings the relay every keepalive interval the relay named (module
    docstring).

    Raises ``PeerUnreachableError`` if the relay refuses (the message says
    why) or cannot be reached, and the errors of ``Connections.open_stream``;
    after registering it returns when the relay ends the stream, raises
    ``PeerUnreachableError`` when the relay was silent for
    ``KEEPALIVE_MISSES`` keepalive intervals, and what a lost stream raises.
    Cancellation closes the register stream.
    """
    async with connections.open_stream(relay_peer, relay_address, REGISTER) as stream:
        relay_port, keepalive = decode_registered(await stream.receive(), relay_peer)
        circuit_address = (relay_address[0], relay_port)
        task_status.started(circuit_address)
        with collapse_exception_groups():
            async with trio.open_nursery() as nursery:
                if keepalive is not None:
                    nursery.start_soon(_ping, stream, keepalive)
                await _take_circuits(connections, stream, circuit_address, keepalive, nursery)
                nursery.cancel_scope.cancel()


def decode_registered(reply: Any, relay_peer: PeerID) -> tuple[int, float | None]:
    """The relay's answer to a registration: its circuit port and keepalive
    interval (None from a relay that predates keepalives). Raises
    ``PeerUnreachableError`` for a refusal and ``ProtocolError`` if malformed."""
    if not isinstance(reply, list) or len(reply) not in (2, 3):
        raise ProtocolError("relay register reply: expected a list of 2 or 3 items")
    kind = expect_str(reply[0], "relay register reply kind", max_size=16)
    if kind == "refused":
        raise PeerUnreachableError(f"relay {relay_peer.short()} refused: {_refused_reason(reply)}")
    if kind != "registered":
        raise ProtocolError(f"unexpected relay register reply {kind!r}")
    relay_port = expect_int(reply[1], "relay port", lo=1, hi=65535)
    if len(reply) == 2:
        return relay_port, None
    keepalive = expect_float(reply[2], "relay keepalive interval")
    lo, hi = _KEEPALIVE_RANGE
    if not lo <= keepalive <= hi:
        raise ProtocolError(f"relay keepalive interval {keepalive} is outside [{lo}, {hi}] s")
    return relay_port, keepalive


async def _ping(stream: Stream, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        await stream.send(["ping"])


async def _take_circuits(
    connections: Connections,
    stream: Stream,
    circuit_address: Address,
    keepalive: float | None,
    nursery: trio.Nursery,
) -> None:
    silence = math.inf if keepalive is None else KEEPALIVE_MISSES * keepalive
    while True:
        try:
            with trio.fail_after(silence):
                message = await stream.receive()
        except EndOfStreamError:
            return
        except trio.TooSlowError as e:
            raise PeerUnreachableError(
                f"the relay sent nothing for {silence:g} s ({KEEPALIVE_MISSES} keepalives)"
            ) from e
        if message == ["ping"]:
            continue
        message = expect_list(message, 2, "relay circuit")
        if expect_str(message[0], "relay message kind", max_size=16) != "circuit":
            raise ProtocolError(f"unexpected relay message {message[0]!r}")
        token = expect_bytes(message[1], "circuit token", size=TOKEN_SIZE)
        nursery.start_soon(_take_circuit, connections, circuit_address, token)


async def _take_circuit(connections: Connections, address: Address, token: bytes) -> None:
    try:
        with trio.fail_after(connections.config.connect_timeout):
            socket_stream = await trio.open_tcp_stream(*address)
    except (OSError, trio.TooSlowError) as e:
        logger.debug("cannot take a relay circuit at %s:%d: %s", *address, e)
        return
    try:
        await socket_stream.send_all(RAW_MAGIC + encode_preamble(["accept", token]))
    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
        socket_stream.socket.close()
        logger.debug("relay circuit lost before it began: %s", e)
        return
    connections.adopt_inbound(socket_stream)


# The dialer's side.


async def open_circuit(address: Address, peer_id: PeerID, *, timeout: float) -> trio.SocketStream:
    """A byte stream to ``peer_id`` through the relay port at ``address``; the
    caller runs the handshake over it (expecting ``peer_id``) and owns it.

    Raises ``PeerUnreachableError`` (the relay refused, is unreachable, or
    no answer within ``timeout``) or ``ProtocolError`` (a malformed reply).
    Cancellation closes the socket.
    """
    host, port = address
    try:
        with trio.fail_after(timeout):
            socket_stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError) as e:
        raise PeerUnreachableError(f"cannot reach the relay at {host}:{port}: {e}") from e
    try:
        with trio.fail_after(timeout):
            await socket_stream.send_all(RAW_MAGIC + encode_preamble(["connect", bytes(peer_id)]))
            reply = await receive_preamble(socket_stream)
        kind = expect_str(reply[0], "relay reply kind", max_size=16)
        if kind == "refused":
            raise PeerUnreachableError(
                f"the relay at {host}:{port} refused a circuit to {peer_id.short()}: "
                f"{_refused_reason(reply)}"
            )
        if kind != "ok":
            raise ProtocolError(f"unexpected relay reply {kind!r}")
    except trio.TooSlowError as e:
        socket_stream.socket.close()
        raise PeerUnreachableError(
            f"the relay at {host}:{port} gave no circuit to {peer_id.short()} within {timeout} s"
        ) from e
    except trio.BrokenResourceError as e:
        socket_stream.socket.close()
        raise PeerUnreachableError(f"the relay at {host}:{port} closed the circuit") from e
    except BaseException:
        socket_stream.socket.close()
        raise
    return socket_stream
