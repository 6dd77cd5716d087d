"""The lossy all-reduce round: payload in datagrams, control on the reliable streams.

``AllReduceConfig(lossy=True)`` makes ``all_reduce`` run this round instead of
the TCP one (Weintraub, Banner, Orda 2025; DESIGN.md, "Networks like
volunteers have"). The butterfly is the same (member j reduces part j), but
each part is cut into pieces of ``PIECE_ELEMENTS`` values that travel in
authenticated UDP datagrams (``_datagrams``) and are never retransmitted.

Per (sender i, reducer j) pair, over one reliable stream ``LOSSY_STREAM``
opened by i to j (the control channel)::

    i -> j  header [version, group id, part j, sender i, weight, total, udp port, got, offer]
    j -> i  [udp port, round]                      (keys exported for ``round``)
    i => j  PART datagrams of part j, paced (``Pacer``)
    i -> j  ["sent", datagrams, seconds]            (end of sending)
    j -> i  ["report", received, seconds, contributor masks]
    j => i  RESULT datagrams of the averaged part j, paced
    j -> i  ["sent", datagrams, seconds]

The end-of-sending markers and the report go as datagrams too, before
their stream copies (``send_control``; ``_datagrams``, "Control copies"):
sealed once, sent ``CONTROL_COPIES`` times, under keys of their own exported
for ``round`` as the payload's. A lost TCP segment waits for TCP's
retransmission timer, and one lost twice or more in a row for its doubling
back-off (0.2-0.8 s at 10% loss, the longest waits of a round); a copy is
lost on its own. The receiving end acts on the first copy to arrive
(``_first_copy``) and never on a second: a marker only ends a wait, and a
sender that acted on the report's datagram copy, reading the stream's copy
later for the marker behind it, refuses one that differs (``ProtocolError``);
stream copies left unread are left to the pooled connection
(``Stream.leave_unread``). A report too long for one datagram goes by
stream only.

The header's copy. A sender that starts on the reducer's offer (below)
sends its header as a datagram too (``Kind.SENDER_HEADER``, the same
checks as the other control copies). Its key cannot come from the stream:
the reducer has the stream only once the header, its first message, arrived.
It comes from the connection the stream is opened on, which the reducer has
already (its handshake came before): a stream's keys are its connection's
(``Stream.export_key``), exported for the round the reducer chose for the
pair, which the sender knows from the offer and nobody else does. The
reducer tries each connection the sender dialed to it
(``Connections.inbound_key_exporters``, a few at most) and takes the one
whose key opens the copy; every key of the pair then comes from it, as the
stream's would. The alternative, a key carried in the reducer's own header
to the sender, would come from the reducer's stream to the sender: a second
stream whose header may be held up alike. The first of the two copies to be
accepted serves the pair (``_AwaitedStream``): what the reducer sends on the
stream meanwhile waits for it, a receive on it waits for it, and the
stream's header, once it comes, must equal the copy (``ProtocolError``
otherwise). A copy after the stream's header, or a second copy, changes
nothing. A stream that comes after its round ended gets what was queued
for it (``_Registry.keep_awaited``), so its connection stays pooled.

``offer`` is the round that i, as the reducer of part i, chose for j's
datagrams of part i (-1 where i reduces nothing that j sends): the same
number as i's reply on j's own stream, the port already in the header.
Every member sends its headers as its round starts, and j starts sending
part i at the first to arrive of i's header and i's reply: at best a one-way
trip after i's round began, rather than a round trip after j's own header
left, and at 10% loss the two rarely both lose a segment (a lost segment
waits for TCP's retransmission timer). j's datagrams may then reach i
before j's header does: i keeps them (``EARLY_PER_PIECE`` per piece at most)
until the header brings the keys to open them. Keys are exported from j's
stream either way, for the round i chose at random for this round:
a key never repeats, even for a group id that does.

``got`` is ``[round, received, seconds]``, what i got of the results that j
sent it in their last round together (j's pacer learns from it), or ``[]``.
It used to be a message of its own after the results, and the reducer's
round waited for it: at 10% loss one of a round's twelve pairs lost it more
often than not, and that reducer waited for TCP to resend it (50 ms at
most). A round late, it costs nothing; ``PacerRegistry.late_report`` judges
it as a stale report.

Each member opens one UDP socket for the round; its port travels in the
header and the reply. The masks of the report say, for each contributor of
part j (weight > 0), which of its pieces are in the result: "which pieces
each member received" is control, so every member knows exactly whose data is
in each piece it gets back (``AllReduceResult.contributors``, one set per
piece; ``chunk_elements`` is ``PIECE_ELEMENTS``).

When a phase ends. The reducer averages once every expected piece arrived, or
once each sender's end-of-sending arrived and, unless its last datagram or a
datagram copy of the marker (which leaves after it, on its flow) did too,
``DRAIN`` seconds more passed (datagrams sent before it may still be on
their way), or at the reduce
deadline, half the round's timeout after the start, whichever comes first. A
sender that has not opened its stream within ``sender_timeout`` is left out, as
is one whose stream breaks (what it delivered still counts). A member stops
waiting for a part's results the same way: all pieces, or the reducer's
end-of-sending plus ``DRAIN``, or the round's deadline; a marker not read by
then is not waited for, but left for the pooled connection to discard
(``Stream.leave_unread``). The estimator and what is lost: ``_pieces``.
Pieces of a part whose report never came keep the local values (we could
not say whose data is in them), and that reducer is in ``failed_reducers``;
senders left out entirely are in ``failed_senders``.
Losing a piece is not a failure.

Pacing. Nothing else protects a link from a sender flooding it: each peer
paces all the datagrams it sends to one rate (``Pacer``), set from what the
remotes reported for the previous flows, each burst of each flow at its turn
on one schedule (``_pacing``). What makes the reports true and the rate
reachable on a busy machine:

- arrivals are timed by the kernel (``SO_TIMESTAMPNS``), not when the reader
  gets to them, so a receiver short of CPU does not slow its senders down;
- a sender sends bursts of ``BURST`` seconds at its rate (``MIN_BURST`` to
  ``MAX_BURST`` datagrams) in one system call where the kernel segments UDP
  (``UDP_SEGMENT``), and one that fell behind catches up by
  ``_pacing.MAX_LAG`` at most, rather than in one long burst;
- the reader gathers ``GATHER`` seconds of datagrams per wake-up, and reads
  many of one flow in one system call where the kernel coalesces them
  (``UDP_GRO``).

Restrictions: only the ``NONE`` codec (raw float32) and the weighted mean
(no ``CenteredClip``): ``all_reduce`` raises ``ConfigError`` otherwise.
"""

from __future__ import annotations

import errno
import logging
import math
import secrets
import select
import socket
import struct
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol
from weakref import WeakKeyDictionary

import numpy as np
import torch
import trio

from swarm import PeerID, ProtocolError
from swarm._wire import expect_bytes, expect_float, expect_int, expect_list, expect_str

from ._datagrams import (
    FULL_DATAGRAM,
    PIECE_ELEMENTS,
    ControlOpener,
    ControlSealer,
    DatagramOpener,
    DatagramSealer,
    Kind,
    Pair,
    group_tag,
    key_label,
    peek_route,
)
from ._faults import DatagramFilter, FaultPlan
from ._group import Group, MemberMode
from ._pacing import PacerRegistry, Sending
from ._partition import Partition
from ._pieces import PieceMask, PieceReducer, contributor_codes, num_pieces
from ._rounds import RoundsByGroup

logger = logging.getLogger(__name__)

