"""Session frames: layout, sealing and decoding, as pure code without sockets.

After the handshake, each direction of a connection is a sequence of frames.
A frame is a kind and a payload of ``length`` bytes. On the wire::

    header block   21 bytes: sealed (kind: u8, length: u32 big-endian)
    payload, encrypted sessions: chunks of min(remaining, CHUNK_SIZE) bytes of
                   ciphertext, each followed by its 16-byte tag
    payload, plaintext sessions: ``length`` bytes in the clear, then one
                   16-byte GMAC tag over all of them

A zero-length frame is its header block alone. A ``NUDGE`` frame (zero-length,
of no stream) is authenticated and consumed by the decoder like any other,
and never handed out. Every header block, every
encrypted chunk and every plaintext payload tag is one AES-256-GCM operation
with the next value of this direction's counter as its nonce (4 zero bytes,
then the counter as u64 big-endian), so nonces never repeat under a key, and
dropping, reordering, replaying or splicing any block breaks authentication.

- Encrypted sessions encrypt the header and the payload (AEAD).
- Authenticated sessions (``encrypt=False``) send header and payload in the
  clear, each followed by its GMAC tag (AES-GCM with the block as associated
  data and an empty plaintext). GMAC with unique nonces is a secure MAC, so
  plaintext mode guarantees everything the encrypted mode does (integrity,
  authenticity, order, no injection or replay) except confidentiality: anyone
  on the path can read the payload. One tag covers a whole payload: GHASH runs
  at several GB/s, and the payload goes from the sender's memory to the
  socket, and from the socket to the receiver's buffer, without any copy.
  Both ends hash a large payload piece by piece next to the system call that
  moves it, while the piece is in the CPU's cache: the sender each slice of
  ``_SEND_SLICE`` bytes just after sending it, the receiver
  (``_INCREMENTAL_MAC`` bytes or more) each piece as it arrives. On a loopback
  all-reduce, a separate pass over memory cost more than the hashing itself.

Encrypted payloads are sealed in chunks of ``CHUNK_SIZE`` (1 MiB), so a
sender encrypts through one reusable 1 MiB buffer, never a whole frame.
Nothing of a frame is handed out before all of it has been authenticated.

``FrameDecoder`` does no I/O: the I/O loop asks it where the next bytes go
(``next_buffer``), receives into that memory and reports how many bytes
arrived (``advance``). The payload of a raw frame can go straight into a
buffer of the caller's (``next_buffer(into)``), and the caller can watch it
fill (``progress``) to inspect each piece right after it lands. Malformed or
unauthenticated input raises ``ProtocolError`` and poisons the decoder.
``FrameEncoder`` yields the buffers to send.
"""

from __future__ import annotations

import enum
import hmac
import struct
from collections.abc import Callable, Iterator, MutableSequence
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ._errors import AuthenticationError, ProtocolError

CHUNK_SIZE = 1 << 20
TAG_SIZE = 16
_HEADER = struct.Struct(">BI")
HEADER_BLOCK_SIZE = _HEADER.size + TAG_SIZE
#: Frames at most this large are sealed into one buffer; larger ones are sent
#: block by block so their payload is never concatenated.
_COALESCE_LIMIT = 64 * 1024
_MAX_COUNTER = 2**64 - 1
#: Plaintext payloads at least this large are authenticated as they arrive,
#: piece by piece while each piece is still in the CPU's cache, instead of in
#: one pass once the whole payload is there.
_INCREMENTAL_MAC = 64 * 1024
#: Plaintext payloads larger than this are sent in slices of this size, each
#: hashed right after it was sent.
_SEND_SLICE = 512 * 1024
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
    #: empty, of no stream: sent right behind a small send so that its loss
    #: is not a lone lost segment (``_connections``, ``_send_nudged``); the
    #: decoder consumes it and hands out nothing
    NUDGE = 7


_KINDS = frozenset(int(k) for k in FrameKind)


