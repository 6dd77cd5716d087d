"""Codecs for tensor parts on the wire: raw little-endian bytes behind a header.

A blob is a 12-byte header followed by the payload::

    u8 codec | u8 dtype | u16 reserved (0) | u32 length | u32 block size

``length`` is the number of values, ``dtype`` the dtype they decode to (only
float32 today). No pickle and no msgpack: ``decode`` reads untrusted bytes and
raises only ``swarm.ProtocolError`` (unknown codec or dtype, sizes that do not
add up). ``encode`` takes only floating point CPU tensors and raises
``LocalTensorError`` (a local error) for any other: tensors on a device
reach the wire through ``_staging.HostStaging``. It does not reject NaN or
Inf: a quantized blob with a NaN scale decodes to NaNs, and the caller
checks ``all_finite`` (the all-reduce treats such a part as a failure of
whoever sent it).

Codecs:

- ``NONE``: float32, exact.
- ``FLOAT16``: IEEE half; values beyond +-65504 become +-Inf (and are then
  rejected as non-finite), so use it for gradients and parameters, not sums.
- ``UINT8`` (blockwise absmax, 8 bits; Dettmers et al. 2022, "8-bit optimizers
  via block-wise quantization", sec. 2): per block of ``block_size`` values one
  float32 scale ``absmax / 127``; values are ``round(x / scale)`` in
  [-127, 127] stored offset by 127. Error per value <= absmax / 254 of its block.
- ``UINT4`` (asymmetric group quantization, 4 bits, as in Flash Communication,
  Li et al. 2024, sec. 3): per group of ``block_size`` values (128 by default)
  float32 minimum and scale ``(max - min) / 15``; values are
  ``round((x - min) / scale)`` in [0, 15], two per byte, low nibble first.
  Error per value <= (max - min) / 30 of its group.
"""

from __future__ import annotations

import enum
import math
import struct
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from swarm import ProtocolError

from ._staging import require_host

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("averaging._codecs assumes a little-endian host")

HEADER = struct.Struct("<BBHII")
#: Largest block size a decoder accepts: bounds the padding a blob can ask for.
MAX_BLOCK_SIZE = 1 << 16


class CodecKind(enum.IntEnum):
    NONE = 0
    FLOAT16 = 1
    UINT8 = 2
    UINT4 = 3


class _DType(enum.IntEnum):
    FLOAT32 = 0


@dataclass(frozen=True)
class Codec:
    """A codec and its block size (ignored by NONE and FLOAT16)."""

    kind: CodecKind
    block_size: int = 0

    def __post_init__(self) -> None:
        quantized = self.kind in (CodecKind.UINT8, CodecKind.UINT4)
        if quantized and not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"{self.kind.name} needs a block size in [1, {MAX_BLOCK_SIZE}]")
        if not quantized and self.block_size != 0:
            raise ValueError(f"{self.kind.name} has no block size")

    def payload_size(self, length: int) -> int:
        """Bytes of the values of a blob holding ``length`` values (block scales
        included, header not)."""
        return _payload_size(self.kind, length, self.block_size)

    def encoded_size(self, length: int) -> int:
        """Bytes of a blob holding ``length`` values, header included."""
        return HEADER.size + self.payload_size(length)


NONE = Codec(CodecKind.NONE)
FLOAT16 = Codec(CodecKind.FLOAT16)
UINT8 = Codec(CodecKind.UINT8, 4096)
UINT4 = Codec(CodecKind.UINT4, 128)