#: Name of the control stream of the lossy all-reduce.
LOSSY_STREAM = "allreduce-lossy"
LOSSY_VERSION = 3
#: Datagrams kept per piece of a sender's part that arrive before its
#: header (``_LossyRound.keep_early``): all of them, and duplicates, but not
#: a flood from a peer that is not sending the header.
EARLY_PER_PIECE = 2
#: Seconds a phase waits for late datagrams after the end-of-sending marker:
#: the marker travels on TCP, the datagrams it follows on UDP, and the two
#: may be reordered on the way by a few milliseconds. Only the path's
#: reordering: datagrams that reached the kernel meanwhile are read anyway
#: (``_Round.settled``), however busy the CPU. A phase waits this long only
#: when the link lost its last datagram and every datagram copy of the
#: marker (``_wait_for_pieces``): before, every phase that lost any datagram
#: did (most phases at 10% loss: a part of 8 datagrams loses one more often
#: than not), and then every phase that lost its last. Kept short: 50 ms
#: cost a round of the digits task 0.1 s, where the round takes 0.04 s.
DRAIN = 0.01
#: Datagram copies sent of each control message (``_LossyRound.send_control``),
#: back to back: on a link that loses packets at random, each copy is lost
#: on its own, and two lost at 10% is 1%. A copy is a few hundred bytes.
CONTROL_COPIES = 2
#: How long a control stream for a group this peer does not run (yet) waits.
UNKNOWN_GROUP_WAIT = 2.0
HEADER_TIMEOUT = 5.0
#: Kernel receive buffer asked for the round's socket: a burst from several
#: senders must not overflow it while the trio thread is busy.
SOCKET_BUFFER = 8 * 2**20
#: Longest burst a sender sends at once, in seconds at its paced rate: long
#: enough that one system call carries many datagrams (``UDP_SEGMENT``) and a
#: sleep between bursts is not shorter than trio's timers can honour; short
#: enough that a burst fits the queue of a home router many times over.
BURST = 0.004
#: Fewest and most datagrams in one burst (the kernel's limit for one
#: segmented send is 64 segments and 64 KiB in all, 46 of ours): a burst of
#: 11 kB costs a home router's queue nothing, and a trio timer per datagram
#: would cost more CPU than the sending.
MIN_BURST = 8
MAX_BURST = 32
#: The reader, woken by a datagram after finding the socket empty, lets this
#: many seconds of datagrams gather before it reads them: one wake-up per
#: batch rather than per datagram. Arrival times are the kernel's, so the
#: wait does not distort what the receiver reports.
GATHER = 0.002
# Linux socket options that Python's ``socket`` module does not name.
_SO_TIMESTAMPNS = 35  # a kernel receive timestamp with each datagram
_SO_SNDBUFFORCE = 32  # buffers beyond net.core.*mem_max (root only)
_SO_RCVBUFFORCE = 33
_UDP_SEGMENT = 103  # UDP segmentation offload: one send, many datagrams
_UDP_GRO = 104  # receive coalescing: one read, many datagrams of one flow
_SEGMENT_SIZE = struct.Struct("@i")  # the size of each coalesced datagram
#: Bytes asked of one read where datagrams come coalesced: the most one
#: coalesced read returns (64 KiB, as one segmented send).
_COALESCED_READ = 65535
#: What a kernel or device that cannot segment a send answers: no checksum
#: offload (EIO), a size or count over its limits (EINVAL, EMSGSIZE).
_SEGMENT_REFUSED = frozenset({errno.EIO, errno.EINVAL, errno.EMSGSIZE, errno.EOPNOTSUPP})
_TIMESPEC = struct.Struct("@qq")


class _ServedStream(Protocol):
    """What the reducer of a pair uses of the sender's stream."""

    remote: PeerID

    async def send(self, message: Any) -> None: ...
    async def receive(self) -> Any: ...
    async def aclose(self) -> None: ...
    def export_key(self, label: bytes) -> bytes: ...


class _LossyStream(_ServedStream, Protocol):
    def leave_unread(self, messages: int) -> None: ...


class LossyNetwork(Protocol):
    """The parts of ``swarm._connections.Connections`` the lossy round uses."""

    @property
    def peer_id(self) -> PeerID: ...

    def set_handler(self, name: str, handler: Callable[[Any], Any]) -> None: ...

    def open_stream(self, peer_id: PeerID, address: tuple[str, int], name: str) -> Any: ...

    def inbound_key_exporters(self, peer_id: PeerID) -> list[Callable[[bytes], bytes]]: ...


@dataclass(frozen=True)
class _Header:
    """A sender's header, checked for shape and ranges (``parse_header``)."""

    group_id: bytes
    part: int
    sender: int
    weight: float
    total: int
    port: int
    got: tuple[int, int, float] | None
    offer: int


def parse_header(message: Any) -> _Header:
    """A sender's header, from its stream or its datagram copy: its fields
    of the right types and ranges, else ``ProtocolError`` with the reason.
    What it says is checked against the round by ``accept_header``."""
    fields = expect_list(message, 9, "lossy all-reduce header")
    if expect_int(fields[0], "version") != LOSSY_VERSION:
        raise ProtocolError(f"lossy all-reduce version {fields[0]}, expected {LOSSY_VERSION}")
    weight = expect_float(fields[4], "weight")
    if not (math.isfinite(weight) and weight >= 0):
        raise ProtocolError("weight must be finite and >= 0")
    return _Header(
        group_id=expect_bytes(fields[1], "group id", max_size=64),
        part=expect_int(fields[2], "part", lo=0, hi=2**16 - 1),
        sender=expect_int(fields[3], "sender", lo=0, hi=2**16 - 1),
        weight=weight,
        total=expect_int(fields[5], "total", lo=0),
        port=expect_int(fields[6], "udp port", lo=1, hi=65535),
        got=_parse_got(fields[7]),
        offer=expect_int(fields[8], "offered round", lo=-1, hi=2**32 - 1),
    )


class _AwaitedStream:
    """The sender's stream, for a pair that the reducer serves on its
    header's datagram copy before the stream reached it (module docstring,
    "The header's copy"): keys from the connection the stream comes on,
    messages sent queued until it comes (``attach``), a receive waiting for
    it. Any failure to come is the round's deadline's business: the pair
    goes on by datagram meanwhile."""

    def __init__(self, remote: PeerID, export: Callable[[bytes], bytes], header: Any) -> None:
        self.remote = remote
        self._export = export
        self.header = header  # the copy: the stream's header must equal it
        self._stream: _ServedStream | None = None
        self._queue: list[Any] = []
        self._arrived = trio.Event()
        self._failure: ProtocolError | None = None
        self._closed = False
        #: set once the round is done with the stream (``_serve_by_copy``)
        self.served = trio.Event()

    def export_key(self, label: bytes) -> bytes:
        return self._export(label)

    @property
    def attached(self) -> bool:
        return self._arrived.is_set()

    async def send(self, message: Any) -> None:
        if self._failure is not None:
            raise self._failure
        if self._stream is None:
            self._queue.append(message)
            await trio.lowlevel.checkpoint()
        else:
            await self._stream.send(message)

    async def receive(self) -> Any:
        await self._arrived.wait()
        if self._failure is not None:
            raise self._failure
        assert self._stream is not None
        return await self._stream.receive()

    async def aclose(self) -> None:
        self._closed = True
        if self._stream is not None:
            await self._stream.aclose()
        else:
            await trio.lowlevel.checkpoint()

    async def attach(self, stream: _ServedStream, header: Any) -> None:
        """The stream came with ``header``: send what waited for it, in order,
        then serve it until the round is done with it. ``ProtocolError`` for
        a header other than the copy's (the pair's receives fail with it)."""
        if header != self.header:
            self._failure = ProtocolError("the header differs from its datagram copy")
            self._arrived.set()
            raise self._failure
        while self._queue:  # a send meanwhile joins the queue's end
            await stream.send(self._queue.pop(0))
        self._stream = stream
        self._arrived.set()
        if self._closed:
            await stream.aclose()
            return
        await self.served.wait()