def _gmac(key: bytes, nonce: bytes) -> AEADEncryptionContext:
    """An incremental GMAC: fed with ``authenticate_additional_data``, its tag
    is the one ``AESGCM(key).encrypt(nonce, b"", data)`` gives."""
    return Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()


#: ``progress(payload, done)``: the first ``done`` bytes of ``payload`` are in place.
Progress = Callable[[memoryview, int], None]


class Frame(NamedTuple):
    kind: FrameKind
    #: ``bytes``, or a view of the caller's buffer if it was received into one
    #: (``FrameDecoder.next_buffer(into)``).
    payload: bytes | memoryview


def _nonce(counter: int) -> bytes:
    if counter > _MAX_COUNTER:
        raise ProtocolError("nonce counter exhausted; the connection must be re-established")
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class FrameEncoder:
    """Seals frames for one direction of one session (owns its nonce counter)."""

    def __init__(self, key: bytes, *, encrypt: bool, max_frame_size: int) -> None:
        self._aead = AESGCM(key)
        self._key = key
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

        Each yielded buffer is valid only until the next one is requested;
        ``encode_batches`` promises more. Raises what ``encode_batches`` raises.
        """
        for batch in self.encode_batches(kind, payload):
            yield from batch

    def nudge(self) -> bytes:
        """The sealed header block that is a whole ``NUDGE`` frame."""
        (block,) = next(self.encode_batches(FrameKind.NUDGE, b""))
        return bytes(block)

    def encode_batches(
        self, kind: FrameKind, payload: bytes | bytearray | memoryview
    ) -> Iterator[list[bytes | memoryview]]:
        """Yield the buffers that carry one frame, in batches to be sent in order.

        The buffers of a batch stay valid until the next batch is requested
        (the encrypted path reuses one scratch buffer), so a batch can be sent
        with one gathering system call. A plaintext frame sends the payload
        from its own memory: in one batch, or beyond ``_SEND_SLICE`` bytes in
        one batch per slice, each hashed once the caller asks for the next
        (after sending it), and its tag last. Raises ``ValueError`` if the
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
        if not length:
            yield [header_block]
            return
        if not self._encrypt and length > _SEND_SLICE:
            # Each slice is hashed just after it was sent, while the kernel's
            # read has left it in the CPU's cache: hashing the whole payload
            # up front read it from memory once more.
            mac = _gmac(self._key, self._next_nonce())
            for start in range(0, length, _SEND_SLICE):
                piece = view[start : start + _SEND_SLICE]
                yield [header_block, piece] if start == 0 else [piece]
                mac.authenticate_additional_data(piece)
            mac.finalize()
            yield [mac.tag]
            return
        if not self._encrypt:
            tag = self._aead.encrypt(self._next_nonce(), b"", view)
            if length <= _COALESCE_LIMIT:
                yield [b"".join((header_block, view, tag))]
            else:
                yield [header_block, view, tag]
            return
        if length <= _COALESCE_LIMIT:
            yield [header_block + self._aead.encrypt(self._next_nonce(), view, None)]
            return
        batch: list[bytes | memoryview] = [header_block]
        for start in range(0, length, CHUNK_SIZE):
            chunk = view[start : start + CHUNK_SIZE]
            if not self._scratch:
                self._scratch = bytearray(CHUNK_SIZE + TAG_SIZE)
            out = memoryview(self._scratch)[: chunk.nbytes + TAG_SIZE]
            self._aead.encrypt_into(self._next_nonce(), chunk, None, out)
            batch.append(out)
            yield batch
            batch = []


class _Phase(enum.Enum):
    HEADER = "header"
    PAYLOAD = "payload"  # plaintext: the payload, into its target
    TAG = "tag"  # plaintext: the payload's tag
    CHUNK = "chunk"  # encrypted: a sealed chunk and its tag, into the scratch buffer
    FAILED = "failed"