def _payload_size(kind: CodecKind, n: int, block: int) -> int:
    if kind is CodecKind.NONE:
        return 4 * n
    if kind is CodecKind.FLOAT16:
        return 2 * n
    blocks = -(-n // block)
    if kind is CodecKind.UINT8:
        return 4 * blocks + n
    return 8 * blocks + (n + 1) // 2


def _frombuffer(data: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # Received frames are immutable bytes; the tensor is only ever read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=dtype, count=count, offset=offset)


def _padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as (blocks, block) rows; the tail is padded with the last value."""
    n = x.numel()
    blocks = -(-n // block)
    if blocks * block == n:
        return x.reshape(blocks, block)
    padded = torch.empty(blocks * block, dtype=torch.float32)
    padded[:n] = x
    padded[n:] = x[-1]  # does not change the min, max or absmax of the last block
    return padded.view(blocks, block)


def encode(values: torch.Tensor, codec: Codec) -> bytes:
    """Encode a 1-D float tensor as one blob. Raises ``ValueError`` if it is too long."""
    return bytes(encode_into(values, codec))


def encode_into(values: torch.Tensor, codec: Codec, prefix: bytes = b"") -> bytearray:
    """``prefix`` followed by the blob of ``values``, built in one buffer.

    The all-reduce puts its frame header in ``prefix``, so a frame costs one
    allocation and, for ``NONE``, one copy of the values. Raises ``ValueError``
    if ``values`` has 2**32 values or more, and ``LocalTensorError`` if it is
    not a floating point CPU tensor (stage device tensors with ``HostStaging``).
    """
    require_host(values, "an encoded tensor")
    x = values.detach().reshape(-1)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    n = x.numel()
    if n >= 1 << 32:
        raise ValueError("a blob holds fewer than 2**32 values")
    at = len(prefix) + HEADER.size
    out = bytearray(at + _payload_size(codec.kind, n, codec.block_size))
    out[: len(prefix)] = prefix
    HEADER.pack_into(out, len(prefix), codec.kind, _DType.FLOAT32, 0, n, codec.block_size)
    if n == 0:
        return out
    if codec.kind is CodecKind.NONE:
        _writable(out, torch.float32, n, at).copy_(x)
        return out
    if codec.kind is CodecKind.FLOAT16:
        _writable(out, torch.float16, n, at).copy_(x)
        return out
    if codec.kind is CodecKind.UINT8:
        _encode_uint8(x, codec.block_size, out, at)
        return out
    rows = _padded_blocks(x, codec.block_size)
    blocks = rows.shape[0]
    low = _writable(out, torch.float32, blocks, at)
    scale = _writable(out, torch.float32, blocks, at + 4 * blocks)
    torch.amin(rows, dim=1, out=low)
    torch.amax(rows, dim=1, out=scale).sub_(low).div_(15.0)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = rows.sub(low.unsqueeze(1)).div_(safe.unsqueeze(1)).round_().clamp_(0, 15)
    q4 = q.view(-1)[:n].to(torch.uint8)
    if n % 2:
        q4 = torch.cat([q4, q4.new_zeros(1)])
    packed = _writable(out, torch.uint8, (n + 1) // 2, at + 8 * blocks)
    torch.bitwise_or(q4[0::2], q4[1::2] << 4, out=packed)
    return out


def _encode_uint8(x: torch.Tensor, block: int, out: bytearray, at: int) -> None:
    """UINT8's payload of the ``n`` values ``x`` into ``out[at:]``.

    absmax as max(amax, -amin): two reductions that allocate nothing (amax
    of abs() wrote a copy first). Then x * 127 / absmax plus 127 + 2**23: a
    float32 in [2**23, 2**23 + 255) holds round(x / scale) + 127 (rounded
    half to even, as ``round`` does) in its lowest mantissa byte, which is
    copied out as is; |x| <= absmax keeps it in [0, 254] without a clamp.
    abs, div, round, clamp, add and a float-to-uint8 conversion each took a
    pass before, and a padded copy of the vector a last partial block; the
    products go to a reused buffer (``_scratch``). A NaN absmax gives a NaN
    scale, an Inf one an Inf scale: the blob decodes to non-finite values
    either way.
    """
    n = x.numel()
    full, tail = divmod(n, block)
    blocks = full + (tail > 0)
    scale = _writable(out, torch.float32, blocks, at)
    q = _scratch(n)
    # the whole blocks, then the last partial one (as a block of its own size)
    for first, rows_of, size in ((0, full, block), (full, 1 if tail else 0, tail)):
        if rows_of == 0:
            continue
        start = first * block
        rows = x[start : start + rows_of * size].view(rows_of, size)
        part = scale[first : first + rows_of]
        torch.maximum(torch.amax(rows, dim=1), torch.amin(rows, dim=1).neg_(), out=part)
        inverse = torch.where(part > 0, 127.0 / part, torch.zeros_like(part))
        torch.mul(
            rows, inverse.unsqueeze(1), out=q[start : start + rows_of * size].view(rows_of, size)
        )
    scale.div_(127.0)
    q.add_(127.0 + 2.0**23)
    low_bytes = q.view(torch.uint8)[0::4]  # little-endian: the lowest byte first
    _writable(out, torch.uint8, n, at + 4 * blocks).copy_(low_bytes)


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """``n`` float32 values of this thread's scratch buffer (contents undefined).

    Reused between calls: fresh memory costs a page fault per 4 KiB when it
    is first written, which for a 5 MB chunk took longer than quantizing it.
    Each thread that encodes keeps one buffer of the largest chunk it encoded
    (4 MiB at the all-reduce's default chunk size).
    """
    buffer: torch.Tensor | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < n:
        buffer = _local.buffer = torch.empty(n, dtype=torch.float32)
    return buffer[:n]


def _writable(out: bytearray, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    return torch.frombuffer(out, dtype=dtype, count=count, offset=offset)


def peek_length(data: bytes | bytearray | memoryview) -> int:
    """The number of values a blob declares. Raises ``ProtocolError`` if no header."""
    if len(data) < HEADER.size:
        raise ProtocolError(f"tensor blob of {len(data)} bytes is shorter than its header")
    return int(HEADER.unpack_from(data)[3])


def decode(
    data: bytes | bytearray | memoryview, *, expected_length: int | None = None
) -> torch.Tensor:
    """Decode one blob into a 1-D float32 tensor.

    The result may share memory with ``data`` and must be treated as read-only.
    Raises ``ProtocolError`` (and nothing else) if the header names an unknown
    codec or dtype, the block size is out of range, the payload size does not
    match the header, or the length differs from ``expected_length``. NaN and
    Inf are decoded as such: check ``all_finite``.
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise ProtocolError(f"tensor blob of {len(view)} bytes is shorter than its header")
    return decode_split(view[: HEADER.size], view[HEADER.size :], expected_length=expected_length)


def encode_split(
    values: torch.Tensor, codec: Codec
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """A blob as (header, payload), to be sent as two frames.

    For ``NONE`` and a contiguous float32 tensor the payload is a view of the
    tensor's own memory: nothing is copied, and the caller must not change
    those values until the payload has been sent. Raises what ``encode_into``
    raises (``LocalTensorError`` for a tensor that is not on the CPU).
    """
    require_host(values, "an encoded tensor")
    if codec.kind is CodecKind.NONE and values.dtype == torch.float32 and values.is_contiguous():
        flat = values.detach().reshape(-1)
        n = flat.numel()
        if n >= 1 << 32:
            raise ValueError("a blob holds fewer than 2**32 values")
        header = HEADER.pack(codec.kind, _DType.FLOAT32, 0, n, 0)
        array: Any = flat.numpy()  # shares the tensor's memory
        return header, memoryview(array).cast("B")
    blob = encode_into(values, codec)
    return bytes(blob[: HEADER.size]), memoryview(blob)[HEADER.size :]


def is_raw_float32(header: bytes | bytearray | memoryview) -> bool:
    """Whether a blob header announces ``NONE``: a payload of raw float32 values."""
    head = memoryview(header).cast("B")
    return len(head) == HEADER.size and head[0] == CodecKind.NONE and head[1] == _DType.FLOAT32


def payload_size(
    header: bytes | bytearray | memoryview, *, expected_length: int | None = None
) -> int:
    """The payload bytes a blob header announces (to receive them into place).

    Raises ``ProtocolError`` for every header ``decode_split`` refuses.
    """
    kind, n, block = _parse_header(header, expected_length)
    return _payload_size(kind, n, block)


def _parse_header(
    header: bytes | bytearray | memoryview, expected_length: int | None
) -> tuple[CodecKind, int, int]:
    head = memoryview(header).cast("B")
    if len(head) != HEADER.size:
        raise ProtocolError(f"tensor blob header is {len(head)} bytes, expected {HEADER.size}")
    kind_code, dtype_code, reserved, n, block = HEADER.unpack_from(head)
    try:
        kind = CodecKind(kind_code)
    except ValueError:
        raise ProtocolError(f"unknown codec {kind_code}") from None
    if dtype_code != _DType.FLOAT32:
        raise ProtocolError(f"unknown dtype {dtype_code}")
    if reserved != 0:
        raise ProtocolError("reserved header bits are set")
    if expected_length is not None and n != expected_length:
        raise ProtocolError(f"tensor blob holds {n} values, expected {expected_length}")
    quantized = kind in (CodecKind.UINT8, CodecKind.UINT4)
    if quantized and not 1 <= block <= MAX_BLOCK_SIZE:
        raise ProtocolError(f"block size {block} is outside [1, {MAX_BLOCK_SIZE}]")
    if not quantized and block != 0:
        raise ProtocolError(f"{kind.name} has no block size, got {block}")
    return kind, n, block


def decode_split(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    *,
    expected_length: int | None = None,
) -> torch.Tensor:
    """``decode`` of a blob that arrived as (header, payload); the same promises."""
    view = memoryview(payload).cast("B")
    kind, n, block = _parse_header(header, expected_length)
    if len(view) != _payload_size(kind, n, block):
        raise ProtocolError(
            f"{kind.name} blob of {n} values needs {_payload_size(kind, n, block)} payload bytes,"
            f" got {len(view)}"
        )
    if n == 0:
        return torch.empty(0, dtype=torch.float32)
    if kind is CodecKind.NONE:
        return _frombuffer(view, torch.float32, n, 0)
    if kind is CodecKind.FLOAT16:
        return _frombuffer(view, torch.float16, n, 0).to(torch.float32)
    blocks = -(-n // block)
    out = torch.empty(blocks * block, dtype=torch.float32)
    if kind is CodecKind.UINT8:
        scale = _frombuffer(view, torch.float32, blocks, 0)
        out[:n] = _frombuffer(view, torch.uint8, n, 4 * blocks)
        out[n:] = 127
        rows = out.view(blocks, block).sub_(127).mul_(scale.unsqueeze(1))
        return rows.view(-1)[:n]
    low = _frombuffer(view, torch.float32, blocks, 0)
    scale = _frombuffer(view, torch.float32, blocks, 4 * blocks)
    packed = _frombuffer(view, torch.uint8, (n + 1) // 2, 8 * blocks)
    out[0:n:2] = packed & 15
    out[1:n:2] = (packed >> 4)[: n // 2]
    out[n:] = 0
    rows = out.view(blocks, block).mul_(scale.unsqueeze(1)).add_(low.unsqueeze(1))
    return rows.view(-1)[:n]


def all_finite(values: torch.Tensor) -> bool:
    """True if no value is NaN or +-Inf.

    A NaN or Inf makes the sum non-finite, and one reduction pass is several
    times faster than ``isfinite`` (which writes a mask); only a non-finite
    sum, which finite values can also give by overflow, needs the exact test.
    """
    if values.numel() == 0 or math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())
