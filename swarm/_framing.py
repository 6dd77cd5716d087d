"""Session frames: layout, sealing and decoding, as pure code without sockets.

After the handshake, each direction of a connection is a sequence of frames.
A frame is a kind, a payload of ``length`` bytes, and on the wire::

    header block   21 bytes: sealed (kind: u8, length: u32 big-endian)
    chunk 0        min(length, CHUNK_SIZE) bytes of sealed payload + 16-byte tag
    chunk 1 ...    until ``length`` bytes of payload have been carried

A zero-length frame is its header block alone. Every header block and every
chunk is one AES-256-GCM operation with the next value of this direction's
counter as its nonce (4 zero bytes, then the counter as u64 big-endian), so
nonces never repeat under a key, and dropping, reordering, replaying or
splicing any block breaks authentication.

- Encrypted sessions encrypt the header and the payload (AEAD).
- Authenticated sessions (``encrypt=False``) send header and payload in the
  clear, each followed by its GMAC tag (AES-GCM with the block as associated
  data and an empty plaintext). Plaintext mode therefore guarantees everything
  the encrypted mode does (integrity, authenticity, order, no injection or
  replay) except confidentiality: anyone on the path can read the payload.

Payloads are sealed in chunks of ``CHUNK_SIZE`` (1 MiB) so a large frame is
never copied whole, and nothing of a frame is handed out before all of its
chunks have been authenticated.

``FrameDecoder`` owns the receive buffers: the I/O loop asks it where the next
bytes go (``next_buffer``), receives into that memory and reports how many
bytes arrived (``advance``); the socket writes straight into the decoder's
buffer. Malformed or unauthenticated input raises ``ProtocolError``
and poisons the decoder. ``FrameEncoder`` yields the buffers to send.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, MutableSequence
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ._errors import ProtocolError

CHUNK_SIZE = 1 << 20
TAG_SIZE = 16
_HEADER = struct.Struct(">BI")
HEADER_BLOCK_SIZE = _HEADER.size + TAG_SIZE
#: Frames at most this large are sent as one buffer (one syscall); larger ones
#: are sent block by block so their payload is never concatenated.
_COALESCE_LIMIT = 64 * 1024
_MAX_COUNTER = 2**64 - 1
#: Hard ceiling of ``max_frame_size`` (the length field is 32 bits).
MAX_FRAME_SIZE_LIMIT = 2**31 - 1
#: Payload bytes one key may protect before the connection is replaced by a
#: fresh handshake: 64 GiB is ~2^32 AES blocks, far inside the AES-GCM usage
#: limits (RFC 8446 section 5.5 allows ~2^34.5 full TLS records per key).
KEY_USAGE_LIMIT = 2**36


class FrameKind(enum.IntEnum):
    """What a frame's payload is. Values are wire constants."""

    OPEN = 1  # msgpack [name]: the dialer starts a stream on this connection
    MESSAGE = 2  # one msgpack document
    BYTES = 3  # raw bytes, delivered as they are
    EOF = 4  # empty: the sender will send nothing more on this stream
    RESET = 5  # msgpack str: the sender aborts the stream, with its reason
    DONE = 6  # empty, listener only: the handler returned, the connection is free again


_KINDS = frozenset(int(k) for k in FrameKind)


class Frame(NamedTuple):
    kind: FrameKind
    payload: bytes


