"""Datagrams of the lossy all-reduce: wire format and authentication, no sockets.

The lossy data plane (DESIGN.md, "Networks like volunteers have"; Weintraub,
Banner, Orda 2025) sends all-reduce payload in UDP datagrams that are never
retransmitted. Each datagram is one *piece*: up to ``PIECE_ELEMENTS`` float32
values at a fixed place of one part, small enough for one Ethernet frame
(``MAX_DATAGRAM_SIZE``, the DHT's budget), so losing a datagram loses one
piece and never a train of IP fragments.

Layout (little-endian), 19 bytes of header::

    magic "S" | version u8 | kind u8 | group tag (4 bytes) | round u32 |
    part u16 | sender u16 | index u32 |
    AES-256-GCM(payload) | GCM tag (16 bytes)

- ``kind``: ``PART`` (a sender's values, to the reducer of ``part``) or
  ``RESULT`` (the reducer's averaged values, back to member ``sender``), or
  a copy of a control message of the pair (``SENDER_CONTROL``,
  ``REDUCER_CONTROL``: below).
- ``group tag``: the first 4 bytes of SHA-256 of the group id; ``round``: a
  random number the reducer draws for each (sender, part) pair and sends over
  the reliable stream. Together they route a datagram to its pair; a
  datagram of another group or round whose tag and round collide with a
  pair's does not open under its key (``forged``).
- ``index``: for values, the piece: its offset within the part is ``index *
  PIECE_ELEMENTS`` elements, and its element count follows from the
  datagram's size (all of a part's pieces but its last have
  ``PIECE_ELEMENTS``); for a control copy, the message's number.
- ``index`` is also the GCM nonce: a sealer seals each piece once, and
  numbers its control messages, so a nonce never repeats under one key.
- The header is the GCM's associated data; the payload is encrypted.
- Every byte of header is a byte of values less per frame: at 19 bytes a
  datagram carries 1,364 bytes of values in 1,441 on an Ethernet link
  (94.7%; the 30-byte header of version 1, with a byte count and an
  8-byte tag, left 1,344 in 1,432: 93.9%).

Keys. Each (sender, part) pair has one reliable stream (``_connections``),
whose session keys came from the signed handshake (``_handshake``; a private
swarm's key is mixed into them). Each direction's datagram key is exported
from that session with a label holding the kind, the group id and the random
``round``, so a key is never used in two rounds or two directions, and the
index never repeats under one key: the nonce never repeats.

What a receiver (``DatagramOpener``) drops, without averaging anything of it
in and without raising, counting each reason (``dropped``):

- truncated or oversized datagrams, another magic or version (``malformed``);
- another group, round, kind, part or sender than the pair's (``misrouted``);
- an index past the part's last piece, or a size that is not that piece's
  (``misplaced``);
- a tag that does not verify: forged, altered, or from another key (``forged``);
- a piece already received (``replayed``): a replay, or a forgery of one;
  either way the first copy stays, and nothing is decrypted;
- values that are not all finite (``nonfinite``).

Reordering is harmless by construction: a piece goes to its offset whatever
order it arrives in, and the piece bookkeeping (``_pieces``) is per piece.

Control copies. The lossy round's small control messages also travel on the
reliable stream, where one lost segment waits for TCP's retransmission timer,
doubling with each loss in a row. Those on a round's critical path are sent
as datagrams as well (``ControlSealer``, ``ControlOpener``): the same header
whose ``index`` numbers the messages of the direction and whose payload is
a msgpack message (``swarm._wire``), encrypted and authenticated like
values, under a key of their own per direction (``key_label`` with their
kind). The opener drops what the value opener drops (but ``misplaced``),
a message number seen before with other contents (``replayed``), and a
message that does not decode (``malformed``). An exact copy of a datagram
it opened (the sender may send each message twice) is not a replay: it is
counted in ``copies``, not dropped, and returned as None like a drop.

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
MAGIC = b"S"
VERSION = 2
HEADER = struct.Struct("<1sBB4sIHHI")
#: ``HEADER`` in two: what a pair fixes, and the index of each datagram.
_HEADER_HEAD = struct.Struct("<1sBB4sIHH")
_INDEX = struct.Struct("<I")
#: (kind, part, sender) of a header, the route to its pair.
_ROUTE = struct.Struct("<2xB8xHH")
TAG_SIZE = 16
#: Values per piece: as many float32 as fit ``MAX_DATAGRAM_SIZE`` (341 x 4 =
#: 1,364 bytes of values, 1,399 bytes in all).
PIECE_ELEMENTS = (MAX_DATAGRAM_SIZE - HEADER.size - TAG_SIZE) // 4
#: Bytes of a datagram that carries a full piece (1,399).
FULL_DATAGRAM = HEADER.size + 4 * PIECE_ELEMENTS + TAG_SIZE
KEY_LABEL = b"swarm/lossy-allreduce/v1/"
#: The shortest datagram: a header and a tag around no values.
_MIN_DATAGRAM = HEADER.size + TAG_SIZE
_MAX_INDEX = 2**32 - 1
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
    """The 4 bytes of a group id that each datagram carries."""
    return hashlib.sha256(group_id).digest()[:4]


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
        if len(self.group_tag) != 4:
            raise ConfigError("a group tag is 4 bytes")
        if not (
            0 <= self.round <= _MAX_INDEX and 0 <= self.part < 2**16 and 0 <= self.sender < 2**16
        ):
            raise ConfigError("round, part or sender out of range")
        if not 0 <= self.part_size <= PIECE_ELEMENTS * _MAX_INDEX:
            raise ConfigError(f"part_size={self.part_size} out of range")

    @property
    def num_pieces(self) -> int:
        return -(-self.part_size // PIECE_ELEMENTS)

    def piece_bounds(self, piece: int) -> tuple[int, int]:
        """Elements ``[start, end)`` of ``piece`` within the part."""
        start = piece * PIECE_ELEMENTS
        return start, min(start + PIECE_ELEMENTS, self.part_size)

    def prefix(self) -> bytes:
        """The header's fields that every datagram of the pair carries."""
        return _HEADER_HEAD.pack(
            MAGIC, VERSION, self.kind, self.group_tag, self.round, self.part, self.sender
        )


