"""Authenticated, encrypted peer connections over trio TCP.

``open_connections`` listens on one TCP port and dials other peers on demand.
Every connection starts with the handshake of ``_handshake`` (each side proves
the Ed25519 key behind its peer id; session keys from ephemeral X25519) and
then carries the frames of ``_framing`` (AES-256-GCM, or GMAC-authenticated
plaintext when ``ConnectionConfig.encrypt`` is False).

Streams and connections. A stream is one bidirectional, ordered conversation
with a named handler on the remote peer. Streams are *pooled*, not multiplexed:
a connection carries one stream at a time, so TCP itself provides the flow
control and backpressure of every stream. The dialer opens a stream with an
OPEN frame naming the handler; the stream ends cleanly when both sides have
sent EOF, and the connection then returns to the dialer's pool. It is reused
for the next stream to that peer only after the listener's handler has
returned (a DONE frame), so a new stream never queues behind a handler that
might be waiting for it. A stream that ends any other way (an error, a
cancellation, a reset) closes its connection. Only the dialer opens streams on
a connection; the listener serves them, and when a handler fails it sends a
RESET with a one-line reason before closing.

Bulk frames (a batch of 128 KiB or more to send, or a frame with 128 KiB or
more of payload still to receive) move in worker threads (``_bulk_io``):
the thread seals or opens them and makes the system calls, so the trio
thread does not wait on the socket or the cryptography meanwhile; the
promises about cancellation below hold for them as for the rest. A caller
that knows the frames to come (a ring all-reduce's items) receives them all
in one worker thread (``Stream.receive_sequence``), which wakes the trio
thread once per batch of items.

Under packet loss: a dial not connected after ``REDIAL_AFTER`` is raced by
another (``open_tcp_racing``: a lost SYN otherwise waits TCP's initial 1 s
timeout; after a few round trips where a live connection to the same host
tells them, ``Connections._redial_after``), and each connection asks the
kernel to resend a lost segment after a round trip and 10-20 ms rather than
Linux's least 200 ms (``_shorten_retransmission_timer``): control messages
are one segment each.

Limits:

- ``max_frame_size``: a frame announcing more is a ``ProtocolError`` for the
  receiver, which drops the connection; sending more raises ``ValueError``.
- ``max_streams_per_peer``: a dialer never has more streams open to one peer:
  ``open_stream`` *waits* for a free slot (bounded by the caller's deadline).
  A listener refuses a stream beyond its limit (a peer configured differently)
  with a reset, which the dialer sees as ``StreamResetError``.
- ``max_connections``: inbound connections beyond it are closed at once,
  which the dialer sees as ``PeerUnreachableError``.
- ``max_connections_per_address``: so are inbound connections beyond it from
  one remote IP address, so that one host opening hundreds of connections
  cannot take every slot (it is refused before any handshake work is done).

Bans (``_bans``): a remote that proved its peer id and then broke the
protocol (a frame that does not authenticate or decode, a frame outside a
stream, a failed swarm-key proof after a valid signature) is banned locally;
so is a peer that a layer above reports with ``report_offence`` (a NaN or
malformed all-reduce part). Connections to and from a banned peer are refused:
dialing raises ``PeerUnreachableError``; an inbound connection is closed right
after its handshake proves who it is. A failure before the remote proved its
id (garbage, a bad signature) bans nobody: anyone could have sent it.
- ``idle_timeout``: the dialer closes a pooled connection idle this long; the
  listener drops a connection that has no stream for twice as long, so the
  dialer closes first and does not reuse a connection the listener is dropping.
  A connection punched through NATs (``_punch``) has no idle timeout, since
  nothing can make it again once its relay is gone: TCP keepalives keep the
  NATs' mappings and notice a remote that vanished. A stream to a peer with
  no relay route whose punched connections are all between streams (the end
  of the last one not confirmed yet) waits for one, up to
  ``connect_timeout``, before it dials.

Errors: ``PeerUnreachableError`` (refused, unreachable, connection lost),
``ProtocolError`` (the remote broke the protocol: bad handshake, identity other
than expected, failed authentication, oversized frame), ``DeadlineError`` (a
call or handshake ran out of time), ``ClosedError`` (we closed the stream or the
manager), ``StreamResetError`` (the remote aborted the stream),
``EndOfStreamError`` (the remote finished sending; not a failure).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import select
import socket
import struct
import termios
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio
from prometheus_client import Counter

from ._bans import BanList
from ._bulk_io import Batches, Stopped, Stopper, duplicate, run_in_thread, worker_batches
from ._counters import count_of, new_counter
from ._errors import (
    AuthenticationError,
    ClosedError,
    ConfigError,
    DeadlineError,
    EndOfStreamError,
    PeerUnreachableError,
    ProtocolError,
    StreamResetError,
    SwarmError,
)
from ._framing import (
    KEY_USAGE_LIMIT,
    MAX_FRAME_SIZE_LIMIT,
    Frame,
    FrameDecoder,
    FrameEncoder,
    FrameKind,
    Progress,
)
from ._handshake import Handshake, HandshakeResult, exported_key
from ._identity import Identity, PeerID
from ._relay import RAW_MAGIC, open_circuit
from ._wire import expect_list, expect_str, pack, unpack

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

Address = tuple[str, int]
#: Serves one stream opened by a remote peer. It runs in the manager's nursery;
#: an exception it raises resets and closes that stream only.
Handler = Callable[["Stream"], Awaitable[None]]
#: Serves an inbound connection that began with ``RAW_MAGIC`` (a relay's
#: circuits, ``_relay``): the socket after those bytes, closed when it returns.
RawHandler = Callable[[trio.SocketStream], Awaitable[None]]
#: Where the values of one item of a received sequence go (``Stream.receive_sequence``):
#: called in the worker thread with the item's raw header frame, it returns the
#: buffer its values frame must fill exactly (None: no values frame follows)
#: and what makes the item once they are there. Raises ``ProtocolError``.
Placement = Callable[[memoryview], tuple[memoryview | None, Callable[[], _T]]]

MAX_NAME_LENGTH = 256
_MIN_FRAME_SIZE = 1024
_MAX_RESET_REASON = 200
_HANDSHAKE_READ = 4096
#: Buffers up to this size are gathered into one send; needs below it read ahead.
_COALESCE = 64 * 1024
#: Most bytes of a large payload received with one system call.
_RECEIVE_SLICE = 512 * 1024
#: A large payload's receive sleeps until this much of it has arrived (or
#: all of it, if less remains): SO_RCVLOWAT. On a slow link bytes trickle in
#: a few packets at a time, and each batch woke the receiver for a system
#: call and a pass of the decoder: on 4 x 100 Mbit/s links (5M floats) a
#: peer made 3,300-3,800 reads of 27 KB on average per three rounds, and
#: with this 630 of 144 KB. 256 KiB is 20 ms at 100 Mbit/s; the kernel grows
#: the receive buffer to twice the mark, and wakes the receiver early anyway
#: when its window closes.
_RECEIVE_LOW_WATER = 256 * 1024
#: Unsent bytes a connection lets its kernel hold (TCP_NOTSENT_LOWAT): a
#: sender sleeps until fewer than half of them are left, then hands over up
#: to this many more. Without it, on a home link a bulk sender woke for
#: every 64 KB the link drained (one 45-segment write per wake-up): on 4 x
#: 100 Mbit/s links (5M floats) one peer's bulk threads made 1,007 writes
#: and 949 polls in 3 s of a round, 48 and 52 with this (strace), and the
#: CPU per peer and round fell from 0.18 to 0.16 s unpaced, 0.19 to 0.15 s
#: paced. 1 MiB is 80 ms of a 100 Mbit/s uplink: still queued far ahead of
#: the link.
_SEND_LOW_WATER = 2**20
#: Most buffers one gathering send passes to the kernel (IOV_MAX is 1024).
_MAX_GATHER = 512
#: Sends of at least this many payload bytes, and the rest of a frame whose
#: payload still owes at least this many, move in a worker thread
#: (``_bulk_io``): above it the thread's hand-over (tens of microseconds)
#: costs less than what the trio thread would spend on the bytes, and the
#: link no longer waits for the trio thread.
_BULK = 128 * 1024
#: How long a listener spends telling a dialer why its stream was reset.
_RESET_GRACE = 1.0


@dataclass(frozen=True)
class ConnectionConfig:
    """Limits and modes of a peer's connections; validated on construction.

    ``encrypt=False`` sends payloads in the clear, for trusted clusters where
    confidentiality is not needed, and keeps every other guarantee of the
    encrypted mode. What plaintext mode promises, against anyone on the path
    who can read, drop, inject or alter bytes: the remote is the peer whose id
    the signed handshake proved, and every byte of every frame (header and
    payload) that is delivered is exactly what that peer sent on this
    connection, in order, exactly once. Each frame header and each frame
    payload carries a GMAC tag (AES-GCM with the data as associated data,
    session keys from the handshake, a fresh nonce per tag): altering,
    injecting, replaying, reordering or splicing anything is detected with
    probability 1 - 2**-128 per attempt, raises ``ProtocolError`` and drops
    the connection, and nothing of a frame is delivered before its tag is
    verified (``Stream.receive_into`` writes unverified bytes into the
    caller's buffer, and says so). What it does not promise: secrecy of
    payloads (anyone on the path reads them; stream names, message sizes and
    timing leak in both modes). One tag per payload instead of one per 1 MiB
    costs the same bytes of GHASH (several GB/s) but lets payloads move
    between the socket and the caller's memory without a copy.

    A session is encrypted if either side asks (both flags are signed, so it
    cannot be downgraded). ``swarm_key`` makes this a private swarm: every
    handshake must prove it.

    Limits (defaults): ``max_connections`` (256) inbound connections in all,
    ``max_connections_per_address`` (64) inbound from one IP address,
    ``max_streams_per_peer`` (16) concurrent streams with one peer.
    """

    encrypt: bool = True
    max_frame_size: int = 8 * 2**20
    max_connections: int = 256
    max_connections_per_address: int = 64
    max_streams_per_peer: int = 16
    connect_timeout: float = 5.0
    handshake_timeout: float = 5.0
    idle_timeout: float = 60.0
    swarm_key: bytes | None = field(default=None, repr=False)  # a secret: never logged
    #: None (default): the kernel sizes each socket's buffers, growing them
    #: with the connection's bandwidth-delay product up to net.ipv4.tcp_rmem /
    #: tcp_wmem's maximum (Linux autotuning). A number fixes SO_SNDBUF and
    #: SO_RCVBUF to it, which turns autotuning *off* for that socket and is
    #: capped by net.core.wmem_max / rmem_max (the kernel doubles the value):
    #: on a stock system (rmem_max 208 KiB) a fixed buffer caps the receive
    #: window near 416 KiB, about 33 Mbit/s at 100 ms. Only for experiments.
    socket_buffer: int | None = None
    #: Send a ``NUDGE`` frame, as a segment of its own, behind each send of
    #: control frames (anything but raw ``BYTES``, under ``_BULK`` bytes), so
    #: that losing the send's last segment is seen from the nudge's
    #: acknowledgement within a round trip (RACK), not by a timer
    #: (``send_frames``). Raw payloads come in trains, each the next one's
    #: nudge.
    nudge: bool = True

    def __post_init__(self) -> None:
        if not _MIN_FRAME_SIZE <= self.max_frame_size <= MAX_FRAME_SIZE_LIMIT:
            raise ConfigError(
                f"max_frame_size={self.max_frame_size} must be in "
                f"[{_MIN_FRAME_SIZE}, {MAX_FRAME_SIZE_LIMIT}]"
            )
        if self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections} must be at least 1")
        if self.max_connections_per_address < 1:
            raise ConfigError(
                "max_connections_per_address="
                f"{self.max_connections_per_address} must be at least 1"
            )
        if self.max_streams_per_peer < 1:
            raise ConfigError(
                f"max_streams_per_peer={self.max_streams_per_peer} must be at least 1"
            )
        for name in ("connect_timeout", "handshake_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name}={value} must be a positive number of seconds")
        if self.socket_buffer is not None and not 4096 <= self.socket_buffer <= 2**30:
            raise ConfigError(
                f"socket_buffer={self.socket_buffer} must be None (kernel autotuning) "
                "or a byte count in [4096, 2**30]"
            )
        if self.swarm_key is not None and len(self.swarm_key) < 16:
            raise ConfigError("swarm_key must be at least 16 bytes (use 32 random bytes)")


def _consume(pending: list[bytes | memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of ``pending`` (what a ``writev`` wrote)."""
    done = 0
    while done < len(pending) and sent >= len(pending[done]):
        sent -= len(pending[done])
        done += 1
    del pending[:done]
    if sent:
        pending[0] = memoryview(pending[0]).cast("B")[sent:]


def _write_all(
    fd: int, buffers: list[bytes | memoryview], stopper: Stopper, count: Callable[[int], None]
) -> None:
    """Write ``buffers`` in order to the non-blocking ``fd`` from a worker
    thread, waiting with ``poll`` while the send buffer is full; ``count``
    gets the bytes of each write. Raises ``OSError``, ``Stopped``."""
    pending: list[bytes | memoryview] = [b for b in buffers if len(b)]
    while pending:
        stopper.check()
        try:
            sent = os.writev(fd, pending)
        except BlockingIOError:
            stopper.wait(fd, select.POLLOUT)
            continue
        count(sent)
        _consume(pending, sent)


class _Traffic:
    """Bytes a ``Connections`` object moved over TCP, both ways (handshakes,
    frame headers, tags and payloads: what the kernel accepted or delivered),
    kept in ``prometheus_client`` counters (``_counters``)."""

    __slots__ = ("received", "sent")

    def __init__(self) -> None:
        self.sent = new_counter("swarm_bytes_sent", "Bytes sent over peer connections")
        self.received = new_counter(
            "swarm_bytes_received", "Bytes received over peer connections"
        )


class _Connection:
    """One TCP connection after its handshake: whole frames in and out.

    Receiving is resumable: a cancelled ``receive_frame`` loses nothing, since
    the decoder keeps every byte received. A send that does not complete (error
    or cancellation) leaves a partial frame on the wire, so the connection is
    then ``broken`` and ``send_broken``: it must not carry anything more. A
    remote that breaks the protocol makes it ``broken`` too; the dialer closes
    it at once, the listener first tells the dialer why (``_reset``).
    """

    def __init__(
        self,
        stream: trio.SocketStream,
        result: HandshakeResult,
        config: ConnectionConfig,
        leftover: bytes,
        *,
        dialer: bool,
        traffic: _Traffic | None = None,
        relayed: bool = False,
    ) -> None:
        self._stream = stream
        #: carried by a relay's circuit (``_relay``): an authentication failure
        #: may be the relay's doing, so it closes the connection without a ban
        self.relayed = relayed
        #: made by a punch through NATs (``_punch``): nothing can dial it anew
        #: once the relay that coordinated it is gone
        self.punched = False
        self._traffic = traffic or _Traffic()
        self._dialer = dialer
        self.dialer = dialer
        self.socket = stream.socket
        self.remote = result.remote_peer
        #: the remote's (host, port) as this side sees it (behind a NAT: the NAT's)
        self.remote_address: Address = _remote_address(stream)
        self.encrypted = result.encrypt
        self.max_frame_size = config.max_frame_size
        self._encoder = FrameEncoder(
            result.send_key, encrypt=result.encrypt, max_frame_size=config.max_frame_size
        )
        self._decoder = FrameDecoder(
            result.receive_key, encrypt=result.encrypt, max_frame_size=config.max_frame_size
        )
        self._handshake_result = result
        self._pending: deque[Frame] = deque()
        self._failure: ProtocolError | None = None  # raised once the frames before it are out
        # Received bytes not yet decoded: ``_read_ahead[_ahead_start:_ahead_end]``.
        # They are decoded lazily, so that a payload they begin can still go
        # into the buffer of a later ``receive_frame(into)``.
        self._read_ahead = bytearray(max(_COALESCE, len(leftover)))
        self._read_ahead[: len(leftover)] = leftover  # frames pipelined behind the handshake
        self._ahead_start = 0
        self._ahead_end = len(leftover)
        self.broken = False  # never reuse for another stream
        self.send_broken = False  # a partial frame went out: send nothing more
        self.receive_error: ProtocolError | None = None
        self.blamed = False  # the remote was already reported for this connection
        self.closed = False
        self._send_lock = trio.StrictFIFOLock()
        self._receiving = False
        self._workers: set[Stopper] = set()  # bulk transfers in worker threads now
        self._low_water = 1  # the socket's SO_RCVLOWAT (the kernel's default)
        with suppress(OSError):  # without it, a sender only wakes more often
            self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _SEND_LOW_WATER)
        self._nudge = config.nudge
        if config.socket_buffer is not None:  # disables autotuning: see ConnectionConfig
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with suppress(OSError):
                    self.socket.setsockopt(socket.SOL_SOCKET, option, config.socket_buffer)

    def close(self) -> None:
        """Close the socket now (synchronous, so it is safe in any cleanup path).

        A task blocked in a send or receive on it gets ``ClosedError``; a
        worker thread moving a bulk payload (``_bulk_io``) stops before its
        next system call, and the connection ends when it has.
        """
        self.closed = True
        for stopper in list(self._workers):
            stopper.stop()
        self.socket.close()

    def export_key(self, label: bytes) -> bytes:
        """``_handshake.exported_key`` of this connection's session."""
        return exported_key(self._handshake_result, dialer=self._dialer, label=label)

    async def send_frame(self, kind: FrameKind, payload: bytes | bytearray | memoryview) -> None:
        await self.send_frames([(kind, payload)])

    async def send_frames(
        self, frames: list[tuple[FrameKind, bytes | bytearray | memoryview]]
    ) -> None:
        """Send whole frames, in order; small ones leave in one system call.

        Sends from several tasks are serialized frame batch by frame batch.
        ``ValueError`` for a payload over ``max_frame_size`` (nothing is sent).
        """
        if self.closed:
            raise ClosedError("the connection was closed")
        if self.send_broken:
            raise ClosedError("the stream is unusable: an earlier send did not complete")
        self.check_sizes(frames)
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._send_lock.acquire_nowait()  # uncontended: no extra scheduling round
        except trio.WouldBlock:
            await self._send_lock.acquire()
        completed = False
        try:
            if sum(memoryview(payload).nbytes for _, payload in frames) >= _BULK:
                await self._send_in_thread(frames)
                completed = True
                return
            gathered: list[bytes | memoryview] = []
            for kind, payload in frames:
                for batch in self._encoder.encode_batches(kind, payload):
                    gathered += batch
                    # A large buffer may be the encoder's scratch, which the
                    # next batch overwrites: send everything up to it now.
                    if len(gathered) >= _MAX_GATHER or any(len(b) > _COALESCE for b in batch):
                        await self._send_gathered(gathered)
                        gathered = []
            if gathered:
                await self._send_gathered(gathered)
            if self._nudge and any(kind is not FrameKind.BYTES for kind, _ in frames):
                # A system call of its own, so that it leaves as a segment of
                # its own (``ConnectionConfig.nudge``)
                await self._send_gathered([self._encoder.nudge()])
            completed = True
        except trio.ClosedResourceError as e:
            raise ClosedError("the connection was closed") from e
        except Stopped as e:
            if not self.closed:  # stopped for a cancellation, which this raises
                await trio.lowlevel.checkpoint()
            raise ClosedError("the connection was closed") from e
        except OSError as e:
            if self.closed:
                raise ClosedError("the connection was closed") from e
            raise PeerUnreachableError(f"connection to {self.remote.short()} lost: {e}") from e
        finally:
            self._send_lock.release()
            if not completed:
                self.broken = self.send_broken = True
            else:
                await trio.lowlevel.cancel_shielded_checkpoint()

    async def _send_in_thread(
        self, frames: list[tuple[FrameKind, bytes | bytearray | memoryview]]
    ) -> None:
        """Seal and write ``frames`` in a worker thread (``_bulk_io``): the
        trio thread neither encrypts nor waits on this socket meanwhile.
        Raises ``OSError``, or ``Stopped`` if cancelled or closed meanwhile."""
        if self.closed:
            raise trio.ClosedResourceError("the connection was closed")
        sock = duplicate(self.socket)
        encoder, count = self._encoder, self._traffic.sent.inc

        def send(stopper: Stopper) -> None:
            fd = sock.fileno()
            gathered: list[bytes | memoryview] = []
            for kind, payload in frames:
                for batch in encoder.encode_batches(kind, payload):
                    gathered += batch
                    if len(gathered) >= _MAX_GATHER or any(len(b) > _COALESCE for b in batch):
                        _write_all(fd, gathered, stopper, count)
                        gathered = []
            if gathered:
                _write_all(fd, gathered, stopper, count)

        try:
            await run_in_thread(send, self._workers)
        finally:
            sock.close()

    async def _send_gathered(self, buffers: list[bytes | memoryview]) -> None:
        """Send ``buffers`` in order with as few (gathering) system calls as the
        kernel's buffer allows.

        It calls the kernel directly and waits only when the send buffer is
        full: trio's ``sendmsg`` adds a scheduling round to every call that
        succeeds, which for a large frame sent in pieces was most of the
        per-frame cost. The caller provides the checkpoint.
        """
        pending: list[bytes | memoryview] = [b for b in buffers if len(b)]
        while pending:
            try:
                sent = os.writev(self.socket.fileno(), pending)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.socket)
                continue
            self._traffic.sent.inc(sent)
            _consume(pending, sent)

    async def _receive_into(self, buffer: memoryview, low_water: int = 1) -> int:
        """Receive at least one byte into ``buffer`` (0: the remote closed).

        As ``_send_gathered``: one system call when data is waiting, a wait
        only when none is; the caller provides the checkpoint. A wait lasts
        until ``low_water`` bytes have arrived (or the remote closed, or the
        receive window closed): the caller must be owed at least that many.
        """
        while True:
            try:
                return os.readv(self.socket.fileno(), [buffer])
            except BlockingIOError:
                if low_water != self._low_water:
                    with suppress(OSError):  # without it, it only wakes up more often
                        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, low_water)
                        self._low_water = low_water
                await trio.lowlevel.wait_readable(self.socket)

    def pace(self, rate: float | None) -> None:
        """``Stream.pace``: Linux paces a TCP socket itself (without the fq
        qdisc) once it has a cap; ~0 (u32) means none."""
        value = _UNPACED if rate is None else max(1, min(int(rate), _UNPACED - 1))
        with suppress(OSError):
            self.socket.setsockopt(
                socket.SOL_SOCKET, _SO_MAX_PACING_RATE, struct.pack("=I", value)
            )

    def unacknowledged_bytes(self) -> int:
        """Bytes handed to the kernel that the remote has not acknowledged yet
        (queued or in flight: Linux's SIOCOUTQ); 0 where that cannot be read."""
        if self.closed:
            return 0
        try:
            raw = fcntl.ioctl(self.socket.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        except OSError:
            return 0
        return max(0, int(struct.unpack("i", raw)[0]))

    def queueing_delay(self) -> float | None:
        """``Stream.queueing_delay``."""
        return None if self.closed else _queueing_delay(self.socket)

    def check_sizes(self, frames: list[tuple[FrameKind, bytes | bytearray | memoryview]]) -> None:
        """``ValueError`` if a payload exceeds ``max_frame_size``."""
        for _, payload in frames:
            size = memoryview(payload).nbytes
            if size > self.max_frame_size:
                raise ValueError(
                    f"frame of {size} bytes exceeds max_frame_size={self.max_frame_size}"
                )

    def _decode_ahead(
        self, into: memoryview | None, progress: Progress | None = None
    ) -> Frame | None:
        """Decode read-ahead bytes up to the end of the next frame, if they
        hold it. Raises ``ProtocolError`` (the connection is then failed)."""
        return self._decode(lambda: self._take_ahead(into, progress))

    def _take_ahead(self, into: memoryview | None, progress: Progress | None) -> Frame | None:
        """``_decode_ahead`` without failing the connection (a worker thread's)."""
        decoder = self._decoder
        with memoryview(self._read_ahead) as ahead:
            while self._ahead_start < self._ahead_end:
                buffer = decoder.next_buffer(into, progress)
                start = self._ahead_start
                count = min(buffer.nbytes, self._ahead_end - start)
                buffer[:count] = ahead[start : start + count]
                buffer.release()
                self._ahead_start = start + count
                frame = decoder.advance(count)
                if frame is not None:
                    return frame
        self._ahead_start = self._ahead_end = 0
        return None

    @property
    def worn_out(self) -> bool:
        """Its keys protected ``KEY_USAGE_LIMIT`` bytes: finish the stream, then
        replace the connection (a new handshake brings new keys)."""
        return self._encoder.payload_bytes + self._decoder.payload_bytes > KEY_USAGE_LIMIT

    def has_pending_frames(self) -> bool:
        """Whether a whole frame has arrived and not been received yet."""
        if not self._pending and self._failure is None and self._ahead_start < self._ahead_end:
            try:
                frame = self._decode_ahead(None)
            except ProtocolError as e:
                self._failure = e  # raised once the frames before it are out
                return True
            if frame is not None:
                self._pending.append(frame)
        return bool(self._pending) or self._failure is not None

    async def receive_frame(
        self, into: memoryview | None = None, progress: Progress | None = None
    ) -> Frame:
        """The next frame. Cancellation loses nothing: the next call resumes.

        ``into``: if the next frame is a ``BYTES`` frame that fits, its payload
        is received straight into ``into`` and the frame's payload is a view of
        it, and ``progress`` watches it arrive (see ``FrameDecoder.next_buffer``).
        After an error or cancellation, ``into`` holds undefined bytes, and it
        is not used any more.
        """
        if self._pending:
            await trio.lowlevel.checkpoint()
            return self._pending.popleft()
        if self._failure is not None:
            await trio.lowlevel.checkpoint()
            raise ProtocolError(str(self._failure)) from self._failure
        if self.closed:
            raise ClosedError("the connection was closed")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        # The one checkpoint of a frame that has arrived (``_receive_into``
        # yields only to wait), before anything is decoded: nothing is lost.
        await trio.lowlevel.checkpoint()
        self._receiving = True
        try:
            while True:
                if self._ahead_start < self._ahead_end:
                    frame = self._decode_ahead(into, progress)
                    if frame is not None:
                        return frame
                buffer, read_ahead = self._read_target(
                    self._decode(lambda: self._decoder.next_buffer(into, progress))
                )
                if not read_ahead and buffer.nbytes >= _BULK:
                    buffer.release()
                    frame = await self._receive_in_thread(into, progress)
                    if frame is not None:
                        return frame
                    await trio.lowlevel.checkpoint()  # cancelled: raises here
                    continue
                # every byte of a payload's buffer is owed: sleep until many came
                low_water = 1 if read_ahead else min(buffer.nbytes, _RECEIVE_LOW_WATER)
                try:
                    count = await self._receive_into(buffer, low_water)
                except trio.ClosedResourceError as e:
                    raise ClosedError("the connection was closed") from e
                except OSError as e:
                    if self.closed:
                        raise ClosedError("the connection was closed") from e
                    self.broken = True
                    raise PeerUnreachableError(
                        f"connection to {self.remote.short()} lost: {e}"
                    ) from e
                finally:
                    buffer.release()
                self._traffic.received.inc(count)
                if count == 0:
                    self.broken = True
                    raise PeerUnreachableError(f"{self.remote.short()} closed the connection")
                if read_ahead:
                    self._ahead_start, self._ahead_end = 0, count
                else:
                    frame = self._decode(lambda: self._decoder.advance(count))  # noqa: B023
                    if frame is not None:
                        return frame
        finally:
            self._receiving = False
            if into is not None:
                self._decoder.release(into)

    async def _receive_in_thread(
        self, into: memoryview | None, progress: Progress | None
    ) -> Frame | None:
        """Receive and open the rest of the current frame in a worker thread
        (``_bulk_io``); None if cancelled first (the decoder keeps what came,
        and the next call resumes). Raises what ``receive_frame`` raises."""
        if self.closed:
            raise ClosedError("the connection was closed")
        sock = duplicate(self.socket)
        decoder, count = self._decoder, self._traffic.received.inc

        def receive(stopper: Stopper) -> Frame | None:
            fd = sock.fileno()
            while not stopper.stopped:
                # straight into place to the frame's end: the read-ahead
                # buffer is the trio thread's (``_read_target``)
                buffer = decoder.next_buffer(into, progress)
                if buffer.nbytes > _RECEIVE_SLICE:
                    buffer = buffer[:_RECEIVE_SLICE]
                try:
                    received = os.readv(fd, [buffer])
                except BlockingIOError:
                    self._wait_for_bytes(sock, min(buffer.nbytes, _RECEIVE_LOW_WATER), stopper)
                    continue
                finally:
                    buffer.release()
                count(received)
                if received == 0:
                    raise PeerUnreachableError(f"{self.remote.short()} closed the connection")
                frame = decoder.advance(received)
                if frame is not None:
                    return frame
            return None

        try:
            frame = await run_in_thread(receive, self._workers)
            if self.closed:
                raise ClosedError("the connection was closed")
            return frame
        except ProtocolError as e:
            self.fail_receive(e)
            raise
        except PeerUnreachableError:
            self.broken = True
            raise
        except OSError as e:
            if self.closed:
                raise ClosedError("the connection was closed") from e
            self.broken = True
            raise PeerUnreachableError(f"connection to {self.remote.short()} lost: {e}") from e
        finally:
            sock.close()

    @asynccontextmanager
    async def receive_sequence(
        self, count: int, place: Placement[_T], window: int
    ) -> AsyncIterator[Batches[_T]]:
        """``Stream.receive_sequence``'s worker (``_bulk_io.worker_batches``).
        It returns early where a frame that is not raw bytes comes, which it
        puts back as the next frame to receive; it raises ``OSError``,
        ``ProtocolError``, ``PeerUnreachableError``, ``Stopped`` (closed) or
        what ``place`` or an item's completion raise, through ``next_batch``.
        A sequence left before its last item breaks the connection: the rest
        of its frames could not be told apart from a later stream's."""
        if self.closed:
            raise ClosedError("the connection was closed")
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        sock = duplicate(self.socket)
        received = [0]

        def work(batches: Batches[_T]) -> None:
            try:
                self._receive_items(sock, count, place, batches, received)
            finally:
                self._receiving = False  # before the trio thread hears that it returned

        self._receiving = True
        try:
            async with worker_batches(work, self._workers, window) as batches:
                yield batches
        finally:
            self._receiving = False
            sock.close()
            if received[0] < count and not self._pending:
                self.broken = True

    def _receive_items(
        self,
        sock: socket.socket,
        count: int,
        place: Placement[_T],
        batches: Batches[_T],
        received: list[int],
    ) -> None:
        """The loop of ``receive_sequence``'s worker thread."""
        fd = sock.fileno()
        for _ in range(count):
            frame = self._next_frame_blocking(fd, sock, None, batches.stopper)
            if frame.kind is not FrameKind.BYTES:
                self._pending.appendleft(frame)
                return
            into, complete = place(memoryview(frame.payload).cast("B"))
            if into is not None:
                frame = self._next_frame_blocking(fd, sock, into, batches.stopper)
                if frame.kind is not FrameKind.BYTES:
                    self._pending.appendleft(frame)
                    return
                payload = frame.payload
                if not isinstance(payload, memoryview) or payload.nbytes != into.nbytes:
                    raise ProtocolError(
                        f"{self.remote.short()} sent a raw frame of {len(payload)} bytes,"
                        f" {into.nbytes} expected"
                    )
            batches.put(complete())
            received[0] += 1

    async def next_items(self, batches: Batches[_T]) -> list[_T]:
        """``batches.next_batch()``, its worker's failures as ``receive_frame``
        raises them."""
        try:
            return await batches.next_batch()
        except ProtocolError as e:
            self.fail_receive(e)
            raise
        except PeerUnreachableError:
            self.broken = True
            raise
        except Stopped as e:
            raise ClosedError("the connection was closed") from e
        except OSError as e:
            if self.closed:
                raise ClosedError("the connection was closed") from e
            self.broken = True
            raise PeerUnreachableError(f"connection to {self.remote.short()} lost: {e}") from e

    def _next_frame_blocking(
        self, fd: int, sock: socket.socket, into: memoryview | None, stopper: Stopper
    ) -> Frame:
        """``receive_frame`` in a worker thread, on the duplicate ``sock``,
        waiting with ``poll``; ``Stopped`` if asked to stop (``into`` is then
        released: the decoder keeps what came in its own memory)."""
        if self._pending:
            return self._pending.popleft()
        if self._failure is not None:
            raise ProtocolError(str(self._failure)) from self._failure
        decoder = self._decoder
        try:
            while True:
                if self._ahead_start < self._ahead_end:
                    frame = self._take_ahead(into, None)
                    if frame is not None:
                        return frame
                buffer, read_ahead = self._read_target(decoder.next_buffer(into))
                try:
                    stopper.check()
                    received = os.readv(fd, [buffer])
                except BlockingIOError:
                    want = 1 if read_ahead else min(buffer.nbytes, _RECEIVE_LOW_WATER)
                    self._wait_for_bytes(sock, want, stopper)
                    continue
                finally:
                    buffer.release()
                self._traffic.received.inc(received)
                if received == 0:
                    raise PeerUnreachableError(f"{self.remote.short()} closed the connection")
                if read_ahead:
                    self._ahead_start, self._ahead_end = 0, received
                else:
                    frame = decoder.advance(received)
                    if frame is not None:
                        return frame
        finally:
            if into is not None:
                decoder.release(into)

    def _read_target(self, wanted: memoryview) -> tuple[memoryview, bool]:
        """Where the next read goes, for the decoder's ``wanted`` buffer, and
        whether that is the read-ahead buffer. A small need (a header, a tag,
        a short message) reads whatever has arrived into the read-ahead
        buffer, often several whole frames at once; a large payload is
        received straight into place, in slices that stay in the CPU's cache
        until the decoder has authenticated them (``FrameDecoder.advance``)."""
        if wanted.nbytes < _COALESCE:
            wanted.release()
            return memoryview(self._read_ahead), True
        if wanted.nbytes > _RECEIVE_SLICE:
            whole, wanted = wanted, wanted[:_RECEIVE_SLICE]
            whole.release()
        return wanted, False

    def _wait_for_bytes(self, sock: socket.socket, want: int, stopper: Stopper) -> None:
        """In a worker thread, on ``sock`` (a duplicate of this connection's
        socket): sleep until ``want`` bytes have arrived (``SO_RCVLOWAT``, as
        ``_receive_into``), the remote closed, or the worker is asked to stop.
        One thread at a time receives on a connection, so the worker keeps
        ``_low_water``."""
        if want != self._low_water:
            with suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                self._low_water = want
        stopper.wait(sock.fileno(), select.POLLIN)

    def _decode(self, step: Callable[[], _T]) -> _T:
        try:
            return step()
        except ProtocolError as e:
            self.fail_receive(e)
            raise

    def fail_receive(self, error: ProtocolError) -> None:
        """The remote broke the protocol: never reuse; a dialer closes now."""
        self.broken = True
        self.receive_error = error
        if self._dialer:
            self.close()

    async def linger(self) -> None:
        """Half-close, then discard input until the remote closes.

        Closing a socket with unread input makes the kernel send a TCP reset,
        which can destroy our last frame before the remote reads it; reading
        the input away first lets that frame (a reset reason) arrive.
        Bounded by the caller's deadline.
        """
        with suppress(OSError):
            self.socket.shutdown(socket.SHUT_WR)
        sink = bytearray(65536)
        with suppress(OSError, trio.ClosedResourceError):
            while count := await self.socket.recv_into(sink):
                self._traffic.received.inc(count)


class Stream:
    """One bidirectional, ordered, authenticated stream with a remote peer.

    ``remote`` is the peer id the handshake proved. One task may send while
    another receives; sends from several tasks are serialized whole frames at a
    time, while two concurrent receives raise ``trio.BusyResourceError``. A
    cancelled ``receive`` loses nothing and may be retried; a cancelled send
    breaks the stream (its connection is closed when the stream ends, and later
    sends raise ``ClosedError``).

    """

    def __init__(self, connection: _Connection, name: str, *, opening: bytes | None = None) -> None:
        self._connection = connection
        self._opening = opening  # the dialer's OPEN payload, until it is sent
        self.remote: PeerID = connection.remote
        #: where the remote's packets come from, as this side sees them
        self.remote_address: Address = connection.remote_address
        self.name = name
        self._sent_eof = False
        self._received_eof = False
        self._reset: str | None = None
        self._closed = False
        self._done = False  # dialer: the listener's handler has returned
        self._unread = 0  # dialer: messages left for the pool to discard (``leave_unread``)

    def export_key(self, label: bytes) -> bytes:
        """A 32-byte key bound to this stream's session and ``label``; the
        remote end derives the same (``_handshake.exported_key``). Keys of
        streams on other connections differ: put a fresh value in ``label``
        where a key must not repeat across streams."""
        return self._connection.export_key(label)

    @property
    def ended_cleanly(self) -> bool:
        """True once we sent EOF and nothing went wrong; the remote may not
        have ended the stream yet."""
        c = self._connection
        return (
            self._sent_eof
            and self._reset is None
            and not self._closed
            and not c.broken
            and not c.closed
        )

    @property
    def finished_cleanly(self) -> bool:
        """True once both sides sent EOF and nothing went wrong."""
        return self._received_eof and self.ended_cleanly

    def _check_send(self) -> None:
        if self._closed:
            raise ClosedError("the stream was closed")
        if self._reset is not None:
            raise StreamResetError(f"{self.remote.short()} reset the stream: {self._reset}")
        if self._sent_eof:
            raise ClosedError("send after send_eof")

    async def send(self, message: Any) -> None:
        """Send one msgpack-able object (``ValueError`` if it is not, or too big).

        Raises ``PeerUnreachableError`` if the connection is lost, ``ClosedError``
        if we closed the stream or sent EOF, ``StreamResetError`` after a reset.
        """
        self._check_send()
        data = pack(message, max_size=self._connection.max_frame_size)
        await self._send([(FrameKind.MESSAGE, data)])

    async def send_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """Send a raw payload frame, delivered to ``receive`` as ``bytes``.

        The payload is sent in place (no copy in plaintext mode; one encrypted
        copy per 1 MiB otherwise). At most ``max_frame_size`` bytes, else
        ``ValueError``; the errors are those of ``send``.
        """
        self._check_send()
        await self._send([(FrameKind.BYTES, data)])

    async def send_bytes_batch(self, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        """Send each buffer as one raw frame, as ``send_bytes`` does, in order
        and in as few system calls as possible (a small header and the large
        payload behind it leave together). The errors are those of ``send``.
        """
        self._check_send()
        await self._send([(FrameKind.BYTES, data) for data in frames])

    def pace(self, rate: float | None) -> None:
        """Cap what this stream's connection sends at ``rate`` bytes per
        second (``SO_MAX_PACING_RATE``), or lift the cap (None). The cap
        holds for the connection until lifted: lift it before the stream
        ends, or the pooled connection keeps it for the next stream. A
        kernel without the option sends unpaced."""
        self._connection.pace(rate)

    def unacknowledged_bytes(self) -> int:
        """Bytes sent on this stream's connection that the remote's kernel has
        not acknowledged yet (0 where the platform cannot tell). What a send
        handed over minus the growth of this is what crossed the link meanwhile
        (``averaging._link_meter``)."""
        return self._connection.unacknowledged_bytes()

    def queueing_delay(self) -> float | None:
        """How long this stream's packets wait in queues on the way to the
        remote, in seconds: the connection's smoothed round trip less its
        least (``TCP_INFO``); None where the kernel does not say. A sender
        that outruns a slow link builds a queue at it, which this shows
        (``averaging._link_meter``: whether pacing would help)."""
        return self._connection.queueing_delay()

    def leave_unread(self, messages: int) -> None:
        """Dialer: the remote still sends ``messages`` messages (not raw
        frames) before its EOF that this stream leaves without reading. Once the stream ends, its
        pooled connection discards them (those and no more) rather than
        being closed for them, and is reused when the remote's EOF and DONE
        arrive as usual.

        Why: a last message that only confirms what the caller knows already
        (the lossy round's end-of-results marker, when the last result
        datagram came first) would otherwise be waited for before leaving: on
        a link that lost it, a retransmission timeout or more on the caller's
        critical path, or, waited for less, a connection closed and dialled
        again later. ``ValueError`` for a negative count."""
        if messages < 0:
            raise ValueError(f"messages={messages} must be at least 0")
        self._unread = messages

    async def send_eof(self) -> None:
        """Tell the remote we will send nothing more; idempotent."""
        if self._sent_eof:
            await trio.lowlevel.checkpoint()
            return
        self._check_send()
        await self._send([(FrameKind.EOF, b"")])
        self._sent_eof = True

    async def _send_last(self, message: Any) -> None:
        """``send(message)`` then ``send_eof()``, in one system call."""
        self._check_send()
        data = pack(message, max_size=self._connection.max_frame_size)
        await self._send([(FrameKind.MESSAGE, data), (FrameKind.EOF, b"")])
        self._sent_eof = True

    async def _send(self, frames: list[tuple[FrameKind, bytes | bytearray | memoryview]]) -> None:
        self._connection.check_sizes(frames)  # before OPEN is taken: nothing is sent
        if self._opening is not None:
            frames = [(FrameKind.OPEN, self._opening), *frames]
            self._opening = None
        await self._connection.send_frames(frames)

    async def receive(self) -> Any:
        """The next message: a decoded msgpack object, or ``bytes`` for a raw frame.

        Raises ``EndOfStreamError`` once the remote has sent EOF (and on every
        later call), ``StreamResetError`` if the remote aborted the stream,
        ``ProtocolError`` if it broke the protocol (the connection is dropped),
        ``PeerUnreachableError`` if the connection is lost, ``ClosedError`` if
        we closed it. Cancellation loses nothing: the next call resumes.
        """
        frame = await self._receive_frame(None)
        if frame.kind is FrameKind.BYTES:
            return frame.payload
        return self._unpack(bytes(frame.payload))

    async def receive_into(
        self, buffer: bytearray | memoryview, progress: Progress | None = None
    ) -> int:
        """Receive the next message, which must be a raw frame, into ``buffer``;
        return its size (it is in ``buffer[:size]``).

        ``progress(view, done)``, if given, is called as the payload arrives
        piece by piece: the first ``done`` bytes of ``view`` (the frame's
        bytes in ``buffer``) are in place, though in plaintext sessions not yet
        authenticated. It can inspect each piece right after it lands (in
        encrypted sessions, just decrypted and still in the CPU's cache). It
        only looks and must not raise, and it may not see every byte (a
        payload that arrived before this call, or resumed after a
        cancellation): the caller inspects the rest after the call.

        The payload goes from the socket straight into ``buffer`` (plaintext
        mode), or is decrypted into it: no copy. Raises ``ProtocolError`` if
        the next message is not raw bytes or is larger than ``buffer`` (the
        remote broke our protocol: the connection is dropped), and otherwise
        the errors of ``receive``. After an error or a cancellation the
        contents of ``buffer`` are undefined, but nothing is lost: the next
        ``receive`` or ``receive_into`` resumes with the same frame.
        """
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise TypeError("receive_into needs a writable buffer")
        frame = await self._receive_frame(view, progress)
        payload = frame.payload
        if frame.kind is FrameKind.BYTES:
            size = len(payload)
            if isinstance(payload, memoryview):  # it is already in ``buffer``
                return size
            if size <= view.nbytes:
                view[:size] = payload
                return size
            what = f"a raw frame of {size} bytes, more than the {view.nbytes} expected"
        else:
            what = "a message where raw bytes were expected"
        error = ProtocolError(f"{self.remote.short()} sent {what}")
        self._connection.fail_receive(error)
        raise error

    @asynccontextmanager
    async def receive_sequence(
        self, count: int, place: Placement[_T], *, window: int = 8
    ) -> AsyncIterator[ReceivedItems[_T]]:
        """Receive ``count`` items in one worker thread, for the body of the
        ``async with`` to take in batches (``ReceivedItems.next_batch``).

        An item is a raw frame (its header) and, where ``place(header)``
        returns a buffer, a raw frame that fills that buffer exactly (its
        values, received straight into it); ``place``'s second value makes
        the item. Both run in the worker thread, so they must not touch trio
        objects, and what they raise (``ProtocolError`` for a header that
        breaks the caller's protocol) ends the sequence. The worker runs at
        most ``window`` items ahead of what was taken.

        Why: ``receive`` and ``receive_into`` hand each large frame to a
        worker thread and back (``_bulk_io.run_in_thread``) and decode each
        header on the trio thread; for an all-reduce's chunks that was most
        of the trio thread's work per chunk. Here the trio thread wakes once
        per batch of items, whatever their number of frames.

        Errors, from ``next_batch``: those of ``receive_into``, and
        ``ProtocolError`` for a values frame of another size. Leaving the
        ``async with`` (also by an error or a cancellation) stops the worker
        and waits for it; left before the last item, the stream is broken
        (its connection is closed when the stream ends)."""
        await self._ready_to_receive()
        async with self._connection.receive_sequence(count, place, window) as batches:
            yield ReceivedItems(self, batches, count)

    async def _ready_to_receive(self) -> None:
        """Raise what a receive on this stream must raise now (closed, reset,
        ended); else send its opening first if it has not gone yet."""
        if self._closed:
            raise ClosedError("the stream was closed")
        if self._reset is not None:
            raise StreamResetError(f"{self.remote.short()} reset the stream: {self._reset}")
        if self._received_eof:
            await trio.lowlevel.checkpoint()
            raise EndOfStreamError(f"{self.remote.short()} ended the stream")
        if self._opening is not None:
            await self._send([])

    async def _receive_frame(
        self, into: memoryview | None, progress: Progress | None = None
    ) -> Frame:
        """The next ``BYTES`` or ``MESSAGE`` frame; raises for the others."""
        await self._ready_to_receive()
        frame = await self._connection.receive_frame(into, progress)
        if frame.kind is FrameKind.BYTES or frame.kind is FrameKind.MESSAGE:
            return frame
        if frame.kind is FrameKind.EOF:
            self._received_eof = True
            raise EndOfStreamError(f"{self.remote.short()} ended the stream")
        if frame.kind is FrameKind.RESET:
            reason = self._unpack(bytes(frame.payload))
            self._reset = reason[:_MAX_RESET_REASON] if isinstance(reason, str) else "(no reason)"
            self._connection.close()
            raise StreamResetError(f"{self.remote.short()} reset the stream: {self._reset}")
        error = ProtocolError(f"{self.remote.short()} sent {frame.kind.name} inside a stream")
        self._connection.fail_receive(error)
        raise error

    def _unpack(self, payload: bytes) -> Any:
        try:
            return unpack(payload, max_size=self._connection.max_frame_size)
        except ProtocolError as e:
            self._connection.fail_receive(e)
            raise

    async def _wait_done(self) -> None:
        """Dialer, after both EOFs: wait until the remote handler has returned.

        Raises ``StreamResetError`` if the handler failed after ending the
        stream, ``ProtocolError`` for any other frame.
        """
        frame = await self._connection.receive_frame()
        if frame.kind is FrameKind.DONE:
            self._done = True
            return
        if frame.kind is FrameKind.RESET:
            reason = self._unpack(bytes(frame.payload))
            self._reset = reason[:_MAX_RESET_REASON] if isinstance(reason, str) else "(no reason)"
            self._connection.close()
            raise StreamResetError(f"{self.remote.short()} reset the stream: {self._reset}")
        error = ProtocolError(f"{self.remote.short()} sent {frame.kind.name} after its EOF")
        self._connection.fail_receive(error)
        raise error

    async def aclose(self) -> None:
        """End the stream. Unless both sides had sent EOF, this closes its
        connection, which the remote sees as a lost connection. Later
        operations raise ``ClosedError``. Idempotent; never blocks.
        """
        if not self._closed:
            if not self.finished_cleanly:
                self._connection.close()
            self._closed = True
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        return f"Stream({self.name!r}, remote={self.remote.short()})"


class ReceivedItems(Generic[_T]):
    """The items of one ``Stream.receive_sequence`` as its worker makes them."""

    def __init__(self, stream: Stream, batches: Batches[_T], count: int) -> None:
        self._stream = stream
        self._batches = batches
        self._left = count

    @property
    def wake_ups(self) -> int:
        """How often the worker woke the trio thread so far."""
        return self._batches.wake_ups

    async def next_batch(self) -> list[_T]:
        """The items that arrived since the last call, in order, at least
        one, waiting for one if none has; ``[]`` after the last. Raises
        (after the items before the failure) what ``Stream.receive_sequence``
        says. Cancellation loses nothing."""
        items = await self._stream._connection.next_items(self._batches)
        self._left -= len(items)
        if not items and self._left:
            # the worker stopped at a frame that is not raw bytes: an EOF, a
            # reset or a message, which receive raises as usual
            await self._stream._receive_frame(None)
            error = ProtocolError(f"{self._stream.remote.short()} sent a message inside a sequence")
            self._stream._connection.fail_receive(error)
            raise error
        return items


@dataclass
class _Pooled:
    connection: _Connection
    eof: bool  # the remote ended the stream (its EOF arrived)
    ready: bool  # the listener's handler returned (DONE arrived): reusable now
    scope: trio.CancelScope  # the idle watcher's, cancelled to take the connection
    done: trio.Event  # the idle watcher has exited
    settled: trio.Event = field(default_factory=trio.Event)  # ready, or the watcher exited
    unread: int = 0  # messages of the last stream still to discard before the EOF


class Connections:
    """The connections of one peer: its listener, its handlers, its dial pool.

    Made by ``open_connections``, which owns its tasks; do not construct it.
    """

    def __init__(self, identity: Identity, config: ConnectionConfig, bans: BanList) -> None:
        self._identity = identity
        self._config = config
        self.bans = bans
        self._inbound_by_host: dict[str, int] = {}
        self._refused_inbound = new_counter(
            "swarm_inbound_refused", "Inbound connections closed at once for a limit"
        )
        self._dialed = new_counter("swarm_connections_dialed", "Outbound peer connections made")
        self._background = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._handlers: dict[str, Handler] = {}
        self._pool: dict[PeerID, list[_Pooled]] = {}
        self._slots: dict[PeerID, trio.Semaphore] = {}
        self._inbound_streams: dict[PeerID, int] = {}
        self._inbound = 0
        self._connections: set[_Connection] = set()
        self._cancel_on_close: set[trio.CancelScope] = set()
        self._closed = False
        self._traffic = _Traffic()
        self._relay_routes: dict[PeerID, Address] = {}
        self._relayed_dial_watcher: Callable[[PeerID, Address], None] | None = None
        self._punched_drop_watcher: Callable[[PeerID], None] | None = None
        self._raw_handler: RawHandler | None = None
        self.port = 0

    @property
    def peer_id(self) -> PeerID:
        return self._identity.peer_id

    @property
    def bytes_sent(self) -> int:
        """Bytes sent over all TCP connections so far, handshakes and framing
        included (what the kernel accepted; never decreases)."""
        return count_of(self._traffic.sent)

    @property
    def bytes_received(self) -> int:
        """Bytes received over all TCP connections so far, like ``bytes_sent``."""
        return count_of(self._traffic.received)

    @property
    def refused_inbound(self) -> int:
        """Inbound connections closed at once for a limit (total or per address)."""
        return count_of(self._refused_inbound)

    @property
    def dialed(self) -> int:
        """Outbound connections made (handshake done); streams reuse pooled ones."""
        return count_of(self._dialed)

    @property
    def metrics(self) -> tuple[Counter, ...]:
        """The counters behind ``bytes_sent``, ``bytes_received``, ``dialed`` and
        ``refused_inbound``, for a peer's registry to expose (``_counters``)."""
        return (self._traffic.sent, self._traffic.received, self._dialed, self._refused_inbound)

    @property
    def config(self) -> ConnectionConfig:
        return self._config

    def report_offence(self, peer_id: PeerID, reason: str) -> None:
        """``peer_id`` broke a protocol: ban it locally (``_bans``) and close
        every connection with it, in either role (streams on them fail as
        with a lost connection)."""
        if peer_id == self.peer_id:
            return
        period = self.bans.offend(peer_id, reason)
        if period > 0:
            logger.info("banned %s for %.0f s: %s", peer_id.short(), period, reason)
            for connection in list(self._connections):
                if connection.remote == peer_id:
                    connection.blamed = True  # one offence, however many connections
                    self._drop(connection)

    def _check_not_banned(self, peer_id: PeerID) -> None:
        if self.bans.is_banned(peer_id):
            raise PeerUnreachableError(
                f"{peer_id.short()} is banned for another {self.bans.remaining(peer_id):.0f} s: "
                f"{self.bans.reason(peer_id)}"
            )

    def set_handler(self, name: str, handler: Handler) -> None:
        """Serve streams that remote peers open under ``name`` with ``handler``.

        Replaces any earlier handler of that name (streams it is serving go on).
        """
        _check_name(name)
        self._handlers[name] = handler

    def open_stream(
        self, peer_id: PeerID, address: Address, name: str
    ) -> AbstractAsyncContextManager[Stream]:
        """A stream to the handler ``name`` of ``peer_id``, dialing ``address`` if
        no pooled connection to that peer is idle.

        Waits while ``max_streams_per_peer`` streams to that peer are open.
        Raises ``PeerUnreachableError`` (refused, no answer in
        ``connect_timeout``, or banned locally), ``SelfDialError`` (a
        ``PeerUnreachableError``: ``address`` leads back to this very peer, which
        blames nobody), ``ProtocolError`` (bad handshake, or the remote
        proved another peer id), ``DeadlineError`` (no handshake within
        ``handshake_timeout``), ``ClosedError`` (the manager is or gets closed).

        On leaving the block normally, EOF is sent if it was not, and the
        connection goes back to the pool. It is reused once the remote's EOF
        (if not received yet) and the end of its handler arrive; any other
        frame closes it, except the messages that the stream left unread
        (``Stream.leave_unread``). On an exception or cancellation the
        connection is closed, which the remote handler sees as a lost
        connection.
        """
        return self._open_stream(peer_id, address, name, defer_open=False)

    @asynccontextmanager
    async def _open_stream(
        self, peer_id: PeerID, address: Address, name: str, *, defer_open: bool
    ) -> AsyncIterator[Stream]:
        # defer_open: the OPEN frame leaves with the first send (``call`` sends
        # OPEN, request and EOF in one system call). Not for open_stream: its
        # caller may expect the remote handler to start before it sends.
        _check_name(name)
        self._check_not_banned(peer_id)
        slots = self._slots.get(peer_id)
        if slots is None:
            slots = self._slots[peer_id] = trio.Semaphore(self._config.max_streams_per_peer)
        try:
            with self._cancelled_on_close():
                await slots.acquire()
            try:
                with self._cancelled_on_close():
                    connection = await self._pooled(peer_id)
                    if connection is None and await self._punched_settled(peer_id):
                        connection = await self._pooled(peer_id)
                    if connection is None:
                        connection = await self._ending_or_dial(peer_id, address)
                stream = Stream(connection, name, opening=pack([name]))
                try:
                    if not defer_open:
                        await stream._send([])
                    yield stream
                    usable = not (connection.broken or connection.closed)
                    if usable and stream._reset is None and not stream._closed:
                        await stream.send_eof()
                except BaseException:
                    self._drop(connection)
                    raise
                if stream.ended_cleanly and not self._closed and not connection.worn_out:
                    self._pool_connection(
                        connection,
                        eof=stream._received_eof,
                        ready=stream._done,
                        unread=0 if stream._received_eof else stream._unread,
                    )
                else:
                    self._drop(connection)
                stream._closed = True  # its connection may carry another stream now
            finally:
                slots.release()
        finally:
            if (
                slots.value == self._config.max_streams_per_peer
                and not slots.statistics().tasks_waiting
            ):
                self._slots.pop(peer_id, None)

    async def call(
        self,
        peer_id: PeerID,
        address: Address,
        name: str,
        request: Any,
        *,
        timeout: float,
    ) -> Any:
        """Send ``request`` to the handler ``name`` of ``peer_id``; return its one reply.

        The handler must send exactly one message and end the stream. Raises
        ``DeadlineError`` if all this takes longer than ``timeout`` seconds
        (dialing included; the stream is closed), ``ProtocolError`` if the
        handler ends without a reply or sends more than one, and the errors of
        ``open_stream`` and ``Stream.receive``.
        """
        with trio.move_on_after(timeout):
            async with self._open_stream(peer_id, address, name, defer_open=True) as stream:
                await stream._send_last(request)
                try:
                    reply = await stream.receive()
                except EndOfStreamError as e:
                    raise ProtocolError(f"{peer_id.short()} ended {name!r} without a reply") from e
                try:
                    await stream.receive()
                except EndOfStreamError:
                    pass
                else:
                    raise ProtocolError(f"{peer_id.short()} sent more than one reply to {name!r}")
                await stream._wait_done()
            return reply
        raise DeadlineError(f"call {name!r} to {peer_id.short()} did not finish within {timeout} s")

    async def check_dial(self, peer_id: PeerID, address: Address) -> None:
        """Dial ``address`` on a new connection (never a pooled one), prove that
        ``peer_id`` answers there, and close it: whether others can reach it.

        Raises what dialing raises (see ``open_stream``): ``PeerUnreachableError``
        (refused, no answer in ``connect_timeout``), ``ProtocolError`` (another
        peer answered), ``DeadlineError`` (no handshake within
        ``handshake_timeout``), ``ClosedError``. Cancellation closes the socket.
        """
        self._check_not_banned(peer_id)
        with self._cancelled_on_close():
            connection = await self._dial(peer_id, address)
        connection.close()

    def set_relay_route(self, peer_id: PeerID, relay: Address | None) -> None:
        """Dial ``peer_id`` through the relay port at ``relay`` (``_relay``)
        instead of the address callers pass; ``None`` dials directly again.

        The handshake over the circuit must prove ``peer_id`` as on any dial,
        so the relay carries only ciphertext it cannot forge.
        """
        if relay is None:
            self._relay_routes.pop(peer_id, None)
        else:
            self._relay_routes[peer_id] = relay

    def watch_relayed_dials(self, watcher: Callable[[PeerID, Address], None] | None) -> None:
        """Call ``watcher(peer_id, address)`` after each dial that reached
        ``peer_id`` through its relay route (``address``: what the caller
        passed), e.g. to punch a direct connection (``_punch.AutoPunch``);
        ``None`` stops. The watcher must neither block nor raise."""
        self._relayed_dial_watcher = watcher

    def watch_punched_drops(self, watcher: Callable[[PeerID], None] | None) -> None:
        """Call ``watcher(peer_id)`` whenever a punched connection this peer
        dialed (``adopt_outbound``) to ``peer_id`` ends, for whatever reason
        (a stream that ended badly, the remote gone): ``_punch.AutoPunch``
        punches another while it can. ``None`` stops. The watcher must
        neither block nor raise."""
        self._punched_drop_watcher = watcher

    def punched_count(self, peer_id: PeerID) -> int:
        """Live punched connections this peer dialed to ``peer_id`` (those
        that carry its streams to it)."""
        return sum(
            1
            for c in self._connections
            if c.punched and c.dialer and c.remote == peer_id and not c.closed
        )

    def inbound_key_exporters(self, peer_id: PeerID) -> list[Callable[[bytes], bytes]]:
        """``export_key`` of each live connection that ``peer_id`` dialed to
        this peer: the connections its streams to us come on. A stream's keys
        are its connection's (``Stream.export_key``), so a protocol beside the
        streams can open what the remote sealed under a stream's key before
        that stream's first message arrived (the lossy all-reduce's header
        copy), trying each: a remote has ``max_streams_per_peer`` of them at
        most, and the keys are derived, not stored."""
        return [
            c.export_key
            for c in self._connections
            if not c.dialer and c.remote == peer_id and not c.closed and not c.broken
        ]

    def set_raw_handler(self, handler: RawHandler | None) -> None:
        """Serve inbound connections that begin with ``RAW_MAGIC`` with
        ``handler`` instead of a handshake (``None``: refuse them, the default).
        They count against the inbound limits like any connection."""
        self._raw_handler = handler

    def adopt_inbound(self, socket_stream: trio.SocketStream, *, relayed: bool = True) -> None:
        """Serve ``socket_stream`` as an inbound connection (its handshake, then
        its streams) in the background, as if it had arrived at the listener:
        a relay circuit this peer took (``_relay.keep_relay``; ``relayed``), or
        a connection punched through NATs (``_punch``; not relayed). Limits
        apply as to any inbound connection; closed at once if the manager is
        closed.
        """
        if self._closed or self._nursery is None:
            socket_stream.socket.close()
            return
        serve = functools.partial(self._handle_inbound, relayed=relayed, punched=not relayed)
        self._nursery.start_soon(serve, socket_stream)

    async def adopt_outbound(self, socket_stream: trio.SocketStream, peer_id: PeerID) -> None:
        """Run the handshake over ``socket_stream`` as the dialer, which must
        prove ``peer_id``, and pool the connection: this peer's next stream to
        ``peer_id`` uses it before dialing anew (a connection punched through
        NATs, ``_punch``). The connection is then like any dialed one (closed
        after ``idle_timeout`` unused).

        Raises ``ProtocolError`` (a failed handshake, another peer),
        ``DeadlineError`` (no handshake within ``handshake_timeout``) or
        ``ClosedError``; the socket is closed on any failure or cancellation.
        """
        try:
            self._check_not_banned(peer_id)
            with self._cancelled_on_close():
                with trio.fail_after(self._config.handshake_timeout):
                    connection = await self._handshake(socket_stream, expected_peer=peer_id)
        except trio.TooSlowError as e:
            socket_stream.socket.close()
            raise DeadlineError(
                f"no handshake with {peer_id.short()} within {self._config.handshake_timeout} s"
            ) from e
        except BaseException:
            socket_stream.socket.close()
            raise
        _mark_punched(connection)
        self._pool_connection(connection, eof=True, ready=True)

    async def aclose(self) -> None:
        """Close everything: pending operations raise ``ClosedError``, handlers
        are cancelled, the listener stops. Idempotent."""
        self._close()
        await trio.lowlevel.checkpoint()

    # Internals.

    def _close(self) -> None:
        self._closed = True
        for scope in list(self._cancel_on_close):
            scope.cancel()
        for connection in list(self._connections):
            connection.close()
        self._connections.clear()
        self._pool.clear()
        self._background.cancel()

    @contextmanager
    def _cancelled_on_close(self) -> Iterator[None]:
        """Turn the manager's closing into ``ClosedError`` for the block."""
        if self._closed:
            raise ClosedError("the connections were closed")
        with trio.CancelScope() as scope:
            self._cancel_on_close.add(scope)
            try:
                yield
            finally:
                self._cancel_on_close.discard(scope)
        if scope.cancelled_caught:
            raise ClosedError("the connections were closed")

    def _idle_timeout(self, connection: _Connection) -> float:
        """How long ``connection`` may sit idle: ``idle_timeout``, but for
        ever if punched, since nothing can make it again once its relay is
        gone (TCP keepalives tell when its remote vanished, ``_keep_alive``)."""
        return math.inf if connection.punched else self._config.idle_timeout

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        if connection in self._connections:
            self._connections.discard(connection)
            watcher = self._punched_drop_watcher
            if connection.punched and connection.dialer and watcher is not None:
                watcher(connection.remote)
        if connection.receive_error is not None:
            self._blame(connection, connection.receive_error)

    def _blame(self, connection: _Connection, error: ProtocolError) -> None:
        """The remote of ``connection`` (proven by its handshake) broke the protocol."""
        if connection.blamed:
            return
        connection.blamed = True
        if connection.relayed and isinstance(error, AuthenticationError):
            logger.warning(
                "a relayed connection with %s failed authentication (%s): closed, nobody "
                "banned, since the relay may have altered it",
                connection.remote.short(),
                error,
            )
            return
        self.report_offence(connection.remote, f"{type(error).__name__}: {error}")

    async def _pooled(self, peer_id: PeerID) -> _Connection | None:
        """Take the most recently used ready connection to ``peer_id``, if any:
        a direct one (punched through NATs, ``_punch``) before one through a
        relay, which then idles out."""
        while True:
            entries = self._pool.get(peer_id, [])
            ready = [entry for entry in entries if entry.ready]
            if not ready:
                return None
            direct = [entry for entry in ready if not entry.connection.relayed]
            entry = (direct or ready)[-1]
            self._unpool(entry)
            entry.scope.cancel()
            await entry.done.wait()
            if not entry.connection.closed:
                return entry.connection

    async def _ending_or_dial(self, peer_id: PeerID, address: Address) -> _Connection:
        """A connection for a stream to ``peer_id`` when none in the pool is
        ready: a pooled one whose last stream is ending (we left it; the
        remote's EOF, or the DONE saying its handler returned, has not come
        yet), if it gets ready before a dial begun ``REUSE_HEAD_START`` later
        connects; else the dialed one.

        Why: a stream often follows another to the same peer at once (a group
        member's all-reduce stream follows its matchmaking stream to the
        leader, whose handler ends with the group message), a round trip
        before the remote's EOF and DONE can come back. Dialing costs
        more round trips and, on a link that loses packets, often a lost SYN
        (``open_tcp_racing``): at 10% loss such dials cost averaging rounds a
        quarter of a second each. Whichever loses is not wasted: a connection
        that gets ready after the dial won stays in the pool, and one dialed
        after the pooled one got ready joins it there. A dial that fails
        leaves the ending connection as the one chance: its error is raised
        only once that one is dropped too (bounded like any wait of
        ``open_stream``, by the caller's deadline).

        When the ending connection wins, a spare is dialled meanwhile
        (``_dial_spare``): a stream that had to wait here is one of a pair
        that will come again (each averaging round's), and the next time
        the pool has a ready connection for it at once. The wait was a round
        trip on the round's critical path in about half the rounds of a group
        of 4 (7-13 ms at the median on the test bed at 10% loss, 6-7 without,
        more for a lost segment). The pool keeps the spare like any
        connection: taken in turn with the other, closed after
        ``idle_timeout`` unused.
        """
        ending = [e for e in self._pool.get(peer_id, []) if not e.ready]
        if not ending:
            return await self._dial(peer_id, address)
        won: list[_Connection] = []
        dialed: list[_Connection] = []
        failed: list[SwarmError] = []

        def take(connection: _Connection, nursery: trio.Nursery) -> None:
            if not won:
                won.append(connection)
                nursery.cancel_scope.cancel()
            elif self._closed:  # the pool's nursery may be gone
                self._drop(connection)
            else:
                self._pool_connection(connection, eof=True, ready=True)

        async def reuse(nursery: trio.Nursery) -> None:
            for entry in ending:
                await entry.settled.wait()
                # Taking a pooled connection waits for its watcher to stop; a
                # cancellation then would lose the connection.
                with trio.CancelScope(shield=True):
                    connection = await self._pooled(peer_id)
                if connection is not None:
                    take(connection, nursery)
                    return

        async def dial(nursery: trio.Nursery) -> None:
            await trio.sleep(REUSE_HEAD_START)
            try:
                connection = await self._dial(peer_id, address)
            except SwarmError as e:
                failed.append(e)
                return
            dialed.append(connection)
            take(connection, nursery)

        # Each task ends by taking a connection (which cancels the other) or
        # failing: the nursery ends with a connection or the dial's error.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reuse, nursery)
            nursery.start_soon(dial, nursery)
        if won:
            if won[0] not in dialed and self._nursery is not None:
                self._nursery.start_soon(self._dial_spare, peer_id, address)
            return won[0]
        raise failed[0]

    async def _dial_spare(self, peer_id: PeerID, address: Address) -> None:
        """Pool one more connection to ``peer_id`` (``_ending_or_dial``); a
        dial that fails leaves things as they were."""
        try:
            connection = await self._dial(peer_id, address)
        except SwarmError as e:
            logger.debug("no spare connection to %s: %s", peer_id.short(), e)
            return
        if self._closed:
            self._drop(connection)
        else:
            self._pool_connection(connection, eof=True, ready=True)

    async def _punched_settled(self, peer_id: PeerID) -> bool:
        """Wait (at most ``connect_timeout``) until a punched connection to
        ``peer_id`` that the pool holds for the end of its last stream (its
        DONE) is ready or dropped; False at once if there is none, or if a
        relay route can dial it meanwhile. Without a relay nothing can make a
        punched connection again, so a stream that follows another at once
        waits the moment that takes rather than dial an address that NATs
        hide."""
        if peer_id in self._relay_routes:
            return False
        waiting = [
            entry
            for entry in self._pool.get(peer_id, [])
            if entry.connection.punched and not entry.ready
        ]
        if not waiting:
            return False
        with trio.move_on_after(self._config.connect_timeout):
            await waiting[0].settled.wait()
        return True

    def punched_peers(self) -> frozenset[PeerID]:
        """The peers this one holds a live connection with that was punched
        through NATs (``_punch``), in either direction."""
        return frozenset(c.remote for c in self._connections if c.punched and not c.closed)

    def _pool_connection(
        self, connection: _Connection, *, eof: bool, ready: bool, unread: int = 0
    ) -> None:
        entry = _Pooled(connection, eof, ready, trio.CancelScope(), trio.Event(), unread=unread)
        if ready:
            entry.settled.set()
        assert self._nursery is not None
        self._pool.setdefault(connection.remote, []).append(entry)
        self._nursery.start_soon(self._watch_idle, entry)

    def _unpool(self, entry: _Pooled) -> None:
        entries = self._pool.get(entry.connection.remote, [])
        if entry in entries:
            entries.remove(entry)
            if not entries:
                del self._pool[entry.connection.remote]

    async def _watch_idle(self, entry: _Pooled) -> None:
        """Watch a pooled connection until it is taken (``entry.scope`` is
        cancelled) or must be dropped: idle for ``idle_timeout``, closed by the
        remote, or any frame but the one DONE frame (and the messages its last
        stream left unread, ``Stream.leave_unread``) arrives. Nudges, which
        follow DONE as a segment of their own, are no frames (the decoder
        consumes them)."""
        try:
            with entry.scope:
                with (
                    trio.move_on_after(self._idle_timeout(entry.connection)),
                    suppress(SwarmError, trio.ClosedResourceError, OSError),
                ):
                    await self._until_unusable(entry)
                self._unpool(entry)
                self._drop(entry.connection)
        finally:
            entry.done.set()
            entry.settled.set()

    async def _until_unusable(self, entry: _Pooled) -> None:
        # Receiving is cancel-safe, so taking the connection mid-frame loses nothing.
        while not entry.ready:
            frame = await entry.connection.receive_frame()
            if not entry.eof and frame.kind is FrameKind.EOF:
                entry.eof = True
            elif entry.eof and frame.kind is FrameKind.DONE:
                entry.ready = True
                entry.settled.set()
            elif not entry.eof and entry.unread and frame.kind is FrameKind.MESSAGE:
                entry.unread -= 1
            else:  # the stream was not over, or the handler failed (RESET)
                return
        await entry.connection.receive_frame()  # whatever comes now makes it unusable

    async def _dial(self, peer_id: PeerID, address: Address) -> _Connection:
        config = self._config
        relay = self._relay_routes.get(peer_id)
        address_asked = address
        if relay is not None:
            address = relay
        host, port = address
        try:
            with trio.fail_after(config.connect_timeout):
                if relay is not None:
                    socket_stream = await open_circuit(
                        relay, peer_id, timeout=config.connect_timeout
                    )
                else:
                    socket_stream = await open_tcp_racing(
                        host, port, redial_after=self._redial_after(host)
                    )
        except trio.TooSlowError as e:
            raise PeerUnreachableError(
                f"{peer_id.short()} at {host}:{port} did not answer "
                f"within {config.connect_timeout} s"
            ) from e
        except OSError as e:
            raise PeerUnreachableError(
                f"cannot connect to {peer_id.short()} at {host}:{port}: {e}"
            ) from e
        try:
            with trio.fail_after(config.handshake_timeout):
                connection = await self._handshake(
                    socket_stream, expected_peer=peer_id, relayed=relay is not None
                )
        except trio.TooSlowError as e:
            socket_stream.socket.close()
            raise DeadlineError(
                f"no handshake with {peer_id.short()} at {host}:{port} "
                f"within {config.handshake_timeout} s"
            ) from e
        except BaseException:
            socket_stream.socket.close()
            raise
        self._dialed.inc()
        if relay is not None and self._relayed_dial_watcher is not None:
            self._relayed_dial_watcher(peer_id, address_asked)
        return connection

    def _redial_after(self, host: str) -> float:
        """Seconds after which a dial to ``host`` is raced by another
        (``open_tcp_racing``): ``REDIAL_RTTS`` smoothed round trips of the
        fastest live direct connection with that host, in either direction,
        clamped to ``MIN_REDIAL_AFTER``-``REDIAL_AFTER``; ``REDIAL_AFTER``
        where there is none or the kernel does not say.

        Why: ``REDIAL_AFTER`` must cover the SYN's round trip on any path we
        might dial, so a lost SYN costs a quarter of a second. Most dials in
        a run go to peers that are connected already (a second connection,
        for a stream while the first carries another), whose round trip the
        kernel has measured. On the test bed at 10% loss, 11 of 84 dials in
        three runs lost a SYN or SYN-ACK and waited 0.25-1 s, where the
        path's round trip is a few milliseconds; three of them were
        matchmaking's, at the start of a run, and made a peer miss its first
        round and fall behind."""
        rtts = [
            rtt
            for c in self._connections
            if not (c.closed or c.relayed) and c.remote_address[0] == host
            if (rtt := _smoothed_rtt(c.socket)) is not None
        ]
        if not rtts:
            return REDIAL_AFTER
        return min(REDIAL_AFTER, max(MIN_REDIAL_AFTER, REDIAL_RTTS * min(rtts)))

    async def _handshake(
        self,
        socket_stream: trio.SocketStream,
        *,
        expected_peer: PeerID | None,
        prefix: bytes = b"",
        relayed: bool = False,
    ) -> _Connection:
        """Run the handshake on a fresh TCP connection (``prefix``: its first
        bytes, already received; ``relayed``: a relay's circuit, whose failed
        handshake bans nobody, since the relay may have altered it); the caller
        closes the socket on failure. Raises ``ProtocolError``,
        ``PeerUnreachableError``."""
        with suppress(AttributeError):  # not a socket (a test's stream)
            _shorten_retransmission_timer(socket_stream.socket)
        handshake = Handshake(
            self._identity,
            initiator=expected_peer is not None,
            encrypt=self._config.encrypt,
            expected_peer=expected_peer,
            swarm_key=self._config.swarm_key,
        )
        try:
            out = handshake.start()
            if prefix:
                self._traffic.received.inc(len(prefix))
                out += handshake.receive_data(prefix)
            while True:
                if out:
                    await socket_stream.send_all(out)
                    self._traffic.sent.inc(len(out))
                if handshake.complete:
                    break
                data = await socket_stream.receive_some(_HANDSHAKE_READ)
                self._traffic.received.inc(len(data))
                if not data:
                    raise PeerUnreachableError(
                        "the remote closed the connection during the handshake"
                    )
                out = handshake.receive_data(data)
        except ProtocolError as e:
            if handshake.proven_peer is not None and not relayed:
                self.report_offence(handshake.proven_peer, f"failed handshake: {e}")
            raise
        except trio.BrokenResourceError as e:
            raise PeerUnreachableError(
                f"connection lost during the handshake: {e.__cause__}"
            ) from e
        connection = _Connection(
            socket_stream,
            handshake.result,
            self._config,
            handshake.unused_data,
            dialer=expected_peer is not None,
            traffic=self._traffic,
            relayed=relayed,
        )
        if self._closed:
            connection.close()
            raise ClosedError("the connections were closed")
        self._connections.add(connection)
        if expected_peer is None and self.bans.is_banned(connection.remote):
            self._drop(connection)
            raise PeerUnreachableError(f"refused banned peer {connection.remote.short()}")
        return connection

    async def _run(self, host: str, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        """Own every background task (listener, inbound connections, handlers,
        pool watchers) in a nursery that ``_close`` cancels; report the port."""
        with self._background:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                listeners = await nursery.start(
                    functools.partial(
                        trio.serve_tcp,
                        self._handle_inbound,
                        port,
                        host=host,
                        handler_nursery=nursery,
                    )
                )
                task_status.started(listeners[0].socket.getsockname()[1])
                await trio.sleep_forever()

    async def _handle_inbound(
        self, socket_stream: trio.SocketStream, *, relayed: bool = False, punched: bool = False
    ) -> None:
        """Serve one inbound connection (``relayed``: a relay's circuit;
        ``punched``: punched through NATs); the boundary where its failures stop."""
        host = _remote_host(socket_stream)
        from_host = self._inbound_by_host.get(host, 0)
        if (
            self._closed
            or self._inbound >= self._config.max_connections
            or from_host >= self._config.max_connections_per_address
        ):
            self._refused_inbound.inc()
            socket_stream.socket.close()
            return
        self._inbound += 1
        self._inbound_by_host[host] = from_host + 1
        connection: _Connection | None = None
        try:
            raw = False
            with trio.move_on_after(self._config.handshake_timeout):
                prefix = b""
                if self._raw_handler is not None:
                    prefix = await _receive_prefix(socket_stream, len(RAW_MAGIC))
                    raw = prefix == RAW_MAGIC
                if not raw:
                    connection = await self._handshake(
                        socket_stream, expected_peer=None, prefix=prefix, relayed=relayed
                    )
                    if punched:
                        _mark_punched(connection)
            if raw and self._raw_handler is not None:
                await self._raw_handler(socket_stream)
            elif connection is not None:
                await self._serve_streams(connection)
        except Exception as e:  # per-connection boundary: a bad peer must not stop the others
            logger.debug("inbound connection failed: %s: %s", type(e).__name__, e)
            if connection is not None and isinstance(e, ProtocolError):
                self._blame(connection, e)
        finally:
            self._inbound -= 1
            remaining = self._inbound_by_host[host] - 1
            if remaining:
                self._inbound_by_host[host] = remaining
            else:
                del self._inbound_by_host[host]
            if connection is not None:
                self._drop(connection)
            else:
                socket_stream.socket.close()

    def inbound_count(self, host: str | None = None) -> int:
        """Inbound connections being served (from ``host`` only, if given)."""
        return self._inbound if host is None else self._inbound_by_host.get(host, 0)

    async def _serve_streams(self, connection: _Connection) -> None:
        """Serve the streams a dialer opens on ``connection``, one at a time."""
        remote = connection.remote
        while True:
            with trio.move_on_after(2 * self._idle_timeout(connection)) as idle:
                try:
                    frame = await connection.receive_frame()
                except PeerUnreachableError:
                    return  # the dialer closed an idle connection: the normal end
            if idle.cancelled_caught:
                return
            if frame.kind is not FrameKind.OPEN:
                raise ProtocolError(f"{remote.short()} sent {frame.kind.name} outside a stream")
            fields = expect_list(
                unpack(frame.payload, max_size=MAX_NAME_LENGTH * 4 + 16), 1, "OPEN"
            )
            name = expect_str(fields[0], "stream name", max_size=MAX_NAME_LENGTH)
            handler = self._handlers.get(name)
            if handler is None:
                await self._reset(connection, f"no handler for {name!r}")
                return
            if self._inbound_streams.get(remote, 0) >= self._config.max_streams_per_peer:
                await self._reset(
                    connection, f"more than {self._config.max_streams_per_peer} streams"
                )
                return
            self._inbound_streams[remote] = self._inbound_streams.get(remote, 0) + 1
            try:
                stream = Stream(connection, name)
                try:
                    await handler(stream)
                except Exception as e:  # per-stream boundary: the handler's failure ends its stream
                    if isinstance(e, SwarmError):
                        logger.debug("handler %r for %s failed: %s", name, remote.short(), e)
                    else:
                        logger.exception("handler %r for %s crashed", name, remote.short())
                    if not stream._closed and stream._reset is None:
                        await self._reset(connection, f"{type(e).__name__}: {e}")
                    return
                if not await self._finish_inbound(stream):
                    return
            finally:
                count = self._inbound_streams[remote] - 1
                if count:
                    self._inbound_streams[remote] = count
                else:
                    del self._inbound_streams[remote]

    async def _finish_inbound(self, stream: Stream) -> bool:
        """After a handler returned: send EOF if it did not, discard what the
        dialer still sends until its EOF. True if the connection is reusable."""
        connection = stream._connection
        if connection.receive_error is not None and not stream._closed:
            await self._reset(connection, f"ProtocolError: {connection.receive_error}")
            return False
        if stream._closed or stream._reset is not None or connection.broken or connection.closed:
            return False
        stream._closed = True  # the handler's stream object is finished
        frames: list[tuple[FrameKind, bytes | bytearray | memoryview]] = []
        if not stream._sent_eof:
            frames.append((FrameKind.EOF, b""))
        with trio.move_on_after(self._config.idle_timeout):
            # The dialer's EOF has often arrived already: then EOF and DONE go
            # out together. Otherwise our EOF goes first, as the dialer may be
            # waiting for it before it sends its own.
            while connection.has_pending_frames() and not stream._received_eof:
                if not _discard_until_eof(stream, await connection.receive_frame()):
                    return False
            if not stream._received_eof:
                await connection.send_frames(frames)
                frames = []
            while not stream._received_eof:
                if not _discard_until_eof(stream, await connection.receive_frame()):
                    return False
            await connection.send_frames([*frames, (FrameKind.DONE, b"")])
            # Both sides count the same bytes, so the dialer does not pool it either.
            return not connection.worn_out
        return False

    async def _reset(self, connection: _Connection, reason: str) -> None:
        """Best effort: tell the dialer why its stream ends, then close."""
        if not (connection.send_broken or connection.closed):
            with trio.move_on_after(_RESET_GRACE), suppress(SwarmError):
                await connection.send_frame(FrameKind.RESET, pack(reason[:_MAX_RESET_REASON]))
                await connection.linger()
        self._drop(connection)


#: TCP keepalive of a punched connection: the first probe after this many
#: idle seconds, then one every _KEEPALIVE_INTERVAL, and _KEEPALIVE_PROBES
#: unanswered ones end it. Home routers forget idle TCP mappings after
#: minutes or hours; the probes keep the mapping and notice a vanished remote.
_KEEPALIVE_IDLE = 30
_KEEPALIVE_INTERVAL = 10
_KEEPALIVE_PROBES = 3


#: Linux socket options (``linux/tcp.h``, kernel 6.15 and later) that Python's
#: ``socket`` module does not name: the least retransmission timeout of a
#: connection and the longest it delays an ACK, in microseconds.
_TCP_RTO_MIN_US = 45
_TCP_DELACK_MAX_US = 46
#: Least retransmission timeouts to ask for, first choice first: the kernel
#: refuses one under two of its clock ticks (8 ms at 250 Hz, 20 ms at 100 Hz).
_RTO_MINIMA_US = (10_000, 20_000)


#: Seconds a stream waits for a pooled connection to the same peer whose last
#: stream is ending before it also dials (``Connections._ending_or_dial``):
#: the round trip that brings the connection's DONE on a short path, and on
#: a lossy one the dial still loses to a DONE resent by TCP more often than not.
REUSE_HEAD_START = 0.02
#: Seconds after which a dial that has not connected yet is raced by another
#: to the same address, then twice as long for the next (``open_tcp_racing``).
REDIAL_AFTER = 0.25
#: Most dials raced for one connection.
MAX_DIALS = 3
#: A dial to a host that a live connection reaches is raced after this many
#: of that connection's smoothed round trips (``Connections._redial_after``),
#: and never sooner than ``MIN_REDIAL_AFTER`` seconds.
REDIAL_RTTS = 4
MIN_REDIAL_AFTER = 0.02
#: ``struct tcp_info`` (``linux/tcp.h``): the bytes asked for, and where its
#: smoothed and least round trips (``tcpi_rtt``, ``tcpi_min_rtt``,
#: microseconds) are.
_TCP_INFO_SIZE = 152
_TCPI_RTT = 68
_TCPI_MIN_RTT = 148


async def open_tcp_racing(
    host: str,
    port: int,
    *,
    connect: Callable[[str, int], Awaitable[trio.SocketStream]] = trio.open_tcp_stream,
    redial_after: float = REDIAL_AFTER,
) -> trio.SocketStream:
    """A TCP connection to ``host:port``: the first of up to ``MAX_DIALS``
    dials to connect, each begun ``redial_after`` seconds after the last, the
    wait doubling; the others are cancelled (or closed, if they connected too).

    Why: a link that loses the SYN or the SYN-ACK leaves the dial waiting for
    TCP's initial retransmission timeout, 1 s, then 2 s more; on a link that
    loses 10% of its packets one dial in five does, and a connection dialled
    for an averaging round made the round last a second or five instead of a
    tenth. A dial that fails (refused, unreachable) fails at once, as one dial
    does; so does the caller's deadline. ``connect``: how one dial is made."""
    winner: trio.SocketStream | None = None
    failure: OSError | None = None

    async def dial(nursery: trio.Nursery, delay: float) -> None:
        nonlocal winner, failure
        await trio.sleep(delay)
        try:
            stream = await connect(host, port)
        except OSError as e:
            failure = failure or e
            nursery.cancel_scope.cancel()
            return
        if winner is None:
            winner = stream
            nursery.cancel_scope.cancel()
        else:
            stream.socket.close()

    async with trio.open_nursery() as nursery:
        for k in range(MAX_DIALS):
            nursery.start_soon(dial, nursery, redial_after * (2**k - 1))
    if winner is not None:
        return winner
    assert failure is not None  # the nursery ended: a dial connected or failed
    raise failure


#: Linux's SO_MAX_PACING_RATE (Python's socket module does not name it) and
#: its "no cap" value (u32 ~0: the kernel then takes no cap at all)
_SO_MAX_PACING_RATE = 47
_UNPACED = 2**32 - 1


def _shorten_retransmission_timer(sock: trio.socket.SocketType) -> None:
    """Let a lost segment of this connection be resent after about a round trip
    plus 10-20 ms instead of Linux's least timeout of 200 ms.

    The control messages of a round (a header, a reducer's reply, which
    pieces arrived) are one segment each; on a link that loses 10% of its
    packets one round in a few loses one, and TCP then resends it only when
    its retransmission timer fires (or its tail-loss probe, which waits as
    long for a lone segment): 0.2-0.4 s, where a round takes a tenth of a
    second. The timer otherwise still follows the measured round trip (RFC
    6298), so a long link keeps a long one; a timer that fires too early on a
    jittery link costs one duplicate segment, which the kernel's F-RTO
    detects and undoes. Delayed ACKs are capped alike, so that a remote
    holding its ACK back does not trip our shorter timer. A kernel without
    these options keeps its defaults: slower under loss, nothing else."""
    for minimum in _RTO_MINIMA_US:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_RTO_MIN_US, minimum)
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_DELACK_MAX_US, minimum)
        except OSError:
            continue
        return


def _tcp_info_fields(sock: trio.socket.SocketType, *offsets: int) -> list[int] | None:
    """The u32 fields of a TCP connection's ``TCP_INFO`` at ``offsets``, or
    None where the kernel does not say (no ``TCP_INFO``, or a shorter one)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
    except (OSError, AttributeError):
        return None
    if len(info) < max(offsets) + 4:
        return None
    return [struct.unpack_from("=I", info, offset)[0] for offset in offsets]


def _smoothed_rtt(sock: trio.socket.SocketType) -> float | None:
    """The kernel's smoothed round trip of a TCP connection in seconds, or
    None where it does not say (no ``TCP_INFO``, or no sample yet)."""
    fields = _tcp_info_fields(sock, _TCPI_RTT)
    if fields is None or not fields[0]:
        return None
    return fields[0] / 1e6


def _queueing_delay(sock: trio.socket.SocketType) -> float | None:
    """How much longer than its least round trip a TCP connection's smoothed
    round trip is, in seconds: the time its packets wait in queues on the
    path. None where the kernel does not say (no ``TCP_INFO`` or no sample)."""
    fields = _tcp_info_fields(sock, _TCPI_RTT, _TCPI_MIN_RTT)
    if fields is None:
        return None
    rtt_us, min_rtt_us = fields
    if not rtt_us or not min_rtt_us or min_rtt_us == 2**32 - 1:  # ~0: no sample yet
        return None
    return max(0, rtt_us - min_rtt_us) / 1e6


def _mark_punched(connection: _Connection) -> None:
    """``connection`` was punched through NATs: kept without idle timeout,
    with TCP keepalives instead."""
    connection.punched = True
    sock = connection.socket
    with suppress(OSError, AttributeError):  # without them it only lives less long
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_PROBES)


def _discard_until_eof(stream: Stream, frame: Frame) -> bool:
    """Listener, after its handler returned: drop what the dialer still sends.
    False if the frame is not part of the stream."""
    if frame.kind is FrameKind.EOF:
        stream._received_eof = True
    return frame.kind in (FrameKind.EOF, FrameKind.MESSAGE, FrameKind.BYTES)


async def _receive_prefix(socket_stream: trio.SocketStream, size: int) -> bytes:
    """The first ``size`` bytes of a connection, or fewer if it ends first."""
    data = b""
    while len(data) < size:
        chunk = await socket_stream.receive_some(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _remote_address(socket_stream: trio.SocketStream) -> Address:
    try:
        name = socket_stream.socket.getpeername()
    except OSError:  # already reset by the remote
        return ("", 0)
    if not isinstance(name, tuple) or len(name) < 2:  # not IP (a socketpair in tests)
        return ("", 0)
    return (str(name[0]), int(name[1]))


def _remote_host(socket_stream: trio.SocketStream) -> str:
    try:
        return str(socket_stream.socket.getpeername()[0])
    except OSError:  # already disconnected
        return ""


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LENGTH:
        raise ValueError(f"a stream name is a string of 1 to {MAX_NAME_LENGTH} characters")


@asynccontextmanager
async def open_connections(
    identity: Identity,
    host: str = "127.0.0.1",
    port: int = 0,
    config: ConnectionConfig | None = None,
    *,
    bans: BanList | None = None,
) -> AsyncIterator[Connections]:
    """Listen for peer connections on ``host:port`` (0: an ephemeral port, see
    ``.port``) and dial others on demand, until the block ends.

    ``bans`` (the peer facade shares one with its DHT node) says whom to
    refuse and records offences; without it nobody is banned.

    Every task (listener, inbound connections, handlers, pool watchers) lives in
    a nursery owned by this context manager. Leaving the block closes all
    connections: pending operations raise ``ClosedError`` and handlers are
    cancelled. Raises ``OSError`` if the port cannot be bound.
    """
    config = config if config is not None else ConnectionConfig()
    try:
        async with trio.open_nursery() as nursery:
            net = Connections(
                identity, config, bans if bans is not None else BanList.disabled()
            )
            net.port = await nursery.start(net._run, host, port)
            try:
                yield net
            finally:
                net._close()
    except BaseExceptionGroup as group:
        # Our tasks catch their own failures, so a group holds the body's one
        # exception: re-raise it as itself, not wrapped.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