def _nonce(counter: int) -> bytes:
    if counter > _MAX_COUNTER:
        raise ProtocolError("nonce counter exhausted; the connection must be re-established")
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class FrameEncoder:
    """Seals frames for one direction of one session (owns its nonce counter)."""

    def __init__(self, key: bytes, *, encrypt: bool, max_frame_size: int) -> None:
        self._aead = AESGCM(key)
        self._encrypt = encrypt
        self._max_frame_size = max_frame_size
        self._counter = 0
        self._scratch = bytearray()  # for encrypted chunks; allocated on first use
        #: Payload bytes sealed so far (see ``KEY_USAGE_LIMIT``).
        self.payload_bytes = 0

    def _next_nonce(self) -> bytes:
        nonce = _nonce(self._counter)
        self._counter += 1
        return nonce

    def encode(
        self, kind: FrameKind, payload: bytes | bytearray | memoryview
    ) -> Iterator[bytes | memoryview]:
        """Yield the buffers that carry one frame, to be sent in order.

        Each yielded buffer is valid only until the next one is requested (the
        encrypted path reuses one scratch buffer). Raises ``ValueError`` if the
        payload exceeds ``max_frame_size`` (checked before anything is sealed).
        An encoding abandoned halfway leaves the session unusable.
        """
        view = memoryview(payload).cast("B")
        length = view.nbytes
        if length > self._max_frame_size:
            raise ValueError(
                f"frame of {length} bytes exceeds max_frame_size={self._max_frame_size}"
            )
        header = _HEADER.pack(kind, length)
        self.payload_bytes += length
        if self._encrypt:
            header_block = self._aead.encrypt(self._next_nonce(), header, None)
        else:
            header_block = header + self._aead.encrypt(self._next_nonce(), b"", header)
        if length <= _COALESCE_LIMIT:
            parts = [header_block]
            if length:
                if self._encrypt:
                    parts.append(self._aead.encrypt(self._next_nonce(), view, None))
                else:
                    parts.append(bytes(view))
                    parts.append(self._aead.encrypt(self._next_nonce(), b"", view))
            yield b"".join(parts)
            return
        yield header_block
        for start in range(0, length, CHUNK_SIZE):
            chunk = view[start : start + CHUNK_SIZE]
            if self._encrypt:
                if not self._scratch:
                    self._scratch = bytearray(CHUNK_SIZE + TAG_SIZE)
                out = memoryview(self._scratch)[: chunk.nbytes + TAG_SIZE]
                self._aead.encrypt_into(self._next_nonce(), chunk, None, out)
                yield out
            else:
                tag = self._aead.encrypt(self._next_nonce(), b"", chunk)
                yield chunk
                yield tag


class _Phase(enum.Enum):
    HEADER = "header"
    CHUNK = "chunk"  # sealed chunk and its tag, into the scratch buffer
    FAILED = "failed"