@dataclass
class _Inbound:
    """One direction of one pair as the receiving end sees it."""

    opener: DatagramOpener
    on_piece: Callable[[int, np.ndarray], None]
    complete: trio.Event = field(default_factory=trio.Event)
    #: Set once the last piece the sender sends arrived (``expect_last``):
    #: the sender is done, whether or not its end-of-sending marker is.
    ended: trio.Event = field(default_factory=trio.Event)
    final: int = -1
    first: float | None = None
    last: float = 0.0

    def expect_last(self, piece: int) -> None:
        """The sender sends its pieces in order and ``piece`` last (-1: none)."""
        self.final = piece
        if piece >= 0 and self.opener.has(piece):
            self.ended.set()

    def deliver(self, datagram: bytes, when: float) -> None:
        """Open ``datagram``, which arrived at ``when`` (seconds: the kernel's
        receive time where the socket gives one, so that a receiver busy with
        other work does not make the path look slower than it is)."""
        opened = self.opener.open(datagram)
        if opened is None:
            return
        if self.first is None:
            self.first = when
        self.last = when
        self.on_piece(*opened)
        if opened[0] == self.final:
            self.ended.set()
        if self.opener.received == self.opener.pair.num_pieces:
            self.complete.set()
            self.ended.set()

    @property
    def span(self) -> float:
        return 0.0 if self.first is None else self.last - self.first


@dataclass
class _Control:
    """The datagram copies of one direction's control messages of a pair, by
    their first field (``"sent"``, ``"report"``). The first copy of each is
    kept; a different message under the same name (only the remote's key can
    seal one) is dropped as ``duplicate``, and one that is not a list named by
    a string as ``malformed``: what it says is checked where it is used, as
    the stream's copy is."""

    opener: ControlOpener
    messages: dict[str, Any] = field(default_factory=dict)
    changed: trio.Event = field(default_factory=trio.Event)

    def deliver(self, datagram: bytes) -> None:
        message = self.opener.open(datagram)
        if message is None:
            return
        if not (isinstance(message, list) and message and isinstance(message[0], str)):
            self.opener.dropped["malformed"] += 1
        elif message[0] in self.messages:
            self.opener.dropped["duplicate"] += 1
        else:
            self.messages[message[0]] = message
            self.changed.set()
            self.changed = trio.Event()

    async def wait(self, name: str) -> Any:
        """The first copy of the message ``name``, once one arrived."""
        while name not in self.messages:
            await self.changed.wait()
        return self.messages[name]


async def _first_copy(
    from_stream: Callable[[], Awaitable[Any]], control: _Control, name: str, taken: Counter[str]
) -> Any:
    """The control message ``name`` from whichever copy comes first: the
    stream's (``from_stream``, a cancelled receive loses nothing) or the
    datagram's, counted in ``taken``. The two are the same message, sealed
    once; where both come at once, the first to be read is the one."""
    first: list[tuple[Any, str]] = []
    async with trio.open_nursery() as nursery:

        async def by_datagram() -> None:
            first.append((await control.wait(name), "datagram copy"))
            nursery.cancel_scope.cancel()

        nursery.start_soon(by_datagram)
        first.append((await from_stream(), "stream"))
        nursery.cancel_scope.cancel()
    message, source = first[0]
    taken[source] += 1
    return message


class _ReducerMessages:
    """What a sender reads of a reducer's messages on their stream, in their
    order: its reply (unless the offer came first and it was read, with the
    report, only if it came first), its report and its end of results. Either
    of the last two may be taken from its datagram copy first: the stream's
    copy is then read when a later message is wanted, or left unread."""

    MESSAGES = 3  # reply, report, end of results

    def __init__(self, stream: _LossyStream, replied: bool, reply: tuple[int, int]) -> None:
        self._stream = stream
        self._reply_due = None if replied else reply
        self.read = 1 if replied else 0
        self._report: Any = None

    async def _next(self) -> Any:
        if self._reply_due is not None:
            reply = _parse_reply(await self._stream.receive())
            self.read += 1
            if reply != self._reply_due:
                raise ProtocolError("the reducer's reply differs from its offer")
            self._reply_due = None
        message = await self._stream.receive()
        self.read += 1
        return message

    async def report(self) -> Any:
        if self._report is None:
            self._report = await self._next()
        return self._report

    async def end_of_results(self, report: Any) -> Any:
        """The marker behind the report, whose stream copy must be ``report``,
        the copy acted on (``ProtocolError`` otherwise)."""
        if await self.report() != report:
            raise ProtocolError("the reducer's report differs from its datagram copy")
        return await self._next()

    @property
    def unread(self) -> int:
        return self.MESSAGES - self.read


@dataclass(frozen=True)
class LossyOutcome:
    """What ``lossy_all_reduce`` did, for ``AllReduceResult``."""

    partition: Partition
    contributors: tuple[tuple[frozenset[int], ...], ...]
    failed_senders: frozenset[int]
    failed_reducers: frozenset[int]
    timed_out: bool
    dropped: dict[str, int]


async def lossy_all_reduce(
    net: LossyNetwork,
    group: Group,
    flat: torch.Tensor,
    weight: float,
    *,
    sender_timeout: float,
    round_timeout: float,
    fault_plan: FaultPlan | None = None,
) -> LossyOutcome:
    """Average ``flat`` (float32 vector) with ``group`` in place, pieces by datagram.

    Every member calls this with the same group and vector size. Each piece
    of the result is the renormalised weighted mean over the contributions
    that reached its reducer (``_pieces``), or the local values where the
    reduced piece did not come back. Returns at the latest ``round_timeout``
    after the call (``timed_out``). Raises ``OSError`` if no UDP socket can be
    opened (before anything is sent). On cancellation ``flat`` is unchanged
    (results are written only at the end) and the cancellation propagates.
    """
    partition = Partition.for_group(group, flat.numel(), PIECE_ELEMENTS)
    family = socket.AF_INET6 if ":" in group.local.host else socket.AF_INET
    # A plain non-blocking socket, read by one task (``read_datagrams``) that
    # can tell when the kernel's queue is empty (``settled``).
    sock = socket.socket(family, socket.SOCK_DGRAM)
    with sock:
        sock.setblocking(False)
        segmented, stamped, coalesced = _tune(sock)
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        rnd = _LossyRound(net, group, partition, flat, weight, sock, sender_timeout, round_timeout)
        rnd.segmented, rnd.stamped, rnd.coalesced = segmented, stamped, coalesced
        plan = fault_plan if fault_plan is not None else FaultPlan()
        faults = plan.datagrams.filter(group.local_index) if plan.datagrams else None
        with trio.move_on_after(round_timeout) as deadline, _registry(net).register(rnd):
            async with trio.open_nursery() as outer:
                outer.start_soon(rnd.read_datagrams, faults)
                async with trio.open_nursery() as nursery:
                    rnd.nursery = nursery
                    if rnd.reducer is not None:
                        nursery.start_soon(rnd.reduce)
                    if group.local.mode is not MemberMode.AUX:
                        for part in rnd.parts_to_send:
                            nursery.start_soon(rnd.send_part, part)
                outer.cancel_scope.cancel()
            _registry(net).keep_awaited(rnd)
        return rnd.finish(timed_out=deadline.cancelled_caught)


