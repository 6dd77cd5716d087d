"""Datagrams of the lossy all-reduce: wire format and authentication, no sockets.

The lossy data plane (DESIGN.md, "Networks like volunteers have"; Weintraub,
Banner, Orda 2025) sends all-reduce payload in UDP datagrams that are never
retransmitted. Each datagram is one *piece*: up to ``PIECE_ELEMENTS`` float32
values at a fixed place of one part, small enough for one Ethernet frame
(``MAX_DATAGRAM_SIZE``, the DHT's budget), so losing a datagram loses one
piece and never a train of IP fragments.

Layout (little-endian)::

    magic "SL" | version u8 | kind u8 | group tag (8 bytes) | round u32 |
    part u16 | sender u16 | offset u32 | count u16 | seq u32 |
    AES-256-GCM(values, count * 4 bytes) | GCM tag (16 bytes)

- ``kind``: ``PART`` (a sender's values, to the reducer of ``part``) or
  ``RESULT`` (the reducer's averaged values, back to member ``sender``), or
  a copy of a control message of the pair (``SENDER_CONTROL``,
  ``REDUCER_CONTROL``: below).
- ``group tag``: the first 8 bytes of SHA-256 of the group id; ``round``: a
  random number the reducer draws for each (sender, part) pair and sends over
  the reliable stream.
- ``offset``: the first element of the piece within the part, always a
  multiple of ``PIECE_ELEMENTS``; ``count``: its elements (all of them but the
  part's last piece have ``PIECE_ELEMENTS``).
- ``seq``: the datagram's number in its direction, which is the GCM nonce.
- The 30-byte header is the GCM's associated data; the values are encrypted.

Keys. Each (sender, part) pair has one reliable stream (``_connections``),
whose session keys came from the signed handshake (``_handshake``; a private
swarm's key is mixed into them). Each direction's datagram key is exported
from that session with a label holding the kind, the group id and the random
``round``, so a key is never used in two rounds or two directions, and the
sequence number never repeats under one key: the nonce never repeats.

What a receiver (``DatagramOpener``) drops, without averaging anything of it
in and without raising, counting each reason (``dropped``):

- truncated or oversized datagrams, another magic or version (``malformed``);
- another group, round, kind, part or sender than the pair's (``misrouted``);
- an offset off the piece grid or a count that is not that piece's (``misplaced``);
- a tag that does not verify: forged, altered, or from another key (``forged``);
- a sequence number seen before: a replay or a duplicate (``replayed``);
- a second datagram for a piece already received under another sequence
  number (``duplicate``): only the sender's key can make one, so it is a
  misbehaving sender, and the first copy stays;
- values that are not all finite (``nonfinite``).

Reordering is harmless by construction: a piece goes to its offset whatever
order it arrives in, and the piece bookkeeping (``_pieces``) is per piece.

Control copies. The lossy round's small control messages also travel on the
reliable stream, where one lost segment waits for TCP's retransmission timer,
doubling with each loss in a row. Those on a round's critical path are sent
as datagrams as well (``ControlSealer``, ``ControlOpener``): the same header
with ``offset`` 0 and ``count`` the length in bytes of a msgpack message
(``swarm._wire``), encrypted and authenticated like values, under a key of
their own per direction (``key_label`` with their kind). The opener drops
what the value opener drops (but for ``misplaced``, an offset or count that
is not such a message's: ``malformed``), and a message that does not decode
(``malformed``). An exact copy of a datagram it opened (the sender may send
each message twice) is not a replay: it is counted in ``copies``, not
dropped, and returned as None like a drop.

A sender's header is copied as well (``SENDER_HEADER``), with the same
checks; its key is exported for the reducer's round of the pair from the
connection the sender's stream comes on, not from the stream: the reducer
has the connection before the header's stream reaches it (``_lossy``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarm import ConfigError, ProtocolError
from swarm._wire import pack, unpack

#: Largest datagram (header, values, tag): one Ethernet frame's payload with
#: room for IP and UDP headers, as the DHT's datagrams.
MAX_DATAGRAM_SIZE = 1400
MAGIC = b"SL"
VERSION = 1
HEADER = struct.Struct("<2sBB8sIHHIHI")
#: ``HEADER`` in two: what a pair fixes, and what each datagram numbers.
_HEADER_HEAD = struct.Struct("<2sBB8sIHH")
_HEADER_TAIL = struct.Struct("<IHI")
TAG_SIZE = 16
#: Values per piece: as many float32 as fit ``MAX_DATAGRAM_SIZE`` (336 x 4 =
#: 1,344 bytes of values, 1,390 bytes in all).
PIECE_ELEMENTS = (MAX_DATAGRAM_SIZE - HEADER.size - TAG_SIZE) // 4 // 16 * 16
#: Bytes of a datagram that carries a full piece (1,390).
FULL_DATAGRAM = HEADER.size + 4 * PIECE_ELEMENTS + TAG_SIZE
KEY_LABEL = b"swarm/lossy-allreduce/v1/"
#: The shortest datagram: a header and a tag around no values.
_MIN_DATAGRAM = HEADER.size + TAG_SIZE
_MAX_SEQ = 2**32 - 1
# ``DatagramOpener.open`` finds non-finite values by a dot product with zeros,
# which numpy reports as an invalid operation: expected, and counted instead.
warnings.filterwarnings(
    "ignore", "invalid value encountered in dot", RuntimeWarning, module=__name__
)


class Kind(enum.IntEnum):
    """Which way a datagram goes."""

    PART = 1  # a sender's values, to the part's reducer
    RESULT = 2  # the reducer's averaged values, back to a member
    #: copies of a sender's control messages (its end of sending), to the reducer
    SENDER_CONTROL = 3
    #: copies of a reducer's control messages (its report, its end of
    #: results), to a member
    REDUCER_CONTROL = 4
    #: a copy of a sender's header, to the reducer, under a key of the
    #: connection its stream comes on (``_lossy``, "The header's copy")
    SENDER_HEADER = 5


def group_tag(group_id: bytes) -> bytes:
    """The 8 bytes of a group id that each datagram carries."""
    return hashlib.sha256(group_id).digest()[:8]


def key_label(kind: Kind, group_id: bytes, round_: int) -> bytes:
    """The label under which both ends export one direction's key from their
    stream (``Stream.export_key``): distinct for each kind, group and round."""
    return KEY_LABEL + struct.pack("<BI", kind, round_) + group_id


@dataclass(frozen=True)
class Pair:
    """What fixes one direction of one (sender, part) pair: every datagram of
    it carries these, and its key is exported for them."""

    kind: Kind
    group_tag: bytes
    round: int
    part: int
    sender: int
    part_size: int

    def __post_init__(self) -> None:
        if len(self.group_tag) != 8:
            raise ConfigError("a group tag is 8 bytes")
        if not (
            0 <= self.round <= _MAX_SEQ and 0 <= self.part < 2**16 and 0 <= self.sender < 2**16
        ):
            raise ConfigError("round, part or sender out of range")
        if not 0 <= self.part_size <= PIECE_ELEMENTS * _MAX_SEQ:
            raise ConfigError(f"part_size={self.part_size} out of range")

    @property
    def num_pieces(self) -> int:
        return -(-self.part_size // PIECE_ELEMENTS)

    def piece_bounds(self, piece: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of ``piece`` within the part."""
        start = piece * PIECE_ELEMENTS
        return start, min(start + PIECE_ELEMENTS, self.part_size)


