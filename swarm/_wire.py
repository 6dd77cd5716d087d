"""The wire format: msgpack with explicit size limits, and nothing else.

Every message that crosses between peers is a msgpack document. ``unpack``
is the only way bytes from another peer become Python objects, and the only
exception it raises is ``ProtocolError``: malformed, truncated, oversized or
over-nested input never crashes a peer and never reaches pickle.

msgpack's own limits (string, binary, array and map lengths) are set from the
message size, so a small datagram cannot declare a gigantic container. Only the
msgpack types map to Python: nil, bool, int, float, str, bytes, list, dict.
Extension types are refused.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ._errors import ProtocolError

#: Upper bound on any single msgpack message. Bulk tensor data does not travel as
#: msgpack: it streams as raw bytes behind a small header.
MAX_MESSAGE_SIZE = 4 * 1024 * 1024
#: Deepest nesting of lists and maps that a decoder accepts.
MAX_DEPTH = 32


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed")


def pack(obj: Any, *, max_size: int = MAX_MESSAGE_SIZE) -> bytes:
    """Encode ``obj``; raise ``ValueError`` if it is not msgpack-able or too large.

    This is the local side's mistake, so it is a ``ValueError``, not a
    ``ProtocolError``.
    """
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"cannot encode {type(obj).__name__} as msgpack: {e}") from e
    if len(data) > max_size:
        raise ValueError(f"encoded message is {len(data)} bytes, limit is {max_size}")
    return data


def unpack(data: bytes | bytearray | memoryview, *, max_size: int = MAX_MESSAGE_SIZE) -> Any:
    """Decode one msgpack document from untrusted bytes.

    Raises ``ProtocolError`` for anything but exactly one well-formed document
    within ``max_size`` bytes and ``MAX_DEPTH`` levels of nesting.
    """
    size = len(data)
    if size > max_size:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {max_size}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            ext_hook=_refuse_ext,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types for bad input
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}") from e
    _check_depth(obj)
    return obj


def _check_depth(obj: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"message nests deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        for item in obj:
            if isinstance(item, list | dict):
                _check_depth(item, depth + 1)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            if isinstance(key, list | dict):
                raise ProtocolError("a map key must be a scalar")
            if isinstance(item, list | dict):
                _check_depth(item, depth + 1)


# Helpers for decoders: pull typed fields out of an untrusted document and raise
# ProtocolError with a message naming the field when the type is wrong.


def expect_list(obj: Any, length: int, what: str) -> list[Any]:
    if not isinstance(obj, list) or len(obj) != length:
        raise ProtocolError(f"{what}: expected a list of {length} items")
    return obj


def expect_bytes(
    obj: Any, what: str, *, size: int | None = None, max_size: int | None = None
) -> bytes:
    if not isinstance(obj, bytes):
        raise ProtocolError(f"{what}: expected bytes, got {type(obj).__name__}")
    if size is not None and len(obj) != size:
        raise ProtocolError(f"{what}: expected {size} bytes, got {len(obj)}")
    if max_size is not None and len(obj) > max_size:
        raise ProtocolError(f"{what}: {len(obj)} bytes exceeds the limit of {max_size}")
    return obj


def expect_int(obj: Any, what: str, *, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(obj, int) or isinstance(obj, bool):
        raise ProtocolError(f"{what}: expected an integer, got {type(obj).__name__}")
    if (lo is not None and obj < lo) or (hi is not None and obj > hi):
        raise ProtocolError(f"{what}: {obj} is outside [{lo}, {hi}]")
    return obj


def expect_float(obj: Any, what: str) -> float:
    if isinstance(obj, bool) or not isinstance(obj, int | float):
        raise ProtocolError(f"{what}: expected a number, got {type(obj).__name__}")
    value = float(obj)
    if value != value or value in (float("inf"), float("-inf")):
        raise ProtocolError(f"{what}: expected a finite number")
    return value


def expect_str(obj: Any, what: str, *, max_size: int | None = None) -> str:
    if not isinstance(obj, str):
        raise ProtocolError(f"{what}: expected a string, got {type(obj).__name__}")
    if max_size is not None and len(obj) > max_size:
        raise ProtocolError(f"{what}: {len(obj)} characters exceeds the limit of {max_size}")
    return obj