def _tune(sock: socket.socket) -> tuple[bool, bool, bool]:
    """Large buffers, segmentation offload, receive coalescing and receive
    timestamps where the kernel has them: ``(segmented, stamped,
    coalesced)``. Each is an optimisation with a fallback (a datagram per
    send call; the time the reader took it; a datagram per read)."""
    for force, option in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF), (_SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)
        except OSError:  # not root: as much as net.core.*mem_max allows
            with suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    if sys.platform != "linux":
        return False, False, False
    flags = []
    for level, option, value in (
        (socket.IPPROTO_UDP, _UDP_SEGMENT, FULL_DATAGRAM),
        (socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1),
        (socket.IPPROTO_UDP, _UDP_GRO, 1),
    ):
        try:
            sock.setsockopt(level, option, value)
            flags.append(True)
        except OSError:
            flags.append(False)
    segmented, stamped, coalesced = flags
    return segmented, stamped, coalesced


def _segments(data: bytes, cmsgs: list[tuple[int, int, bytes]]) -> tuple[float, list[bytes]]:
    """What one read of the round's socket returned: the kernel's receive
    time (``SO_TIMESTAMPNS``; else now) and the datagrams in ``data``, which
    holds several of one flow, each of the segment size the kernel gives
    but the last, where it coalesced them (``UDP_GRO``)."""
    when = None
    segment = 0
    for level, kind, payload in cmsgs:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
            when = seconds + nanoseconds * 1e-9
        elif level == socket.IPPROTO_UDP and kind == _UDP_GRO:
            (segment,) = _SEGMENT_SIZE.unpack_from(payload)
    if when is None:
        when = trio.current_time()
    if segment <= 0 or len(data) <= segment:
        return when, [data]
    return when, [data[i : i + segment] for i in range(0, len(data), segment)]


async def send_burst(
    sock: socket.socket, burst: list[bytes], address: tuple[str, int], segmented: bool
) -> bool:
    """Send the datagrams of ``burst`` from the non-blocking ``sock``, in one
    system call if ``segmented`` (``UDP_SEGMENT`` is set on ``sock``: the
    kernel cuts the buffer into datagrams of the first one's size, so every
    datagram but the last must be that size, as all but a part's last piece
    are ``FULL_DATAGRAM`` bytes). Returns whether to go on segmenting: a
    device or a kernel that refuses a segmented send (``_SEGMENT_REFUSED``)
    gets the burst again one datagram at a time, and from then on only so.
    A datagram the kernel refuses otherwise (ENOBUFS, an ICMP error from a
    peer that left) is lost, as one dropped on the way would be."""
    if segmented and len(burst) > 1:
        while True:
            try:
                sock.sendto(b"".join(burst), address)
                return True
            except BlockingIOError:
                await _wait_for_buffer()
            except OSError as e:
                if e.errno not in _SEGMENT_REFUSED:
                    return True
                break
        segmented = False
    for datagram in burst:
        while True:
            try:
                sock.sendto(datagram, address)
                break
            except BlockingIOError:
                await _wait_for_buffer()
            except OSError:
                break
    return segmented


async def _wait_for_buffer() -> None:
    """The send buffer is full. Several tasks send on one socket, and only one
    may wait for it to become writable: poll."""
    await trio.sleep(0.001)


