import contextlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging._codecs import (
    FLOAT16,
    HEADER,
    NONE,
    UINT4,
    UINT8,
    Codec,
    CodecKind,
    all_finite,
    decode,
    decode_split,
    encode,
    encode_split,
    peek_length,
)
from swarm import ProtocolError

ALL = [NONE, FLOAT16, UINT8, UINT4, Codec(CodecKind.UINT8, 256), Codec(CodecKind.UINT4, 7)]


def sample(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("codec", ALL, ids=lambda c: f"{c.kind.name}-{c.block_size}")
@pytest.mark.parametrize("n", [0, 1, 2, 127, 128, 129, 1000, 4097])
def test_round_trip_within_bound(codec: Codec, n: int) -> None:
    x = sample(n, seed=n)
    blob = encode(x, codec)
    assert len(blob) == codec.encoded_size(n)
    assert peek_length(blob) == n
    y = decode(blob, expected_length=n)
    assert y.dtype == torch.float32 and y.shape == (n,)
    if codec.kind is CodecKind.NONE:
        assert torch.equal(x, y)
    elif codec.kind is CodecKind.FLOAT16:
        assert torch.equal(y, x.half().float())
    else:
        b = codec.block_size
        for start in range(0, n, b):
            xs, ys = x[start : start + b], y[start : start + b]
            if codec.kind is CodecKind.UINT8:
                bound = xs.abs().max() / 254
            else:
                bound = (xs.max() - xs.min()) / 30
            assert (xs - ys).abs().max() <= bound * (1 + 1e-5) + 1e-7


@pytest.mark.parametrize("codec", [UINT8, UINT4], ids=lambda c: c.kind.name)
def test_constant_and_zero_blocks_are_exact(codec: Codec) -> None:
    for x in (torch.zeros(300), torch.full((300,), 2.5)):
        y = decode(encode(x, codec))
        if codec.kind is CodecKind.UINT4 or x.abs().max() == 0:
            assert torch.equal(x, y)


@pytest.mark.parametrize("codec", ALL, ids=lambda c: f"{c.kind.name}-{c.block_size}")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_decodes_non_finite(codec: Codec, bad: float) -> None:
    x = sample(500)
    x[123] = bad
    assert not all_finite(decode(encode(x, codec)))
    assert all_finite(decode(encode(sample(500), codec)))


def test_decoder_rejections() -> None:
    blob = encode(sample(10), UINT8)
    with pytest.raises(ProtocolError, match="shorter than its header"):
        decode(blob[:5])
    with pytest.raises(ProtocolError, match="payload bytes"):
        decode(blob[:-1])
    with pytest.raises(ProtocolError, match="payload bytes"):
        decode(blob + b"\0")
    with pytest.raises(ProtocolError, match="unknown codec"):
        decode(bytes([9]) + blob[1:])
    with pytest.raises(ProtocolError, match="unknown dtype"):
        decode(blob[:1] + bytes([3]) + blob[2:])
    with pytest.raises(ProtocolError, match="expected 11"):
        decode(blob, expected_length=11)
    with pytest.raises(ProtocolError, match="block size"):
        decode(HEADER.pack(CodecKind.UINT8, 0, 0, 10, 0) + bytes(100))
    with pytest.raises(ProtocolError, match="no block size"):
        decode(HEADER.pack(CodecKind.NONE, 0, 0, 1, 4) + bytes(4))
    with pytest.raises(ProtocolError, match="reserved"):
        decode(HEADER.pack(CodecKind.NONE, 0, 1, 1, 0) + bytes(4))


def test_decode_accepts_memoryview_and_bytearray() -> None:
    x = sample(33)
    blob = encode(x, NONE)
    assert torch.equal(decode(memoryview(blob)), x)
    assert torch.equal(decode(bytearray(blob)), x)


@given(st.binary(max_size=300))
@settings(max_examples=500)
def test_fuzz_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data)


@given(
    st.sampled_from(list(CodecKind)),
    st.integers(0, 300),
    st.integers(0, 70000),
    st.binary(max_size=3000),
)
@settings(max_examples=500)
def test_fuzz_valid_headers_with_random_payload(
    kind: CodecKind, n: int, block: int, payload: bytes
) -> None:
    data = struct.pack("<BBHII", kind, 0, 0, n, block) + payload
    try:
        y = decode(data)
    except ProtocolError:
        return
    assert y.shape == (n,) and y.dtype == torch.float32


@given(st.sampled_from(ALL), st.lists(st.floats(-1e4, 1e4, width=32), max_size=600), st.data())
@settings(max_examples=200)
def test_fuzz_mutated_blobs(codec: Codec, values: list[float], data: st.DataObject) -> None:
    blob = bytearray(encode(torch.tensor(values, dtype=torch.float32), codec))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    with contextlib.suppress(ProtocolError):
        decode(bytes(blob[:cut]))


@pytest.mark.parametrize("codec", ALL, ids=lambda c: f"{c.kind.name}-{c.block_size}")
def test_split_blobs_round_trip(codec: Codec) -> None:
    x = sample(1000)
    header, payload = encode_split(x, codec)
    assert bytes(header) + bytes(payload) == encode(x, codec)
    y = decode_split(header, bytes(payload), expected_length=1000)
    assert torch.equal(y, decode(encode(x, codec)))
    with pytest.raises(ProtocolError, match="payload bytes"):
        decode_split(header, bytes(payload)[:-1])
    with pytest.raises(ProtocolError, match="header is"):
        decode_split(bytes(header)[:-1], payload)


def test_split_none_payload_is_the_tensor_memory() -> None:
    x = sample(10)
    _, payload = encode_split(x, NONE)
    x[3] = 42.0
    assert torch.frombuffer(bytearray(payload), dtype=torch.float32)[3] == 42.0


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_uint8_bytes_are_the_rounded_quotients(n: int) -> None:
    """The fast encoder (one multiply-add, the low byte of a float) writes
    exactly round(x / scale) + 127 with scale = absmax / 127 per block."""
    x = sample(n, seed=n)
    x[0] = -x.abs().max()  # the most negative value of its block: byte 0
    blob = memoryview(encode(x, UINT8))[HEADER.size :]
    blocks = -(-n // 4096)
    scales = torch.frombuffer(bytearray(blob[: 4 * blocks]), dtype=torch.float32)
    values = torch.frombuffer(bytearray(blob[4 * blocks :]), dtype=torch.uint8).long()
    for b in range(blocks):
        xs = x[b * 4096 : (b + 1) * 4096].double()
        absmax = xs.abs().max()
        assert scales[b] == torch.tensor(float(absmax) / 127, dtype=torch.float32)
        want = torch.round(xs * 127 / absmax).long() + 127
        got = values[b * 4096 : (b + 1) * 4096]
        # the product is rounded to float32 before it is rounded to an integer:
        # a quotient within float32 precision of a half may round either way
        assert (got - want).abs().max() <= 1 and int(got.min()) >= 0 and int(got.max()) <= 254
        assert float(((got - 127).double() - xs * 127 / absmax).abs().max()) <= 0.5 + 1e-4
    assert values[0] == 0