class FrameDecoder:
    """Opens frames for one direction of one session (owns its nonce counter).

    A frame whose header announces more than ``max_frame_size`` bytes is refused
    (``ProtocolError``) as soon as its header is authenticated, before any of
    its payload is buffered. Each chunk is received into one reusable scratch
    buffer (at most ``CHUNK_SIZE`` + 16 bytes, kept for the connection's life)
    and leaves it as ``bytes`` once authenticated: one copy for frames up to
    ``CHUNK_SIZE``, two for larger ones (the chunks are joined). Fresh buffers
    per frame would cost more than the copies: large new allocations page-fault.
    """

    def __init__(self, key: bytes, *, encrypt: bool, max_frame_size: int) -> None:
        self._aead = AESGCM(key)
        self._encrypt = encrypt
        self._max_frame_size = max_frame_size
        self._counter = 0
        self._phase = _Phase.HEADER
        self._header = bytearray(HEADER_BLOCK_SIZE)
        self._scratch = bytearray()
        self._filled = 0  # bytes of the current block received so far
        self._kind = FrameKind.EOF
        self._remaining = 0  # payload bytes of the current frame not yet received
        self._chunk = 0  # payload bytes in the current chunk
        self._chunks: list[bytes] = []
        #: Payload bytes announced by authenticated headers (see ``KEY_USAGE_LIMIT``).
        self.payload_bytes = 0

    def _next_nonce(self) -> bytes:
        nonce = _nonce(self._counter)
        self._counter += 1
        return nonce

    def next_buffer(self) -> memoryview:
        """The writable memory the next received bytes must go to (never empty).

        Valid until the next ``advance``; bytes written there are not inspected
        before ``advance`` reports them.
        """
        if self._phase is _Phase.HEADER:
            return memoryview(self._header)[self._filled :]
        if self._phase is _Phase.CHUNK:
            return memoryview(self._scratch)[self._filled : self._chunk + TAG_SIZE]
        raise ProtocolError("the frame decoder already failed")

    def advance(self, count: int) -> Frame | None:
        """Record that ``count`` bytes were written into ``next_buffer()``.

        Returns the frame those bytes completed, if any. Raises ``ProtocolError``
        for unauthenticated or malformed input; the decoder then stays failed.
        """
        if self._phase is _Phase.FAILED:
            raise ProtocolError("the frame decoder already failed")
        try:
            self._filled += count
            if self._phase is _Phase.HEADER:
                return self._on_header() if self._filled >= HEADER_BLOCK_SIZE else None
            return self._on_chunk() if self._filled >= self._chunk + TAG_SIZE else None
        except BaseException:
            self._phase = _Phase.FAILED
            raise

    def _on_header(self) -> Frame | None:
        nonce = self._next_nonce()
        try:
            if self._encrypt:
                header = self._aead.decrypt(nonce, bytes(self._header), None)
            else:
                header = bytes(self._header[: _HEADER.size])
                self._aead.decrypt(nonce, bytes(self._header[_HEADER.size :]), header)
        except InvalidTag as e:
            raise ProtocolError("a frame header failed authentication") from e
        kind, length = _HEADER.unpack(header)
        if kind not in _KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if length > self._max_frame_size:
            raise ProtocolError(
                f"frame of {length} bytes exceeds max_frame_size={self._max_frame_size}"
            )
        self._kind = FrameKind(kind)
        self.payload_bytes += length
        self._filled = 0
        if length == 0:
            return Frame(self._kind, b"")
        self._remaining = length
        self._start_chunk()
        return None

    def _start_chunk(self) -> None:
        self._chunk = min(CHUNK_SIZE, self._remaining)
        if len(self._scratch) < self._chunk + TAG_SIZE:
            self._scratch = bytearray(self._chunk + TAG_SIZE)
        self._phase, self._filled = _Phase.CHUNK, 0

    def _on_chunk(self) -> Frame | None:
        nonce = self._next_nonce()
        with memoryview(self._scratch) as scratch:
            sealed = scratch[: self._chunk + TAG_SIZE]
            try:
                if self._encrypt:
                    chunk = self._aead.decrypt(nonce, sealed, None)
                else:
                    body = sealed[: self._chunk]
                    self._aead.decrypt(nonce, sealed[self._chunk :], body)
                    chunk = bytes(body)
            except InvalidTag as e:
                raise ProtocolError("a frame chunk failed authentication") from e
        self._chunks.append(chunk)
        self._remaining -= self._chunk
        if self._remaining:
            self._start_chunk()
            return None
        # join() returns a lone chunk itself: frames up to CHUNK_SIZE are not copied again.
        payload = b"".join(self._chunks)
        self._chunks.clear()
        self._phase, self._filled = _Phase.HEADER, 0
        return Frame(self._kind, payload)

    def feed(
        self, data: bytes | bytearray | memoryview, into: MutableSequence[Frame] | None = None
    ) -> MutableSequence[Frame]:
        """Decode ``data`` (any amount, split anywhere); return the completed frames.

        Frames are appended to ``into`` (a new list by default) as they
        complete, so when a ``ProtocolError`` interrupts, the authentic frames
        before the bad bytes are already there. Copies through
        ``next_buffer``: for small reads, not for bulk data.
        """
        frames: MutableSequence[Frame] = [] if into is None else into
        view = memoryview(data).cast("B")
        while view.nbytes:
            buffer = self.next_buffer()
            count = min(buffer.nbytes, view.nbytes)
            buffer[:count] = view[:count]
            view = view[count:]
            frame = self.advance(count)
            if frame is not None:
                frames.append(frame)
        return frames