class _LossyRound:
    """One member's state for one lossy round: its reducer and sender roles."""

    def __init__(
        self,
        net: LossyNetwork,
        group: Group,
        partition: Partition,
        flat: torch.Tensor,
        weight: float,
        sock: socket.socket,
        sender_timeout: float,
        round_timeout: float,
    ) -> None:
        self.net = net
        self.group = group
        self.partition = partition
        self.flat = flat
        self.weight = weight
        self.sock = sock
        self.sender_timeout = sender_timeout
        self.reduce_deadline = trio.current_time() + round_timeout / 2
        self.tag = group_tag(group.group_id)
        self.pacers = _pacers(net)
        self.me = me = group.local_index
        self.inbound: dict[tuple[int, int, int], _Inbound] = {}
        self._all_inbound: list[_Inbound] = []  # for the counts of dropped datagrams
        #: The datagram copies of control messages, by route as ``inbound``.
        self.controls: dict[tuple[int, int, int], _Control] = {}
        self._all_controls: list[_Control] = []
        #: Where the round took each end of sending and report from: the
        #: "stream", the "datagram copy", the "last datagram" of a phase.
        self.taken: Counter[str] = Counter()
        self.stray = 0
        self._header_drops: Counter[str] = Counter()  # of header copies
        self._empty = trio.Event()
        self._idle = False  # the reader waits for the socket to become readable
        self.segmented = False  # one send call may carry many datagrams (``_tune``)
        self.stamped = False  # datagrams come with the kernel's receive time
        self.coalesced = False  # one read may return many datagrams (``_tune``)
        # Reducer role.
        self.reducer: PieceReducer | None = None
        self.reduced = trio.Event()
        self._senders_left = {s for s in group.senders() if s != me}
        #: The other members' parts with values to reduce (``send_part``).
        self.parts_to_send = [
            j for j in range(group.size) if j != me and partition.part_size(j) > 0
        ]
        #: The flows of each phase (``Sending.flows``): our results go to
        #: every other sender, our values to every other part's reducer.
        self._result_flows = max(1, len(self._senders_left))
        self._part_flows = max(1, len(self.parts_to_send))
        self._accepted: set[int] = set()
        self._serving = 0  # senders being served (``serve_sender``)
        self._failed_senders: set[int] = set()
        self._changed = trio.Event()
        #: The round of each sender's datagrams to us, chosen before its
        #: header arrives: it travels in our header to that sender as well.
        self._rounds: dict[int, int] = {}
        #: Pairs served on the header's datagram copy, by sender.
        self.awaited: dict[int, _AwaitedStream] = {}
        #: Of those, the senders whose ``serve_sender`` has not started yet:
        #: their datagrams are kept as before their header.
        self._starting: set[int] = set()
        #: Where the pairs served on a header's copy run (``lossy_all_reduce``).
        self.nursery: trio.Nursery | None = None
        #: Datagrams of a sender that came before its header, by route.
        self._early: dict[tuple[int, int, int], list[tuple[bytes, float]]] = {}
        if partition.part_size(me) > 0:
            self.reducer = PieceReducer(
                partition.part_size(me), dict.fromkeys(group.senders(), 0.0)
            )
            self._rounds = {s: secrets.randbelow(2**32) for s in self._senders_left}
        # Sender role: results by part, written into ``flat`` only at the end.
        self._results: dict[int, tuple[np.ndarray, PieceMask, dict[int, PieceMask]]] = {}
        self._failed_reducers: set[int] = set()
        #: (udp port, round) that each reducer offered in its own header to us.
        self._offers: dict[int, tuple[int, int]] = {}
        self._offered = [trio.Event() for _ in group.members]

    # ------------------------------------------------------------- datagrams

    async def read_datagrams(self, faults: DatagramFilter | None) -> None:
        """Route every datagram to its pair's opener until cancelled.

        Where the kernel coalesces a flow's datagrams (``UDP_GRO``), one
        system call reads up to 64 KiB of them, cut apart here at the size
        the kernel gives (``_segments``)."""
        batch = 0
        sock = self.sock
        size = _COALESCED_READ if self.coalesced else 2048
        ancillary = socket.CMSG_SPACE(_TIMESPEC.size) if self.stamped else 0
        if self.coalesced:
            ancillary += socket.CMSG_SPACE(_SEGMENT_SIZE.size)
        inbound_of, controls = self.inbound.get, self.controls
        while True:
            try:
                data, cmsgs, _, _ = sock.recvmsg(size, ancillary)
            except BlockingIOError:
                self._empty.set()
                self._empty = trio.Event()
                self._idle = True
                try:
                    await trio.lowlevel.wait_readable(sock)
                finally:
                    self._idle = False
                if self.stamped:
                    await trio.sleep(GATHER)
                continue
            except OSError:  # e.g. ICMP port unreachable from a round that ended
                await trio.lowlevel.checkpoint()
                continue
            when, datagrams = _segments(data, cmsgs)
            for one in datagrams:
                for datagram in faults(one) if faults is not None else (one,):
                    route = peek_route(datagram)
                    inbound = inbound_of(route) if route is not None else None
                    if inbound is not None:
                        inbound.deliver(datagram, when)
                    elif route is not None and route in controls:
                        controls[route].deliver(datagram)
                    elif route is not None and route[:2] == (Kind.SENDER_HEADER, self.me):
                        self.take_header_copy(route[2], datagram)
                    elif route is None or not self.keep_early(route, datagram, when):
                        self.stray += 1
                batch += 1
                if batch % 64 == 0:  # let the senders and the control streams run
                    await trio.lowlevel.checkpoint()

    def keep_early(self, route: tuple[int, int, int], datagram: bytes, when: float) -> bool:
        """Keep ``datagram`` if it may be a piece of our part from a sender
        whose header has not come yet (it had our round from our own header,
        module docstring); ``serve_sender`` opens it once the header brings
        the keys. At most ``EARLY_PER_PIECE`` datagrams per piece a sender:
        nothing in a datagram is authenticated before then."""
        kind, part, sender = route
        me = self.group.local_index
        if kind != Kind.PART or part != me or sender not in self._rounds:
            return False
        if sender not in self._senders_left:
            return False
        if sender in self._accepted and sender not in self._starting:
            return False  # ``serve_sender`` opens its datagrams now
        kept = self._early.setdefault(route, [])
        if len(kept) >= EARLY_PER_PIECE * num_pieces(self.partition.part_size(me)):
            return False
        kept.append((datagram, when))
        return True

    async def settled(self) -> None:
        """Return once the reader has found the kernel's queue empty after
        this call: every datagram that had arrived by then was delivered. A
        phase ends with this after its drain, so that a busy CPU, which delays
        the reader as much as the drain's timer, does not lose datagrams
        that did arrive."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if readable or not self._idle:
            await self._empty.wait()

    async def _end_of_sending(
        self,
        from_stream: Callable[[], Awaitable[Any]],
        inbound: _Inbound,
        control: _Control,
        what: str,
    ) -> None:
        """Wait until the remote is done sending ``inbound``'s datagrams: the
        first to come of its end-of-sending marker (the stream's copy, read by
        ``from_stream``, or the datagram copy) and the last datagram it sends.

        Why all three: a marker is one small TCP segment, and one the link
        loses waits for TCP's retransmission timer (200 ms at least, doubling
        with each loss in a row); the last datagram and the marker's datagram
        copies say the same, and are lost each on its own. ``ProtocolError``
        for a malformed marker."""
        async with trio.open_nursery() as nursery:

            async def by_datagram() -> None:
                await inbound.ended.wait()
                self.taken["last datagram"] += 1
                nursery.cancel_scope.cancel()

            nursery.start_soon(by_datagram)
            _check_marker(await _first_copy(from_stream, control, "sent", self.taken), what)
            nursery.cancel_scope.cancel()

    def _control(
        self, stream: _ServedStream, kind: Kind, round_: int, part: int, sender: int
    ) -> tuple[ControlSealer, _Control]:
        """Our sealer of ``kind``'s control copies in the pair (``part``,
        ``sender``) and the receiving end of the other direction's."""
        other = Kind.SENDER_CONTROL if kind is Kind.REDUCER_CONTROL else Kind.REDUCER_CONTROL
        gid = self.group.group_id
        size = self.partition.part_size(part)
        sealer = ControlSealer(
            stream.export_key(key_label(kind, gid, round_)),
            Pair(kind, self.tag, round_, part, sender, size),
        )
        control = _Control(
            ControlOpener(
                stream.export_key(key_label(other, gid, round_)),
                Pair(other, self.tag, round_, part, sender, size),
            )
        )
        self.controls[(int(other), part, sender)] = control
        self._all_controls.append(control)
        return sealer, control

    def send_control(self, sealer: ControlSealer, message: Any, address: tuple[str, int]) -> None:
        """Send ``CONTROL_COPIES`` datagram copies of ``message`` (before its
        stream copy). One too long for a datagram (a report on a part of
        thousands of pieces) goes by the stream only. Not paced: a few
        hundred bytes per pair and round; a copy the kernel refuses is lost,
        as one dropped on the way would be."""
        try:
            datagram = sealer.seal(message)
        except ValueError:
            return
        for _ in range(CONTROL_COPIES):
            try:
                self.sock.sendto(datagram, address)
            except OSError:
                return

    async def _wait_for_pieces(self, inbound: _Inbound, control: _Control) -> None:
        """After the end-of-sending marker: all pieces, or what had arrived
        by the time the last datagram the remote sends did or a datagram
        copy of its marker (``control``), or else once ``DRAIN`` passed. On
        a path that keeps datagrams in order nothing sent before the last is
        still on its way once it arrived (what is missing was lost); the
        marker's copies leave after the last, from the same socket to the
        same one (one flow, even to a router that queues flows apart), so
        they say as much, and each is lost on its own, where the last
        datagram goes with its burst. The stream's marker may pass them all,
        so what reached the kernel is read first (``settled``)."""
        if inbound.complete.is_set():
            return
        await self.settled()
        if not (inbound.ended.is_set() or "sent" in control.messages):
            with trio.move_on_after(DRAIN):
                async with trio.open_nursery() as nursery:

                    async def by_copy() -> None:
                        await control.wait("sent")
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(by_copy)
                    await inbound.ended.wait()
                    nursery.cancel_scope.cancel()
            await self.settled()

    async def _send_datagrams(
        self,
        sealer: DatagramSealer,
        values: np.ndarray,
        pieces: Iterable[int],
        address: tuple[str, int],
        flows: int,
    ) -> Sending:
        """Seal and send ``pieces`` of ``values`` (the whole part) in bursts
        of ``BURST`` seconds at the pacer's rate, each at its turn in the
        peer's one schedule (``_pacing.Schedule``), one of the ``flows`` that
        its phase sends; return what the pacer is told of it. On
        cancellation, what was sent is sent."""
        data = memoryview(np.ascontiguousarray(values, dtype="<f4").data).cast("B")
        pacer, schedule = self.pacers.pacer, self.pacers.schedule
        sealed0 = sealer.sealed
        rate = pacer.rate
        per_burst = max(MIN_BURST, min(MAX_BURST, int(rate * BURST / FULL_DATAGRAM)))
        part_bytes = 4 * values.size
        first: float | None = None
        end = late = 0.0
        sent_bytes = 0
        burst: list[bytes] = []
        pending = iter(pieces)
        while True:
            burst.clear()
            burst_bytes = 0
            for piece in pending:
                lo = piece * 4 * PIECE_ELEMENTS
                hi = min(lo + 4 * PIECE_ELEMENTS, part_bytes)
                datagram = sealer.seal_bytes(piece, data[lo:hi])
                burst.append(datagram)
                burst_bytes += len(datagram)
                if len(burst) == per_burst:
                    break
            if not burst:
                break
            now = trio.current_time()
            rate = pacer.rate
            start, lag = schedule.reserve(now, burst_bytes, rate)
            if first is None:
                first = start  # a flow's first turn may come after an idle spell
            else:
                late += lag
            if start > now:
                await trio.sleep(start - now)
            else:
                await trio.lowlevel.checkpoint()
            self.segmented = await send_burst(self.sock, burst, address, self.segmented)
            end = start + burst_bytes / rate
            sent_bytes += burst_bytes
        span = 0.0 if first is None else end - first
        # What share of the schedule this flow had: the others took the rest.
        share = min(1.0, sent_bytes / span / rate) if span > 0 else 1.0
        # The rate of its last burst is the one the report speaks for: the
        # schedule follows the pacer from burst to burst.
        return Sending(sealer.sealed - sealed0, span, rate, share, late, flows)

    # ----------------------------------------------------------------- reducer

    def accept_header(self, remote: PeerID, header: _Header) -> None:
        """Take a sender's header (``parse_header``) from ``remote``, checked
        against this round. The round it offers for our datagrams of its part
        is kept for ``send_part``.

        Raises ``ProtocolError`` with the one-line reason for the refusal.
        """
        me = self.group.local_index
        if header.group_id != self.group.group_id:
            raise ProtocolError("a header of another group")
        if header.part != me or self.reducer is None:
            raise ProtocolError(f"part {header.part} is not reduced here (member {me})")
        sender = header.sender
        if sender >= self.group.size:
            raise ProtocolError(f"sender {sender} is not a member of a group of {self.group.size}")
        if header.total != self.partition.total:
            raise ProtocolError(f"vector sizes differ: ours has {self.partition.total} elements")
        member = self.group.members[sender]
        if remote != member.peer_id:
            raise ProtocolError(f"member {sender} of the group is another peer")
        if member.mode is MemberMode.AUX or sender == me:
            raise ProtocolError(f"member {sender} sends no data here")
        if sender in self._accepted or sender not in self._senders_left:
            raise ProtocolError(f"member {sender} already has a stream, or is too late")
        self._accepted.add(sender)
        if header.offer >= 0:
            self._offers[sender] = (header.port, header.offer)
            self._offered[sender].set()
        if header.got is not None:
            self.pacers.late_report(remote, *header.got)

    def take_header_copy(self, sender: int, datagram: bytes) -> None:
        """Serve ``sender``'s pair on its header's datagram copy, if it opens
        under the key of a connection ``sender`` dialed to us and its stream's
        header has not come (module docstring, "The header's copy"). A copy
        that no key opens is counted as ``unopened header``: forged, or
        sealed under a connection whose handshake has not ended here (the
        first round on a new connection); one whose header this round
        refuses, as ``refused header``: the stream's copy is refused as
        always when it comes."""
        round_ = self._rounds.get(sender)
        if round_ is None or sender in self._accepted or sender not in self._senders_left:
            return  # a second copy, one behind the stream, or not a pair of ours
        me = self.group.local_index
        peer = self.group.members[sender].peer_id
        pair = Pair(Kind.SENDER_HEADER, self.tag, round_, me, sender, self.partition.part_size(me))
        label = key_label(Kind.SENDER_HEADER, self.group.group_id, round_)
        dropped: Counter[str] = Counter({"unopened header": 1})
        for export in self.net.inbound_key_exporters(peer):
            opener = ControlOpener(export(label), pair)
            message = opener.open(datagram)
            if message is not None:
                break
            if "forged" not in opener.dropped:  # malformed or misrouted under any key
                dropped = opener.dropped
        else:
            self._header_drops.update(dropped)
            return
        try:
            header = parse_header(message)
            if header.sender != sender:
                raise ProtocolError(f"sender {header.sender} in a copy from member {sender}")
            self.accept_header(peer, header)
        except ProtocolError as e:
            logger.info("lossy all-reduce: member %d's header copy refused: %s", sender, e)
            self._header_drops["refused header"] += 1
            return
        awaited = self.awaited[sender] = _AwaitedStream(peer, export, message)
        self._starting.add(sender)
        self.taken["header datagram copy"] += 1
        assert self.nursery is not None  # the reducer's task runs until the sender is done
        self.nursery.start_soon(self._serve_by_copy, awaited, header)

    async def _serve_by_copy(self, awaited: _AwaitedStream, header: _Header) -> None:
        try:
            await self.serve_sender(awaited, header.sender, header.weight, header.port)
        finally:
            awaited.served.set()

    def _sender_done(self, sender: int, *, failed: bool = False) -> None:
        self._senders_left.discard(sender)
        if failed:
            self._failed_senders.add(sender)
        self._changed.set()
        self._changed = trio.Event()

    async def reduce(self) -> None:
        """Average our part once its phase ends (module docstring)."""
        assert self.reducer is not None
        me = self.group.local_index
        lo, hi = self.partition.part_bounds[me]
        if me in self.group.senders():
            self.reducer.set_weight(me, self.weight)
            self.reducer.add_all(me, self.flat[lo:hi])
        start = trio.current_time()
        with trio.move_on_at(self.reduce_deadline):
            while self._senders_left:
                late = trio.current_time() >= start + self.sender_timeout
                for sender in list(self._senders_left - self._accepted) if late else []:
                    self._sender_done(sender, failed=True)
                if not self._senders_left:
                    break
                with trio.move_on_at(start + self.sender_timeout if not late else math.inf):
                    await self._changed.wait()
        for sender in self._senders_left - self._accepted:
            self._sender_done(sender, failed=True)
        self.reducer.finish()
        self.reduced.set()
        # Our socket closes when the round returns: serve every sender we
        # accepted (they are bounded by the round's deadline) first.
        while self._serving:
            await self._changed.wait()

    async def serve_sender(
        self, stream: _ServedStream, sender: int, weight: float, port: int
    ) -> None:
        """The reducer's side of one pair, until the sender has its results.

        The per-sender boundary: a failure ends this pair only.
        """
        assert self.reducer is not None
        reducer = self.reducer
        me = self.group.local_index
        self._serving += 1
        try:
            reducer.set_weight(sender, weight)
            round_ = self._rounds[sender]
            gid = self.group.group_id
            part_size = self.partition.part_size(me)
            up = Pair(Kind.PART, self.tag, round_, me, sender, part_size)
            inbound = _Inbound(
                DatagramOpener(stream.export_key(key_label(Kind.PART, gid, round_)), up),
                lambda piece, values: self._sender_piece(sender, piece, values),
            )
            route = (int(Kind.PART), me, sender)
            self.inbound[route] = inbound
            self._all_inbound.append(inbound)
            sealer_down, control = self._control(stream, Kind.REDUCER_CONTROL, round_, me, sender)
            self._starting.discard(sender)
            for datagram, when in self._early.pop(route, ()):
                inbound.deliver(datagram, when)
            await stream.send([self.sock.getsockname()[1], round_])
            inbound.expect_last(up.num_pieces - 1)  # every piece, in order
            await self._end_of_sending(stream.receive, inbound, control, "end of sending")
            await self._wait_for_pieces(inbound, control)
            self._sender_done(sender)
            await self.reduced.wait()
            del self.inbound[route]
            masks = [
                [s, mask.to_bytes()]
                for s, mask in sorted(reducer.masks.items())
                if mask.count and reducer.weight(s) > 0
            ]
            address = (self.group.members[sender].host, port)
            report = ["report", inbound.opener.received, inbound.span, masks]
            self.send_control(sealer_down, report, address)
            await stream.send(report)
            # The all-gather: our averaged part back to the sender.
            down = Pair(Kind.RESULT, self.tag, round_, me, sender, part_size)
            sealer = DatagramSealer(stream.export_key(key_label(Kind.RESULT, gid, round_)), down)
            result = reducer.result()
            pieces = (p for p in range(down.num_pieces) if reducer.has_result(p))
            sent = await self._send_datagrams(
                sealer, result.numpy(), pieces, address, self._result_flows
            )
            marker = ["sent", sealer.sealed, sent.span]
            self.send_control(sealer_down, marker, address)
            await stream.send(marker)
            # What the sender got comes with its next header. An end of
            # sending still unread (its last datagram came first) is left
            # to the connection, which discards it with the stream.
            self.pacers.results_sent(stream.remote, round_, sent)
        except Exception as e:  # per-peer boundary: this sender only
            logger.info("lossy all-reduce: serving member %d failed: %r", sender, e)
            self._sender_done(sender, failed=not self.reduced.is_set())
            await stream.aclose()
        finally:
            self._serving -= 1
            self._changed.set()
            self._changed = trio.Event()

    def _sender_piece(self, sender: int, piece: int, values: np.ndarray) -> None:
        assert self.reducer is not None
        self.reducer.add(sender, piece, values)
        if self.reducer.masks[sender].complete:
            self._sender_done(sender)

    # ------------------------------------------------------------------ sender

    async def send_part(self, part: int) -> None:
        """Send our values of ``part`` to its reducer and take its results back.

        The per-reducer boundary: a failure leaves this part at our local
        values and marks its reducer failed.
        """
        me = self.group.local_index
        member = self.group.members[part]
        lo, hi = self.partition.part_bounds[part]
        part_size = hi - lo
        try:
            async with self.net.open_stream(member.peer_id, member.address, LOSSY_STREAM) as stream:
                header = [
                    LOSSY_VERSION,
                    self.group.group_id,
                    part,
                    me,
                    self.weight,
                    self.partition.total,
                    self.sock.getsockname()[1],
                    list(self.pacers.take_got(member.peer_id) or ()),
                    self._rounds.get(part, -1),
                ]
                await stream.send(header)
                port, round_, replied = await self._reducer_round(stream, part)
                gid = self.group.group_id
                if not replied:
                    # Our header may be held up on its way (module docstring,
                    # "The header's copy"); had the reply come, it was not.
                    header_up = Pair(Kind.SENDER_HEADER, self.tag, round_, part, me, part_size)
                    label = key_label(Kind.SENDER_HEADER, gid, round_)
                    self.send_control(
                        ControlSealer(stream.export_key(label), header_up),
                        header,
                        (member.host, port),
                    )
                buffer = np.zeros(part_size, dtype=np.float32)
                got = PieceMask(num_pieces(part_size))

                def on_result(piece: int, values: np.ndarray) -> None:
                    a, b = down.piece_bounds(piece)
                    buffer[a:b] = values
                    got.add(piece)

                down = Pair(Kind.RESULT, self.tag, round_, part, me, part_size)
                inbound = _Inbound(
                    DatagramOpener(stream.export_key(key_label(Kind.RESULT, gid, round_)), down),
                    on_result,
                )
                self.inbound[(int(Kind.RESULT), part, me)] = inbound
                self._all_inbound.append(inbound)
                sealer_up, control = self._control(stream, Kind.SENDER_CONTROL, round_, part, me)
                up = Pair(Kind.PART, self.tag, round_, part, me, part_size)
                sealer = DatagramSealer(stream.export_key(key_label(Kind.PART, gid, round_)), up)
                values = self.flat[lo:hi].numpy()
                address = (member.host, port)
                sent = await self._send_datagrams(
                    sealer, values, range(up.num_pieces), address, self._part_flows
                )
                marker = ["sent", sealer.sealed, sent.span]
                self.send_control(sealer_up, marker, address)
                await stream.send(marker)
                messages = _ReducerMessages(stream, replied, (port, round_))
                acted = await _first_copy(messages.report, control, "report", self.taken)
                report = expect_list(acted, 4, "reducer report")
                if expect_str(report[0], "marker") != "report":
                    raise ProtocolError("expected the reducer's report")
                received = expect_int(report[1], "pieces received", lo=0, hi=sealer.sealed)
                arrival = expect_float(report[2], "seconds")
                self.pacers.sender_report(member.peer_id, sent, received, arrival)
                masks = self._parse_masks(report[3], got.n)
                codes = contributor_codes(masks, got.n)
                nonzero = np.flatnonzero(codes)
                inbound.expect_last(int(nonzero[-1]) if nonzero.size else -1)
                await self._end_of_sending(
                    lambda: messages.end_of_results(acted), inbound, control, "end of results"
                )
                await self._wait_for_pieces(inbound, control)
                # From here on nothing more is taken: the result is what arrived.
                del self.inbound[(int(Kind.RESULT), part, me)]
                self._results[part] = (buffer, got, masks)
                self.pacers.results_got(
                    member.peer_id, round_, inbound.opener.received, inbound.span
                )
                if messages.unread:
                    # Their datagram copies came first, or the last datagram
                    # said the same as the marker: the pooled connection
                    # discards the stream's copies when they come.
                    stream.leave_unread(messages.unread)
        except Exception as e:  # per-peer boundary: this reducer only
            if part not in self._results:  # after them: only the stream's end was left
                logger.info("lossy all-reduce: part %d from member %d failed: %r", part, part, e)
                self._failed_reducers.add(part)

    async def _reducer_round(self, stream: _LossyStream, part: int) -> tuple[int, int, bool]:
        """``(udp port, round, replied)`` for our datagrams of ``part``: from
        the reducer's reply on ``stream`` (``replied``) or from the offer in
        its own header to us, whichever comes first (module docstring). The
        reply not read yet is read later: a cancelled receive loses nothing."""
        reply: tuple[int, int] | None = None
        async with trio.open_nursery() as nursery:

            async def by_offer() -> None:
                await self._offered[part].wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(by_offer)
            reply = _parse_reply(await stream.receive())
            nursery.cancel_scope.cancel()
        if reply is None:
            return (*self._offers[part], False)
        return (*reply, True)

    def _parse_masks(self, obj: Any, n: int) -> dict[int, PieceMask]:
        if not isinstance(obj, list) or len(obj) > self.group.size:
            raise ProtocolError("contributor masks: expected a list, one per contributor at most")
        entries = obj
        masks: dict[int, PieceMask] = {}
        senders = set(self.group.senders())
        for entry in entries:
            fields = expect_list(entry, 2, "contributor mask")
            s = expect_int(fields[0], "contributor", lo=0, hi=self.group.size - 1)
            if s not in senders or s in masks:
                raise ProtocolError(f"contributor {s} is not a sender, or named twice")
            masks[s] = PieceMask.from_bytes(expect_bytes(fields[1], "mask", max_size=n), n)
        return masks

    # ------------------------------------------------------------------ result

    def finish(self, *, timed_out: bool) -> LossyOutcome:
        """Write the results into ``flat``; what each piece holds."""
        me = self.group.local_index
        local = frozenset({me})
        contributors: list[tuple[frozenset[int], ...]] = []
        aux = self.group.local.mode is MemberMode.AUX
        flat = self.flat.numpy()
        # Contributor sets are computed for whole parts at once (one integer
        # per piece, a bit per sender): a round has thousands of pieces.
        sets: dict[int, frozenset[int]] = {0: frozenset() if aux else local}

        def as_set(code: int) -> frozenset[int]:
            found = sets.get(code)
            if found is None:
                found = sets[code] = frozenset(s for s in range(code.bit_length()) if code >> s & 1)
            return found

        for part, (lo, hi) in enumerate(self.partition.part_bounds):
            n = num_pieces(hi - lo)
            codes: np.ndarray | None = None
            values: np.ndarray | None = None
            if part == me and self.reducer is not None and self.reduced.is_set():
                codes, values = self.reducer.contributor_codes(), self.reducer.result().numpy()
            elif part in self._results and not aux:
                buffer, got, masks = self._results[part]
                # a piece nobody contributed to cannot be a result
                codes, values = contributor_codes(masks, n) * got.array(), buffer
            elif part != me and hi > lo and not aux:
                self._failed_reducers.add(part)
            if codes is None or values is None:
                contributors.append((sets[0],) * n)
                continue
            if not aux:
                keep = np.repeat(codes != 0, PIECE_ELEMENTS)[: hi - lo]
                np.copyto(flat[lo:hi], values, where=keep)
            contributors.append(tuple(as_set(code) for code in codes.tolist()))
        dropped: Counter[str] = Counter()
        for inbound in self._all_inbound:
            dropped.update(inbound.opener.dropped)
        for control in self._all_controls:
            dropped.update(control.opener.dropped)
        dropped.update(self._header_drops)
        if self.stray:
            dropped["stray"] = self.stray
        if not aux:
            self._log(contributors, dropped)
        return LossyOutcome(
            partition=Partition(self.partition.total, self.partition.part_bounds, PIECE_ELEMENTS),
            contributors=tuple(contributors),
            failed_senders=frozenset(self._failed_senders),
            failed_reducers=frozenset(self._failed_reducers),
            timed_out=timed_out,
            dropped=dict(dropped),
        )

    def _log(self, contributors: list[tuple[frozenset[int], ...]], dropped: Counter[str]) -> None:
        """One line per round: how much of the senders' data our result holds,
        counted per element (what "averaged with k peers" means here)."""
        senders = len(self.group.senders())
        have = total = 0
        for part, (lo, hi) in enumerate(self.partition.part_bounds):
            for piece, who in enumerate(contributors[part]):
                size = min(PIECE_ELEMENTS, hi - lo - piece * PIECE_ELEMENTS)
                have += size * len(who)
                total += size * senders
        logger.info(
            "lossy all-reduce %s: %.1f%% of the %d senders' data in our result%s%s",
            self.group.group_id.hex()[:8],
            100.0 * have / total if total else 100.0,
            senders,
            f"; dropped datagrams: {dict(sorted(dropped.items()))}" if dropped else "",
            f"; control taken from: {dict(sorted(self.taken.items()))}" if self.taken else "",
        )


