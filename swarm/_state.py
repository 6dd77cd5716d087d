"""Training state as msgpack metadata plus raw tensors: no pickle anywhere.

A training state (a model ``state_dict``, an optimizer ``state_dict`` with its
nested ``state`` and ``param_groups``, a scheduler ``state_dict``, counters) is
a tree of dicts, lists, tuples, scalars and tensors. ``flatten_state`` splits it
into a *skeleton* that msgpack can carry and the list of tensors the skeleton
points to; ``unflatten_state`` puts them back together. Checkpoint files and the
state transfer to newcomers both use this split: ``state_header`` (the skeleton
and one ``TensorSpec`` per tensor) travels as msgpack, the tensor data as raw
bytes (``tensor_to_bytes``). A receiver checks the header with
``parse_state_header`` before it reads any tensor data, which bounds what it
will accept, then rebuilds each tensor with ``tensor_from_bytes`` and the state
with ``unflatten_state``.

Skeleton grammar (a skeleton from another peer is untrusted input):

- ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` stand for themselves;
- a msgpack map stands for a dict; its keys are scalars, its values are nodes;
- a list is always tagged by its first item: ``["l", node, ...]`` a list,
  ``["t", node, ...]`` a tuple, ``["T", index]`` the tensor ``tensors[index]``.

Tensors that are the same object in the input (tied weights) are stored once
and come back as one object. Tensor data is little-endian in memory order, as
torch stores it on every platform it supports.

Decoders here raise only ``ProtocolError``; encoders raise ``TypeError`` or
``ValueError`` for objects the local side should not have asked to encode.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import ProtocolError
from ._wire import MAX_DEPTH, expect_int, expect_str

#: The dtypes a state may contain, by their wire names.
DTYPES: Mapping[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES: Mapping[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

#: Most dimensions a decoded tensor may have.
MAX_DIMS = 16

_SCALARS = (type(None), bool, int, float, str, bytes)
_LIST, _TUPLE, _TENSOR = "l", "t", "T"

if sys.byteorder != "little":  # pragma: no cover - torch supports no big-endian platform
    raise ImportError("swarm stores tensors as little-endian bytes; this host is big-endian")


@dataclass(frozen=True)
class FlatState:
    """A state split into a msgpack-able ``skeleton`` and the ``tensors`` it refers to."""

    skeleton: Any
    tensors: list[torch.Tensor]


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver must know to turn raw bytes back into one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor``; ``TypeError`` if its dtype has no wire name."""
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensors of dtype {tensor.dtype} cannot be stored")
        return cls(tensor.dtype, tuple(tensor.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_wire(self) -> list[Any]:
        return [_DTYPE_NAMES[self.dtype], list(self.shape)]

    @classmethod
    def from_wire(cls, obj: Any, *, max_bytes: int | None = None) -> TensorSpec:
        """Decode a spec from untrusted input; ``ProtocolError`` if malformed or larger
        than ``max_bytes``."""
        if not isinstance(obj, list) or len(obj) != 2:
            raise ProtocolError("tensor spec: expected [dtype, shape]")
        name = expect_str(obj[0], "tensor spec dtype", max_size=16)
        if name not in DTYPES:
            raise ProtocolError(f"tensor spec: unknown dtype {name!r}")
        if not isinstance(obj[1], list) or len(obj[1]) > MAX_DIMS:
            raise ProtocolError(f"tensor spec: shape must be a list of at most {MAX_DIMS} sizes")
        shape = tuple(expect_int(n, "tensor spec size", lo=0, hi=2**62) for n in obj[1])
        spec = cls(DTYPES[name], shape)
        # An empty tensor passes any byte limit, but torch refuses shapes whose
        # strides overflow int64 (a RuntimeError, found by tests/test_fuzz.py).
        if math.prod(max(size, 1) for size in shape) * spec.dtype.itemsize >= 2**62:
            raise ProtocolError(f"tensor spec: shape {shape} is too large")
        if max_bytes is not None and spec.nbytes > max_bytes:
            raise ProtocolError(f"tensor of {spec.nbytes} bytes exceeds the limit of {max_bytes}")
        return spec


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``tensor`` (moved to CPU, in row-major order)."""
    TensorSpec.of(tensor)  # refuse dtypes the receiver could not decode
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(spec: TensorSpec, data: bytes | bytearray | memoryview) -> torch.Tensor:
    """A new CPU tensor described by ``spec`` holding ``data``.

    Raises ``ProtocolError`` if ``data`` is not exactly ``spec.nbytes`` long. The
    tensor owns a private copy of the bytes when ``data`` is immutable and shares
    memory with ``data`` when it is a ``bytearray``.
    """
    if len(data) != spec.nbytes:
        raise ProtocolError(f"tensor data is {len(data)} bytes, its spec says {spec.nbytes}")
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=spec.dtype).reshape(spec.shape)


def flatten_state(obj: Any) -> FlatState:
    """Split ``obj`` into a msgpack-able skeleton and its tensors (see the module doc).

    Raises ``TypeError`` for objects outside the grammar (modules, dtypes, sets,
    dict keys that are not scalars, tensors of unsupported dtype) and
    ``ValueError`` for containers nested deeper than ``MAX_DEPTH``.
    """
    tensors: list[torch.Tensor] = []
    index_of: dict[int, int] = {}

    def visit(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"the state nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, torch.Tensor):
            TensorSpec.of(node)
            index = index_of.get(id(node))
            if index is None:
                index = index_of[id(node)] = len(tensors)
                tensors.append(node.detach())
            return [_TENSOR, index]
        if isinstance(node, Mapping):
            out: dict[Any, Any] = {}
            for key, value in node.items():
                if not isinstance(key, _SCALARS):
                    raise TypeError(f"dict key {key!r} is not a scalar")
                out[key] = visit(value, depth + 1)
            return out
        if isinstance(node, list | tuple):
            tag = _LIST if isinstance(node, list) else _TUPLE
            return [tag, *(visit(item, depth + 1) for item in node)]
        raise TypeError(f"cannot store a {type(node).__name__} in a training state")

    skeleton = visit(obj, 0)
    return FlatState(skeleton, tensors)


def state_header(flat: FlatState) -> dict[str, Any]:
    """The msgpack-able description of ``flat``: its skeleton and its tensors' specs."""
    return {
        "skeleton": flat.skeleton,
        "tensors": [TensorSpec.of(t).to_wire() for t in flat.tensors],
    }


def parse_state_header(
    obj: Any, *, max_total_bytes: int | None = None
) -> tuple[Any, list[TensorSpec]]:
    """The skeleton and tensor specs of an untrusted ``state_header``.

    Raises ``ProtocolError`` if it is malformed or its tensors add up to more than
    ``max_total_bytes``. The skeleton itself is checked by ``unflatten_state``.
    """
    if not isinstance(obj, dict) or set(obj) != {"skeleton", "tensors"}:
        raise ProtocolError("state header: expected a map of skeleton and tensors")
    if not isinstance(obj["tensors"], list):
        raise ProtocolError("state header: tensors must be a list of specs")
    specs = [TensorSpec.from_wire(s, max_bytes=max_total_bytes) for s in obj["tensors"]]
    total = sum(s.nbytes for s in specs)
    if max_total_bytes is not None and total > max_total_bytes:
        raise ProtocolError(f"state of {total} bytes exceeds the limit of {max_total_bytes}")
    return obj["skeleton"], specs


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the object that ``flatten_state`` split into ``skeleton`` and ``tensors``.

    ``skeleton`` may come from another peer: anything outside the grammar, a
    tensor index out of range, a tensor no node refers to, or nesting deeper
    than ``MAX_DEPTH`` raises ``ProtocolError`` and nothing else.
    """
    used = [False] * len(tensors)

    def visit(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ProtocolError(f"state skeleton nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, dict):
            out: dict[Any, Any] = {}
            for key, value in node.items():
                if not isinstance(key, _SCALARS):
                    raise ProtocolError("state skeleton: a dict key must be a scalar")
                out[key] = visit(value, depth + 1)
            return out
        if isinstance(node, list) and node:
            tag = node[0]
            if tag == _LIST:
                return [visit(item, depth + 1) for item in node[1:]]
            if tag == _TUPLE:
                return tuple(visit(item, depth + 1) for item in node[1:])
            if tag == _TENSOR and len(node) == 2:
                index = expect_int(node[1], "state skeleton tensor index", lo=0)
                if index >= len(tensors):
                    raise ProtocolError(
                        f"state skeleton refers to tensor {index} of {len(tensors)}"
                    )
                used[index] = True
                return tensors[index]
            raise ProtocolError(f"state skeleton: malformed tagged list (tag {tag!r})")
        raise ProtocolError(f"state skeleton: unexpected {type(node).__name__}")

    state = visit(skeleton, 0)
    if not all(used):
        raise ProtocolError(f"state skeleton leaves tensor {used.index(False)} unused")
    return state