class FrameDecoder:
    """Opens frames for one direction of one session (owns its nonce counter).

    A frame whose header announces more than ``max_frame_size`` bytes is refused
    (``ProtocolError``) as soon as its header is authenticated, before any of
    its payload is buffered.

    Where a payload goes: into the caller's buffer if ``next_buffer(into)``
    offered one that fits a raw (``BYTES``) frame when its payload began; then
    the frame's payload is a view of that buffer (no copy). Otherwise into the
    decoder's own memory, and the payload leaves it as ``bytes`` (one copy). A
    reusable buffer (kept for the connection's life, at most ``CHUNK_SIZE``)
    takes payloads up to ``CHUNK_SIZE``; larger ones get a fresh buffer.
    Encrypted chunks are received into a reusable ``CHUNK_SIZE`` + 16 byte
    buffer and decrypted into the payload's place.
    """

    def __init__(self, key: bytes, *, encrypt: bool, max_frame_size: int) -> None:
        self._aead = AESGCM(key)
        self._encrypt = encrypt
        self._max_frame_size = max_frame_size
        self._counter = 0
        self._phase = _Phase.HEADER
        self._header = bytearray(HEADER_BLOCK_SIZE)
        self._tag = bytearray(TAG_SIZE)
        self._sealed = bytearray()  # encrypted chunk and tag
        self._spare = bytearray()  # own payload memory for frames up to CHUNK_SIZE
        self._filled = 0  # bytes of the current block (header, tag, sealed chunk) received
        self._kind = FrameKind.EOF
        self._length = 0  # payload bytes of the current frame
        self._done = 0  # payload bytes of the current frame in place (received or decrypted)
        self._chunk = 0  # payload bytes in the current encrypted chunk
        self._target: memoryview | None = None  # where the payload goes; None: not chosen
        self._caller_owned = False  # ``_target`` is the caller's memory
        self._progress: Progress | None = None  # watches a caller's ``_target``
        self._key = key
        self._mac: AEADEncryptionContext | None = None  # a large plaintext payload's GMAC so far
        #: Payload bytes announced by authenticated headers (see ``KEY_USAGE_LIMIT``).
        self.payload_bytes = 0

    def _next_nonce(self) -> bytes:
        nonce = _nonce(self._counter)
        self._counter += 1
        return nonce

    def next_buffer(
        self, into: memoryview | None = None, progress: Progress | None = None
    ) -> memoryview:
        """The writable memory the next received bytes must go to (never empty).

        Valid until the next ``advance``; bytes written there are not inspected
        before ``advance`` reports them. ``into``: if the next payload to begin
        is that of a ``BYTES`` frame of at most ``into.nbytes`` bytes, it is
        written to the start of ``into`` (offered later, it is ignored). The
        caller's buffer then holds unauthenticated bytes until the frame is
        returned; after a ``ProtocolError`` its contents are undefined.

        ``progress``, offered with ``into``, is called from ``advance`` as
        ``progress(payload, done)`` whenever more of the payload is in its
        final place in ``into``: received (plaintext sessions) or decrypted
        (encrypted ones). In plaintext sessions those bytes are not yet
        authenticated, so it may only look at them, and it must not raise.
        It is not called once ``release`` moved the payload elsewhere.
        """
        phase = self._phase
        if phase is _Phase.HEADER:
            return memoryview(self._header)[self._filled :]
        if phase is _Phase.FAILED:
            raise ProtocolError("the frame decoder already failed")
        if self._target is None:
            self._choose_target(into)
            if self._caller_owned:
                self._progress = progress
        if phase is _Phase.PAYLOAD:
            assert self._target is not None
            return self._target[self._done :]
        if phase is _Phase.TAG:
            return memoryview(self._tag)[self._filled :]
        return memoryview(self._sealed)[self._filled : self._chunk + TAG_SIZE]

    def _choose_target(self, into: memoryview | None) -> None:
        length = self._length
        if into is not None and self._kind is FrameKind.BYTES and into.nbytes >= length:
            self._target = into.cast("B")[:length]
            self._caller_owned = True
            return
        self._target = self._own_memory(length)
        self._caller_owned = False

    def _own_memory(self, length: int) -> memoryview:
        if length > CHUNK_SIZE:
            return memoryview(bytearray(length))
        if len(self._spare) < length:
            self._spare = bytearray(max(length, min(2 * len(self._spare), CHUNK_SIZE)))
        return memoryview(self._spare)[:length]

    def release(self, into: memoryview) -> None:
        """``into`` (offered to ``next_buffer``) is about to become invalid, and
        the current frame is not complete: move its payload so far into the
        decoder's own memory. A no-op if the current frame does not use it."""
        if not self._caller_owned or self._target is None:
            return
        own = self._own_memory(self._length)
        own[: self._done] = self._target[: self._done]
        self._target = own
        self._caller_owned = False
        self._progress = None

    def advance(self, count: int) -> Frame | None:
        """Record that ``count`` bytes were written into ``next_buffer()``.

        Returns the frame those bytes completed, if any. Raises ``ProtocolError``
        for unauthenticated or malformed input; the decoder then stays failed.
        """
        phase = self._phase
        if phase is _Phase.FAILED:
            raise ProtocolError("the frame decoder already failed")
        try:
            if phase is _Phase.PAYLOAD:
                assert self._target is not None
                if self._mac is not None:
                    done = self._done
                    self._mac.authenticate_additional_data(self._target[done : done + count])
                self._done += count
                if self._progress is not None:
                    self._progress(self._target, self._done)
                if self._done >= self._length:
                    self._phase, self._filled = _Phase.TAG, 0
                return None
            self._filled += count
            if phase is _Phase.HEADER:
                return self._on_header() if self._filled >= HEADER_BLOCK_SIZE else None
            if phase is _Phase.TAG:
                return self._on_tag() if self._filled >= TAG_SIZE else None
            return self._on_chunk() if self._filled >= self._chunk + TAG_SIZE else None
        except BaseException:
            self._phase = _Phase.FAILED
            self._target = self._progress = None
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
            raise AuthenticationError("a frame header failed authentication") from e
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
        if self._kind is FrameKind.NUDGE:
            if length:
                raise ProtocolError(f"a nudge frame of {length} bytes")
            return None  # consumed: nothing to hand out
        if length == 0:
            return Frame(self._kind, b"")
        self._length, self._done, self._target = length, 0, None
        if self._encrypt:
            self._start_chunk()
        else:
            self._phase = _Phase.PAYLOAD
            if length >= _INCREMENTAL_MAC:
                # The payload's nonce is the next one either way (``_on_tag``).
                self._mac = _gmac(self._key, self._next_nonce())
        return None

    def _start_chunk(self) -> None:
        self._chunk = min(CHUNK_SIZE, self._length - self._done)
        if len(self._sealed) < self._chunk + TAG_SIZE:
            self._sealed = bytearray(self._chunk + TAG_SIZE)
        self._phase, self._filled = _Phase.CHUNK, 0

    def _on_tag(self) -> Frame:
        assert self._target is not None
        if self._mac is not None:
            mac, self._mac = self._mac, None
            mac.finalize()
            if not hmac.compare_digest(mac.tag, self._tag):
                raise AuthenticationError("a frame payload failed authentication")
            return self._finish()
        try:
            self._aead.decrypt(self._next_nonce(), bytes(self._tag), self._target)
        except InvalidTag as e:
            raise AuthenticationError("a frame payload failed authentication") from e
        return self._finish()

    def _on_chunk(self) -> Frame | None:
        assert self._target is not None
        done, chunk = self._done, self._chunk
        with memoryview(self._sealed) as sealed:
            try:
                self._aead.decrypt_into(
                    self._next_nonce(),
                    sealed[: chunk + TAG_SIZE],
                    None,
                    self._target[done : done + chunk],
                )
            except InvalidTag as e:
                raise AuthenticationError("a frame chunk failed authentication") from e
        self._done = done + chunk
        if self._progress is not None:
            self._progress(self._target, self._done)
        if self._done < self._length:
            self._start_chunk()
            return None
        return self._finish()

    def _finish(self) -> Frame:
        assert self._target is not None
        target, self._target = self._target, None
        payload: bytes | memoryview = target if self._caller_owned else bytes(target)
        self._caller_owned = False
        self._progress = None
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
