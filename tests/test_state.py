import contextlib
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import ProtocolError, pack, unpack
from swarm._state import (
    DTYPES,
    MAX_DIMS,
    TensorSpec,
    flatten_state,
    parse_state_header,
    state_header,
    tensor_from_bytes,
    tensor_to_bytes,
    unflatten_state,
)

torch.set_num_threads(1)


def assert_same(a: Any, b: Any) -> None:
    """Structural equality that compares tensors by dtype, shape and values."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def through_bytes(obj: Any) -> Any:
    """Send the header as msgpack and the tensors as raw bytes, as state transfer does."""
    flat = flatten_state(obj)
    skeleton, specs = parse_state_header(unpack(pack(state_header(flat))))
    payloads = [tensor_to_bytes(t) for t in flat.tensors]
    tensors = [tensor_from_bytes(s, p) for s, p in zip(specs, payloads, strict=True)]
    return unflatten_state(skeleton, tensors)


def test_optimizer_state_round_trip() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    restored = through_bytes(state)
    assert_same(state, restored)
    assert restored["param_groups"][0]["betas"] == (0.8, 0.9)  # tuples stay tuples
    assert set(restored["state"]) == {0, 1}  # integer keys stay integers


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_round_trips(name: str) -> None:
    dtype = DTYPES[name]
    tensor = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    state = {"t": tensor, "scalar": tensor[1, 1].clone(), "empty": torch.empty(0, 5, dtype=dtype)}
    assert_same(state, through_bytes(state))


def test_scalars_and_nesting_round_trip() -> None:
    state: dict[Any, Any] = {
        "none": None,
        "flags": [True, False],
        "numbers": (1, -(2**63), 2**64 - 1, 0.5, float("inf"), float("nan")),
        "text": "é",
        "raw": b"\x00\xff",
        7: {"nested": [[], (), {}]},
        "looks_like_a_tag": ["T", 0],
        "t": torch.ones(2),
    }
    assert_same(state, through_bytes(state))


def test_shared_tensors_are_stored_once_and_stay_shared() -> None:
    weight = torch.randn(4, 4)
    flat = flatten_state({"embed": weight, "head": weight, "other": weight.clone()})
    assert len(flat.tensors) == 2
    restored = unflatten_state(flat.skeleton, flat.tensors)
    assert restored["embed"] is restored["head"]


def test_non_contiguous_tensor_keeps_its_values() -> None:
    tensor = torch.arange(12.0).reshape(3, 4).t()
    assert_same({"t": tensor.contiguous()}, through_bytes({"t": tensor}))


@pytest.mark.parametrize(
    "bad", [{"m": torch.nn.Linear(1, 1)}, {"d": torch.float32}, {(1, 2): 3}, {"s": {1, 2}}]
)
def test_unsupported_objects_are_refused_when_flattening(bad: Any) -> None:
    with pytest.raises(TypeError):
        flatten_state(bad)


def test_unsupported_dtype_is_refused() -> None:
    with pytest.raises(TypeError):
        flatten_state({"t": torch.zeros(2, dtype=torch.float8_e4m3fn)})


@pytest.mark.parametrize(
    ("skeleton", "n_tensors"),
    [
        (["T", 1], 1),  # index out of range
        (["T", -1], 1),
        (["T", "0"], 1),
        (["T"], 1),
        (["T", 0, 0], 1),
        (["x", 1], 0),  # unknown tag
        ([], 0),  # untagged list
        ({"a": 1}, 1),  # tensor never used
        ({"a": ["l", [1, 2]]}, 0),  # a nested list without a tag
    ],
)
def test_malformed_skeletons_raise_protocol_error(skeleton: Any, n_tensors: int) -> None:
    with pytest.raises(ProtocolError):
        unflatten_state(skeleton, [torch.zeros(1)] * n_tensors)


def test_over_deep_skeleton_raises_protocol_error() -> None:
    skeleton: Any = 0
    for _ in range(100):
        skeleton = ["l", skeleton]
    with pytest.raises(ProtocolError, match="deeper"):
        unflatten_state(skeleton, [])


@pytest.mark.parametrize(
    "wire",
    [
        ["float32"],
        ["float99", [1]],
        ["float32", [-1]],
        ["float32", "3"],
        ["float32", [1] * (MAX_DIMS + 1)],
        ["float32", [2**40, 2**20]],  # over the size limit below
        [b"float32", [1]],
    ],
)
def test_malformed_tensor_specs_raise_protocol_error(wire: Any) -> None:
    with pytest.raises(ProtocolError):
        TensorSpec.from_wire(wire, max_bytes=2**30)


@pytest.mark.parametrize(
    "header",
    [
        None,
        {"skeleton": 1},
        {"skeleton": 1, "tensors": {}},
        {"skeleton": 1, "tensors": [["float32", [1]]], "extra": 0},
        {"skeleton": 1, "tensors": [["float32", [100]], ["float32", [200]]]},  # 1200 bytes
    ],
)
def test_malformed_or_oversized_state_headers_raise_protocol_error(header: Any) -> None:
    with pytest.raises(ProtocolError):
        parse_state_header(header, max_total_bytes=1000)


def test_tensor_bytes_of_wrong_length_raise_protocol_error() -> None:
    spec = TensorSpec(torch.float32, (2, 2))
    with pytest.raises(ProtocolError):
        tensor_from_bytes(spec, b"\x00" * 15)


scalars: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.text(max_size=3),
    st.binary(max_size=3),
    st.floats(),
    st.sampled_from(["l", "t", "T"]),
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(scalars, inner, max_size=3),
    max_leaves=25,
)


@given(documents, st.integers(0, 3))
@settings(max_examples=400, deadline=None)
def test_fuzzed_skeletons_raise_only_protocol_error(skeleton: Any, n_tensors: int) -> None:
    tensors = [torch.zeros(i) for i in range(n_tensors)]
    with contextlib.suppress(ProtocolError):
        unflatten_state(skeleton, tensors)


@given(documents)
@settings(max_examples=200, deadline=None)
def test_fuzzed_tensor_specs_raise_only_protocol_error(wire: Any) -> None:
    try:
        spec = TensorSpec.from_wire(wire, max_bytes=2**20)
    except ProtocolError:
        return
    assert spec.nbytes <= 2**20


plain_states = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.text(max_size=4)
    | st.floats(allow_nan=False)
    | st.builds(torch.randn, st.integers(0, 3), st.integers(1, 2)),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 9), inner, max_size=3)
    ),
    max_leaves=15,
)


@given(plain_states)
@settings(max_examples=200, deadline=None)
def test_fuzzed_states_round_trip(state: Any) -> None:
    assert_same(state, through_bytes(state))