class DatagramSealer:
    """Seals the pieces of one direction of a pair, numbering them in order.

    Not safe to share between tasks that interleave (it keeps the sequence
    number); one sender task per pair.
    """

    def __init__(self, key: bytes, pair: Pair) -> None:
        self._aead = AESGCM(key)
        self.pair = pair
        self.seq = 0
        # the header's fields that are the same in every datagram of the pair
        self._prefix = _HEADER_HEAD.pack(
            MAGIC, VERSION, pair.kind, pair.group_tag, pair.round, pair.part, pair.sender
        )

    def seal(self, piece: int, values: torch.Tensor | np.ndarray) -> bytes:
        """The datagram of ``piece`` holding ``values`` (float32, its size).

        Raises ``ValueError`` for a piece out of range or values of the wrong
        size, ``OverflowError`` once 2**32 datagrams used the key.
        """
        start, end = self.pair.piece_bounds(piece)
        array = values.detach().numpy() if isinstance(values, torch.Tensor) else values
        if not 0 <= piece < self.pair.num_pieces or array.size != end - start:
            raise ValueError(f"piece {piece} of a part of {self.pair.part_size} with {array.size}")
        return self.seal_bytes(piece, np.ascontiguousarray(array, dtype="<f4").tobytes())

    def seal_bytes(self, piece: int, data: bytes | memoryview) -> bytes:
        """``seal`` for values already in wire form: ``data`` is the piece's
        float32 values, little-endian (e.g. a slice of a memoryview of the
        whole part, so that no copy is made). The same errors as ``seal``.

        The hot path of the lossy round's senders (thousands of datagrams a
        round): one small struct and one AEAD call per datagram.
        """
        p = self.pair
        start = piece * PIECE_ELEMENTS
        count = min(PIECE_ELEMENTS, p.part_size - start)
        if not 0 <= piece < p.num_pieces or len(data) != 4 * count:
            raise ValueError(f"piece {piece} of a part of {p.part_size} with {len(data)} bytes")
        seq = self.seq
        if seq > _MAX_SEQ:
            raise OverflowError("2**32 datagrams under one key")
        header = self._prefix + _HEADER_TAIL.pack(start, count, seq)
        sealed = self._aead.encrypt(_nonce(seq), data, header)
        self.seq = seq + 1
        return header + sealed


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "little")