class DatagramSealer:
    """Seals the pieces of one direction of a pair, each piece at most once
    (its number is the nonce).

    Not safe to share between tasks that interleave; one sender task per pair.
    """

    def __init__(self, key: bytes, pair: Pair) -> None:
        self._aead = AESGCM(key)
        self.pair = pair
        self._prefix = pair.prefix()
        self._num_pieces = pair.num_pieces
        self._sealed = bytearray(self._num_pieces)
        #: Datagrams sealed so far (the count an end-of-sending marker gives).
        self.sealed = 0

    def seal(self, piece: int, values: torch.Tensor | np.ndarray) -> bytes:
        """The datagram of ``piece`` holding ``values`` (float32, its size).

        Raises ``ValueError`` for a piece out of range, sealed before (its
        nonce would repeat), or values of the wrong size.
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
        if not 0 <= piece < self._num_pieces:
            raise ValueError(f"piece {piece} of a part of {self.pair.part_size}")
        start, end = self.pair.piece_bounds(piece)
        if len(data) != 4 * (end - start):
            raise ValueError(f"piece {piece} of a part of {self.pair.part_size}: {len(data)} bytes")
        if self._sealed[piece]:
            raise ValueError(f"piece {piece} was sealed before: its nonce would repeat")
        self._sealed[piece] = 1
        self.sealed += 1
        header = self._prefix + _INDEX.pack(piece)
        return header + self._aead.encrypt(_nonce(piece), data, header)


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "little")


def peek_route(datagram: bytes) -> tuple[int, int, int] | None:
    """``(kind, part, sender)`` of a datagram, to find its opener; None if
    it is too short or not ours. Nothing in it is authenticated yet."""
    if len(datagram) < _MIN_DATAGRAM or datagram[:1] != MAGIC:
        return None
    return _ROUTE.unpack_from(datagram)


def _foreign(data: bytes, route: bytes) -> str | None:
    """Why a datagram is not one of ``route``'s (its size, magic and version,
    then its route), the openers' first checks; None if it may be."""
    if not _MIN_DATAGRAM <= len(data) <= MAX_DATAGRAM_SIZE:
        return "malformed"
    if data[:1] != MAGIC or data[1] != VERSION:
        return "malformed"
    if data[2 : _HEADER_HEAD.size] != route:
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
        self._have = bytearray(pair.num_pieces)
        # The header's fields after magic and version that every datagram of
        # the pair carries (kind, group tag, round, part, sender): one bytes
        # comparison instead of unpacking and comparing five fields.
        self._route = pair.prefix()[2:]
        self._num_pieces = pair.num_pieces
        # the size of the last piece's datagram (the others' is FULL_DATAGRAM)
        start, end = pair.piece_bounds(self._num_pieces - 1)
        self._last_size = _MIN_DATAGRAM + 4 * (end - start)
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
        refused = _foreign(data, self._route)
        if refused is not None:
            return self._drop(refused)
        (piece,) = _INDEX.unpack_from(data, _HEADER_HEAD.size)
        if piece >= self._num_pieces or len(data) != (
            FULL_DATAGRAM if piece < self._num_pieces - 1 else self._last_size
        ):
            return self._drop("misplaced")
        if self._have[piece]:
            return self._drop("replayed")
        view = memoryview(data)  # slices of a memoryview copy nothing
        try:
            plain = self._aead.decrypt(_nonce(piece), view[HEADER.size :], view[: HEADER.size])
        except InvalidTag:
            return self._drop("forged")
        values = np.frombuffer(plain, dtype="<f4")
        # All finite iff the dot product with zeros is 0: NaN and inf times
        # 0 are NaN, a finite value times 0 is 0. One BLAS call costs a
        # fraction of ``np.isfinite(values).all()`` (two ufunc passes).
        if values.dot(self._zeros[: values.size]) != 0:
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
        self._prefix = pair.prefix()

    def seal(self, message: object) -> bytes:
        """The datagram carrying ``message``. ``ValueError`` if it is not
        msgpack-able or longer than ``MAX_CONTROL_MESSAGE`` packed: the
        reliable stream carries such a message alone."""
        data = pack(message, max_size=MAX_CONTROL_MESSAGE)
        seq = self.seq
        if seq > _MAX_INDEX:
            raise OverflowError("2**32 datagrams under one key")
        header = self._prefix + _INDEX.pack(seq)
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
        self._route = pair.prefix()[2:]
        self._opened: dict[int, bytes] = {}  # by message number
        self.dropped: Counter[str] = Counter()
        self.copies = 0

    def open(self, datagram: bytes | bytearray | memoryview) -> Any:
        data = bytes(datagram)
        refused = _foreign(data, self._route)
        if refused is not None:
            return self._drop(refused)
        (seq,) = _INDEX.unpack_from(data, _HEADER_HEAD.size)
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