def _parse_got(obj: Any) -> tuple[int, int, float] | None:
    """The header's report on our last results: ``[]``, or ``[round,
    received, seconds]`` (``ProtocolError`` for anything else)."""
    if obj == []:
        return None
    fields = expect_list(obj, 3, "results received")
    seconds = expect_float(fields[2], "seconds")
    if seconds < 0:
        raise ProtocolError("seconds must be >= 0")
    return (
        expect_int(fields[0], "round", lo=0, hi=2**32 - 1),
        expect_int(fields[1], "results received", lo=0),
        seconds,
    )


def _parse_reply(message: Any) -> tuple[int, int]:
    """A reducer's reply ``[udp port, round]``, else ``ProtocolError``."""
    reply = expect_list(message, 2, "lossy all-reduce reply")
    return (
        expect_int(reply[0], "udp port", lo=1, hi=65535),
        expect_int(reply[1], "round", lo=0, hi=2**32 - 1),
    )


def _check_marker(message: Any, what: str) -> None:
    """An end-of-sending marker ``["sent", datagrams, seconds]``, else ``ProtocolError``."""
    marker = expect_list(message, 3, what)
    if expect_str(marker[0], "marker") != "sent":
        raise ProtocolError(f"expected the {what}")
    expect_int(marker[1], "datagrams sent", lo=0)
    expect_float(marker[2], "seconds sending")