def peek_route(datagram: bytes) -> tuple[int, int, int] | None:
    """``(kind, part, sender)`` of a datagram, to find its opener; None if
    it is too short or not ours. Nothing in it is authenticated yet."""
    if len(datagram) < HEADER.size + TAG_SIZE or datagram[:2] != MAGIC:
        return None
    _, _, kind, _, _, part, sender, _, _, _ = HEADER.unpack_from(datagram)
    return kind, part, sender


def _foreign(data: bytes, route: bytes) -> str | None:
    """Why a datagram is not one of ``route``'s (its size, magic and version,
    then its route), the openers' first checks; None if it may be."""
    if not _MIN_DATAGRAM <= len(data) <= MAX_DATAGRAM_SIZE:
        return "malformed"
    if data[:2] != MAGIC or data[2] != VERSION:
        return "malformed"
    if data[3 : _HEADER_HEAD.size] != route:
        return "misrouted"
    return None


class DatagramOpener:
    """Opens the datagrams of one direction of a pair, each piece at most once.

    ``open`` returns ``(piece, values)`` for a datagram that authenticates and
    brings a piece not seen before, and None for anything else (the module
    docstring lists what is dropped; ``dropped`` counts why).
    """

    def __init__(self, key: bytes, pair: Pair) -> None:
        self._aead = AESGCM(key)
        self.pair = pair
        self._seen_seq: set[int] = set()
        self._have = bytearray(pair.num_pieces)
        # The header's fields after magic and version that every datagram of
        # the pair carries (kind, group tag, round, part, sender): one bytes
        # comparison instead of unpacking and comparing five fields.
        self._route = _HEADER_HEAD.pack(
            MAGIC, VERSION, pair.kind, pair.group_tag, pair.round, pair.part, pair.sender
        )[3:]
        self._num_pieces = pair.num_pieces
        self._part_size = pair.part_size
        self._zeros = np.zeros(PIECE_ELEMENTS, dtype=np.float32)
        self.received = 0  # pieces accepted
        self.dropped: Counter[str] = Counter()

    def has(self, piece: int) -> bool:
        return bool(self._have[piece])

    def open(self, datagram: bytes | bytearray | memoryview) -> tuple[int, np.ndarray] | None:
        """``(piece, values)`` (values: float32, read-only), or None.

        The hot path of the lossy round's receivers (one call per datagram):
        the checks are ordered and written to cost little next to the AEAD.
        """
        data = datagram if isinstance(datagram, bytes) else bytes(datagram)
        size = len(data)
        refused = _foreign(data, self._route)
        if refused is not None:
            return self._drop(refused)
        offset, count, seq = _HEADER_TAIL.unpack_from(data, _HEADER_HEAD.size)
        piece, rest = divmod(offset, PIECE_ELEMENTS)
        if rest or piece >= self._num_pieces:
            return self._drop("misplaced")
        expected = self._part_size - offset
        if count != (PIECE_ELEMENTS if expected > PIECE_ELEMENTS else expected) or size != (
            _MIN_DATAGRAM + 4 * count
        ):
            return self._drop("misplaced")
        if seq in self._seen_seq:
            return self._drop("replayed")
        view = memoryview(data)  # slices of a memoryview copy nothing
        try:
            plain = self._aead.decrypt(_nonce(seq), view[HEADER.size :], view[: HEADER.size])
        except InvalidTag:
            return self._drop("forged")
        self._seen_seq.add(seq)
        if self._have[piece]:
            return self._drop("duplicate")
        values = np.frombuffer(plain, dtype="<f4")
        # All finite iff the dot product with zeros is 0: NaN and inf times
        # 0 are NaN, a finite value times 0 is 0. One BLAS call costs a
        # fraction of ``np.isfinite(values).all()`` (two ufunc passes).
        if values.dot(self._zeros[:count]) != 0:
            return self._drop("nonfinite")
        self._have[piece] = 1
        self.received += 1
        return piece, values

    def _drop(self, reason: str) -> tuple[int, np.ndarray] | None:
        self.dropped[reason] += 1
        return None


