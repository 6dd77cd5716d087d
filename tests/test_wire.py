import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import ProtocolError, pack, unpack
from swarm._wire import MAX_DEPTH

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary()
scalars = scalars | st.floats(allow_nan=False)
documents = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)


@given(documents)
def test_round_trip(doc: object) -> None:
    assert unpack(pack(doc)) == doc


@given(st.binary(max_size=512))
@settings(max_examples=500)
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        unpack(data)


@given(documents, st.data())
def test_truncated_documents_raise_protocol_error(doc: object, data: st.DataObject) -> None:
    encoded = pack(doc)
    if len(encoded) < 2:
        return
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ProtocolError):
        unpack(encoded[:cut])


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(ProtocolError):
        unpack(pack(1) + b"\x01")


def test_size_limit() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        unpack(pack(b"x" * 100), max_size=50)
    with pytest.raises(ValueError, match="limit"):
        pack(b"x" * 100, max_size=50)


def test_declared_length_larger_than_message_is_refused() -> None:
    # bin32 header declaring 4 GiB followed by nothing
    with pytest.raises(ProtocolError):
        unpack(b"\xc6\xff\xff\xff\xff")
    # array32 declaring 2**32-1 elements
    with pytest.raises(ProtocolError):
        unpack(b"\xdd\xff\xff\xff\xff")


def test_nesting_limit() -> None:
    doc: object = 1
    for _ in range(MAX_DEPTH + 2):
        doc = [doc]
    with pytest.raises(ProtocolError, match="nests deeper"):
        unpack(pack(doc))


def test_extension_types_are_refused() -> None:
    with pytest.raises(ProtocolError):
        unpack(b"\xd4\x01\x00")  # fixext1


def test_unencodable_is_a_local_value_error() -> None:
    with pytest.raises(ValueError):
        pack(object())
    assert math.isinf(unpack(pack(float("inf"))))