# ---------------------------------------------------------------- the registry


class _Registry:
    """The lossy rounds this peer runs now, by group id; routes control streams."""

    def __init__(self) -> None:
        self._rounds: RoundsByGroup[_LossyRound] = RoundsByGroup()
        #: Streams of pairs served on their header's copy that had not come
        #: by the end of their round, by (group id, sender, remote), with
        #: when they are forgotten.
        self._awaited: dict[tuple[bytes, int, PeerID], tuple[_AwaitedStream, float]] = {}

    def register(self, rnd: _LossyRound) -> AbstractContextManager[None]:
        """``rnd`` receives its group's streams while the block runs."""
        return self._rounds.register(rnd.group.group_id, rnd)

    def keep_awaited(self, rnd: _LossyRound) -> None:
        """Keep the streams that ``rnd`` served on a header's copy and that
        had not come, for ``HEADER_TIMEOUT``: one that comes gets what was
        sent on it and ends as usual, rather than being refused and its
        connection closed."""
        now = trio.current_time()
        for key, (_, until) in list(self._awaited.items()):
            if until < now:
                del self._awaited[key]
        for sender, awaited in rnd.awaited.items():
            if not awaited.attached:
                key = (rnd.group.group_id, sender, awaited.remote)
                self._awaited[key] = (awaited, now + HEADER_TIMEOUT)

    async def handle(self, stream: _LossyStream) -> None:
        """The connection handler of ``LOSSY_STREAM``: ``ProtocolError`` refuses."""
        with trio.move_on_after(HEADER_TIMEOUT) as wait:
            message = await stream.receive()
        if wait.cancelled_caught:
            raise ProtocolError("no lossy all-reduce header in time")
        header = parse_header(message)
        gid = header.group_id
        kept = self._awaited.pop((gid, header.sender, stream.remote), None)
        if kept is not None:  # its round ended on the header's copy
            await kept[0].attach(stream, message)
            return
        rnd = await self._rounds.find(gid, wait=UNKNOWN_GROUP_WAIT)
        if rnd is None:
            raise ProtocolError(f"no lossy all-reduce round for group {gid.hex()[:16]} here")
        awaited = rnd.awaited.get(header.sender)
        if awaited is not None and awaited.remote == stream.remote:
            await awaited.attach(stream, message)
            return
        rnd.accept_header(stream.remote, header)
        await rnd.serve_sender(stream, header.sender, header.weight, header.port)


_registries: WeakKeyDictionary[Any, _Registry] = WeakKeyDictionary()
_pacer_registries: WeakKeyDictionary[Any, PacerRegistry] = WeakKeyDictionary()


def serve_lossy_allreduce(net: LossyNetwork) -> None:
    """Accept lossy all-reduce control streams on ``net`` from now on."""
    _registry(net)


def _registry(net: LossyNetwork) -> _Registry:
    registry = _registries.get(net)
    if registry is None:
        registry = _registries[net] = _Registry()
        net.set_handler(LOSSY_STREAM, registry.handle)
    return registry


def _pacers(net: LossyNetwork) -> PacerRegistry:
    pacers = _pacer_registries.get(net)
    if pacers is None:
        pacers = _pacer_registries[net] = PacerRegistry()
    return pacers