_CONTROL_KINDS = frozenset({Kind.SENDER_CONTROL, Kind.REDUCER_CONTROL, Kind.SENDER_HEADER})
#: Bytes of a control message that fit one datagram with its header and tag.
MAX_CONTROL_MESSAGE = MAX_DATAGRAM_SIZE - _MIN_DATAGRAM


class ControlSealer:
    """Seals one direction's control messages of a pair (``pair.kind`` is
    ``SENDER_CONTROL``, ``REDUCER_CONTROL`` or ``SENDER_HEADER``), numbering
    them in order."""

    def __init__(self, key: bytes, pair: Pair) -> None:
        if pair.kind not in _CONTROL_KINDS:
            raise ConfigError(f"{pair.kind!r} is not a kind of control datagram")
        self._aead = AESGCM(key)
        self.pair = pair
        self.seq = 0
        self._prefix = _HEADER_HEAD.pack(
            MAGIC, VERSION, pair.kind, pair.group_tag, pair.round, pair.part, pair.sender
        )

    def seal(self, message: object) -> bytes:
        """The datagram carrying ``message``. ``ValueError`` if it is not
        msgpack-able or longer than ``MAX_CONTROL_MESSAGE`` packed: the
        reliable stream carries such a message alone."""
        data = pack(message, max_size=MAX_CONTROL_MESSAGE)
        seq = self.seq
        if seq > _MAX_SEQ:
            raise OverflowError("2**32 datagrams under one key")
        header = self._prefix + _HEADER_TAIL.pack(0, len(data), seq)
        sealed = self._aead.encrypt(_nonce(seq), data, header)
        self.seq = seq + 1
        return header + sealed


class ControlOpener:
    """Opens one direction's control datagrams of a pair: ``open`` returns
    the decoded message of a datagram that authenticates and was not opened
    before, None for anything else (``dropped`` counts why; ``copies`` the
    exact copies of opened ones). The message is untrusted in shape: the
    caller checks it as it checks the stream's copy."""

    def __init__(self, key: bytes, pair: Pair) -> None:
        self._aead = AESGCM(key)
        self.pair = pair
        self._route = _HEADER_HEAD.pack(
            MAGIC, VERSION, pair.kind, pair.group_tag, pair.round, pair.part, pair.sender
        )[3:]
        self._opened: dict[int, bytes] = {}  # by sequence number
        self.dropped: Counter[str] = Counter()
        self.copies = 0

    def open(self, datagram: bytes | bytearray | memoryview) -> Any:
        data = bytes(datagram)
        size = len(data)
        refused = _foreign(data, self._route)
        if refused is not None:
            return self._drop(refused)
        offset, count, seq = _HEADER_TAIL.unpack_from(data, _HEADER_HEAD.size)
        if offset != 0 or size != _MIN_DATAGRAM + count:
            return self._drop("malformed")
        opened = self._opened.get(seq)
        if opened is not None:
            if opened == data:
                self.copies += 1
                return None
            return self._drop("replayed")
        try:
            plain = self._aead.decrypt(_nonce(seq), data[HEADER.size :], data[: HEADER.size])
        except InvalidTag:
            return self._drop("forged")
        self._opened[seq] = data
        try:
            return unpack(plain, max_size=MAX_CONTROL_MESSAGE)
        except ProtocolError:  # only the sender's key makes one: a broken sender
            return self._drop("malformed")

    def _drop(self, reason: str) -> None:
        self.dropped[reason] += 1
