"""Wire fuzzing: every decoder of peer input, fed random, truncated and mutated bytes.

Each ``Target`` below is one decoder as a peer runs it on untrusted bytes, with
valid encodings to start from and the typed errors it is documented to raise.
Three kinds of input per target:

- random bytes;
- a valid encoding cut short;
- a valid encoding mutated: bit flips, byte substitutions, insertions,
  deletions and truncation, up to four at once.

Any other exception fails the test. Decoders behind a signature or a MAC
(DHT datagrams, frames, handshakes) are also fuzzed *behind* it: the DHT
request handlers get mutated bodies as if correctly signed, the handshake
messages are mutated before the peer signs its part.

The last two tests do the same on real sockets on 127.0.0.1: a burst of fuzzed
datagrams at a DHT node and of fuzzed connections (raw bytes, mutated
handshakes, authenticated sessions carrying fuzzed frames) at a connection
listener, after which both still serve a well-behaved peer.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio
from dht_harness import open_pair, send_datagrams
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kademlia.node import Node

from averaging._allreduce import (
    _CHUNK_INDEX,
    PROTOCOL_VERSION,
    mask_size,
    parse_chunk_header,
    parse_result_header,
    parse_sender_header,
)
from averaging._codecs import FLOAT16, NONE, UINT4, UINT8, decode, decode_split, encode
from averaging._datagrams import (
    PIECE_ELEMENTS,
    ControlOpener,
    ControlSealer,
    DatagramOpener,
    DatagramSealer,
    Kind,
    Pair,
)
from averaging._group import Group, GroupMember, MemberMode
from averaging._lossy import LOSSY_VERSION, parse_header
from averaging._matchmaking import Candidate, member_from_wire, member_to_wire
from averaging._partition import Partition
from averaging._pieces import PieceMask
from averaging._state_transfer import (
    DonorBusy,
    DonorRefused,
    StateAssembler,
    check_template,
    decode_header,
    encode_header,
    encode_refusal,
)
from dht import DHTConfig, DHTValue, RequestRateLimit
from dht import _messages as messages
from dht._protocol import SwarmProtocol, decode_find_value_reply, decode_nodes
from dht._records import Record, RecordLimits, decode_subkey, make_record, owner_marker, validate
from dht._storage import RecordStorage
from swarm import Identity, ManualClock, PeerUnreachableError, ProtocolError, RecordRejectedError
from swarm._connections import Stream, open_connections
from swarm._framing import FrameDecoder, FrameEncoder, FrameKind
from swarm._handshake import Handshake
from swarm._punch import decode_offer, encode_offer
from swarm._relay import decode_registered
from swarm._state import flatten_state, parse_state_header, tensor_from_bytes, unflatten_state
from swarm._wire import pack, unpack

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
NOW = 1_700_000_000.0
LIMITS = RecordLimits()
KEY = bytes(range(32))

# -- mutations -------------------------------------------------------------------------

_position = st.integers(0, 2**16)
_mutation = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(0, 7)),
    st.tuples(st.just("set"), _position, st.integers(0, 255)),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _position, st.integers(1, 8)),
    st.tuples(st.just("cut"), _position),
)


def mutate(data: bytes, mutations: list[tuple[Any, ...]]) -> bytes:
    out = bytearray(data)
    for op, pos, *arg in mutations:
        at = pos % (len(out) + 1)
        if op == "insert":
            out[at:at] = arg[0]
        elif op == "cut":
            del out[at:]
        elif not out:
            continue
        elif op == "flip":
            out[at % len(out)] ^= 1 << arg[0]
        elif op == "set":
            out[at % len(out)] = arg[0]
        elif op == "delete":
            del out[at : at + arg[0]]
    return bytes(out)


# -- targets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    samples: Callable[[], list[bytes]]
    decode: Callable[[bytes], object]
    errors: tuple[type[BaseException], ...] = (ProtocolError,)


# DHT records and datagrams


def _records() -> list[Record]:
    return [
        make_record("plain", {"x": [1, 2.5, "s"]}, NOW + 100, limits=LIMITS),
        make_record("room", b"v" * 40, NOW + 50, subkey="peer-1", limits=LIMITS),
        make_record(
            "run.progress",
            7,
            NOW + 10,
            subkey=owner_marker(ALICE.peer_id),
            signer=ALICE,
            limits=LIMITS,
        ),
    ]


def _decode_record(data: bytes) -> None:
    record = Record.from_wire(unpack(data, max_size=messages.MAX_DATAGRAM_SIZE), LIMITS)
    validate(record, NOW, LIMITS)
    record.decoded_value()
    if record.subkey is not None:
        decode_subkey(record.subkey)


_BODIES: list[Any] = [
    ["ping", []],
    ["ping", [], 1],  # from a client-mode node
    ["find_node", [bytes(BOB.peer_id)]],
    ["find_value", [_records()[0].key_id]],
    *(["store", [r.to_wire()]] for r in _records()),
]


def _datagrams() -> list[bytes]:
    return [
        *(messages.encode(ALICE, messages.Kind.REQUEST, bytes(20), body) for body in _BODIES),
        messages.encode(ALICE, messages.Kind.RESPONSE, bytes(20), [True, None]),
    ]


class _SentDatagrams:
    """The I/O boundary of a ``SwarmProtocol``: what it would send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: object) -> None:
        self.sent.append(data)

    def close(self) -> None:
        pass


def _answer_request(data: bytes) -> None:
    """A storing node's whole request path for a correctly signed body."""
    clock = ManualClock(NOW)
    proto = SwarmProtocol(
        Node(BOB.peer_id),
        RecordStorage(clock, LIMITS),
        20,
        identity=BOB,
        limits=LIMITS,
        rpc_timeout=1.0,
        clock=clock,
        rate_limit=RequestRateLimit(),
        rate_clock=ManualClock(0.0),
    )
    transport = _SentDatagrams()
    proto.transport = transport  # type: ignore[assignment]
    proto._pinging.add(bytes(ALICE.peer_id))  # no ping-back task: there is no event loop
    body = unpack(data, max_size=messages.MAX_DATAGRAM_SIZE)
    proto._answer(
        messages.Datagram(messages.Kind.REQUEST, bytes(20), ALICE.peer_id, body), ("127.0.0.1", 9)
    )
    for reply in transport.sent:  # whatever it answers is a well-formed, signed datagram
        assert messages.decode(reply).sender == BOB.peer_id


def _replies() -> list[bytes]:
    contacts = [[bytes(BOB.peer_id), "127.0.0.1", 4000], [bytes(ALICE.peer_id), "::1", 1]]
    return [pack([[r.to_wire() for r in _records()], contacts, False]), pack(contacts)]


def _decode_reply(data: bytes) -> None:
    obj = unpack(data)
    if isinstance(obj, list) and len(obj) == 3:
        decode_find_value_reply(obj, LIMITS)
    else:
        decode_nodes(obj)


# connection frames and handshakes


def _frames(encrypt: bool) -> list[bytes]:
    encoder = FrameEncoder(KEY, encrypt=encrypt, max_frame_size=1 << 20)
    frames = [
        (FrameKind.OPEN, pack(["allreduce"])),
        (FrameKind.MESSAGE, pack({"a": 1})),
        (FrameKind.BYTES, bytes(range(200))),
        (FrameKind.EOF, b""),
    ]
    wire = [b"".join(bytes(b) for b in encoder.encode(k, p)) for k, p in frames]
    return [b"".join(wire), wire[0]]


def _frame_target(encrypt: bool) -> Target:
    def feed(data: bytes) -> None:
        FrameDecoder(KEY, encrypt=encrypt, max_frame_size=1 << 20).feed(data)

    return Target(f"frames-{'encrypted' if encrypt else 'plain'}", lambda: _frames(encrypt), feed)


def _handshake_pair(seed: int = 0, swarm_key: bytes | None = None) -> tuple[Handshake, Handshake]:
    rng = random.Random(seed)
    dialer = Handshake(
        ALICE,
        initiator=True,
        expected_peer=BOB.peer_id,
        random_bytes=rng.randbytes,
        swarm_key=swarm_key,
    )
    listener = Handshake(BOB, initiator=False, random_bytes=rng.randbytes, swarm_key=swarm_key)
    return dialer, listener


def _handshake_messages() -> list[bytes]:
    dialer, listener = _handshake_pair()
    m1 = dialer.start()
    m2 = listener.receive_data(m1)
    m3 = dialer.receive_data(m2)
    return [m1, m2, m3]


def _handshake_target(step: int) -> Target:
    """Message M1 (to a listener), M2 (to the dialer) or M3 (to the listener)."""

    def receive(data: bytes) -> None:
        dialer, listener = _handshake_pair()
        m1 = dialer.start()
        if step == 0:
            listener.receive_data(data)
        elif step == 1:
            dialer.receive_data(data)
        else:
            listener.receive_data(m1)
            listener.receive_data(data)

    return Target(f"handshake-m{step + 1}", lambda: [_handshake_messages()[step]], receive)


# all-reduce

_MEMBERS = [
    GroupMember(ALICE.peer_id, "127.0.0.1", 1000),
    GroupMember(BOB.peer_id, "127.0.0.1", 1001),
    GroupMember(Identity.from_seed(b"c" * 32).peer_id, "127.0.0.1", 1002, mode=MemberMode.AUX),
]
_GROUP = Group(b"g" * 8, _MEMBERS, 1)  # we are BOB and reduce part 1
_PARTITION = Partition.for_group(_GROUP, 100, 16)
_VALUES = torch.linspace(-3, 3, 16)


def _blobs() -> list[bytes]:
    return [encode(_VALUES, codec) for codec in (NONE, FLOAT16, UINT8, UINT4)]


def _sender_header(data: bytes) -> None:
    parse_sender_header(unpack(data), _GROUP, _PARTITION, ALICE.peer_id)


def _chunk(data: bytes) -> None:
    header, _ = parse_chunk_header(data[: _CHUNK_INDEX.size + 12], 0, 16)
    decode_split(header, data[_CHUNK_INDEX.size + 12 :], expected_length=16)


def _result(data: bytes) -> None:
    prefix = _CHUNK_INDEX.size + mask_size(_GROUP.size) + 12
    _, header, _ = parse_result_header(data[:prefix], 0, _GROUP.size, frozenset({0, 1}), 16)
    if header is not None:
        decode_split(header, data[prefix:], expected_length=16)


def _results() -> list[bytes]:
    mask = bytes([0b11, 0, 0, 0])
    return [_CHUNK_INDEX.pack(0) + mask + blob for blob in _blobs()] + [
        _CHUNK_INDEX.pack(0) + bytes(4)
    ]


# the lossy all-reduce: datagrams (dropped, never raising) and contributor masks

_LOSSY_KEY = bytes(range(32))
_LOSSY_PAIR = Pair(Kind.RESULT, b"t" * 4, 9, part=1, sender=0, part_size=PIECE_ELEMENTS + 7)


def _lossy_datagrams() -> list[bytes]:
    sealer = DatagramSealer(_LOSSY_KEY, _LOSSY_PAIR)
    return [
        sealer.seal(0, torch.linspace(-1, 1, PIECE_ELEMENTS)),
        sealer.seal(1, torch.ones(7)),
    ]


def _lossy_datagram(data: bytes) -> None:
    """A datagram that is not exactly one of the sealed ones never opens:
    dropping is the opener's only answer to bad input (it never raises)."""
    opened = DatagramOpener(_LOSSY_KEY, _LOSSY_PAIR).open(data)
    if opened is None:
        raise ProtocolError("dropped")
    if data not in _lossy_datagrams():
        raise AssertionError("an altered datagram was accepted")


_LOSSY_CONTROL = Pair(Kind.REDUCER_CONTROL, b"t" * 4, 9, part=1, sender=0, part_size=7)


def _lossy_controls() -> list[bytes]:
    sealer = ControlSealer(_LOSSY_KEY, _LOSSY_CONTROL)
    return [sealer.seal(["report", 1, 0.5, [[0, b"\x01"]]]), sealer.seal(["sent", 1, 0.5])]


def _lossy_control(data: bytes) -> None:
    """The same for the control messages' datagram copies."""
    opened = ControlOpener(_LOSSY_KEY, _LOSSY_CONTROL).open(data)
    if opened is None:
        raise ProtocolError("dropped")
    if data not in _lossy_controls():
        raise AssertionError("an altered control datagram was accepted")


_LOSSY_HEADER = Pair(Kind.SENDER_HEADER, b"t" * 4, 9, part=1, sender=0, part_size=7)


def _lossy_headers() -> list[bytes]:
    sealer = ControlSealer(_LOSSY_KEY, _LOSSY_HEADER)
    return [
        sealer.seal([LOSSY_VERSION, b"g" * 8, 1, 0, 1.5, 14, 40000, [], 77]),
        sealer.seal([LOSSY_VERSION, b"g" * 8, 1, 0, 0.0, 14, 40000, [3, 2, 0.01], -1]),
    ]


def _lossy_header(data: bytes) -> None:
    """The same for a header's datagram copy, whose message is then checked
    as the stream's header is (``parse_header``)."""
    opened = ControlOpener(_LOSSY_KEY, _LOSSY_HEADER).open(data)
    if opened is None:
        raise ProtocolError("dropped")
    if data not in _lossy_headers():
        raise AssertionError("an altered header copy was accepted")
    parse_header(opened)


def _lossy_mask(data: bytes) -> None:
    PieceMask.from_bytes(data[1:], data[0] if data else 0)


# training state and its transfer

_TEMPLATE = {
    "model": {"w": torch.ones(3, 2), "b": torch.zeros(2, dtype=torch.float16)},
    "opt": {"step": 3, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
    "mask": torch.tensor([True, False]),
}


def _state_headers() -> list[bytes]:
    """``u16 header size | header frame | tensor bytes``, and a refusal."""
    flat = flatten_state(_TEMPLATE)
    header, blobs = encode_header(5, {"epoch": 1}, flat)
    refusal = encode_refusal("busy", "come back later")
    return [
        len(header).to_bytes(2, "little") + header + b"".join(blobs),
        len(refusal).to_bytes(2, "little") + refusal,
    ]


def _transfer(data: bytes) -> None:
    """The newcomer's side: the header frame, then the tensor bytes in 5-byte frames."""
    size = int.from_bytes(data[:2], "little")
    header = decode_header(data[2 : 2 + size], max_header_bytes=4096, max_bytes=4096)
    assembler = StateAssembler(header.specs)
    rest = data[2 + size :]
    while rest and not assembler.done:
        assembler.feed(rest[:5])
        rest = rest[5:]
    state = unflatten_state(header.skeleton, assembler.tensors())
    check_template(state, _TEMPLATE)


def _state(data: bytes) -> None:
    skeleton, specs = parse_state_header(unpack(data), max_total_bytes=4096)
    tensors = [tensor_from_bytes(spec, bytes(spec.nbytes)) for spec in specs]
    unflatten_state(skeleton, tensors)


def _state_samples() -> list[bytes]:
    from swarm._state import state_header

    return [pack(state_header(flatten_state(_TEMPLATE)))]


# Matchmaking members and candidates (a relayed one names its relay), and a
# relay's answer to a registration


def _members() -> list[GroupMember]:
    relayed = ("10.77.0.1", 7000)
    return [
        GroupMember(ALICE.peer_id, "10.0.0.1", 7000),
        GroupMember(ALICE.peer_id, "10.0.0.1", 7000, 2.0, MemberMode.NODE, 1e6, 2e6),
        GroupMember(ALICE.peer_id, "10.78.1.2", 7000, 1.0, MemberMode.NODE, relay=relayed),
        GroupMember(ALICE.peer_id, "10.78.1.2", 7000, 1.0, MemberMode.NODE, 1e6, 2e6, relayed),
    ]


def _registered(data: bytes) -> None:
    decode_registered(unpack(data), BOB.peer_id)


TARGETS = [
    Target(
        "dht-record",
        lambda: [pack(r.to_wire()) for r in _records()],
        _decode_record,
        (ProtocolError, RecordRejectedError),
    ),
    Target("dht-datagram", _datagrams, messages.decode),
    Target("dht-request", lambda: [pack(b) for b in _BODIES], _answer_request),
    Target("dht-reply", _replies, _decode_reply),
    _frame_target(True),
    _frame_target(False),
    _handshake_target(0),
    _handshake_target(1),
    _handshake_target(2),
    Target("codec-blob", _blobs, decode),
    Target(
        "allreduce-header",
        lambda: [pack([PROTOCOL_VERSION, b"g" * 8, 1, 0, 1.0, 16, 100])],
        _sender_header,
    ),
    Target("allreduce-chunk", lambda: [_CHUNK_INDEX.pack(0) + b for b in _blobs()], _chunk),
    Target("allreduce-result", _results, _result),
    Target("state-transfer", _state_headers, _transfer, (ProtocolError, DonorBusy, DonorRefused)),
    Target("state", _state_samples, _state),
    Target("lossy-datagram", _lossy_datagrams, _lossy_datagram),
    Target("lossy-control", _lossy_controls, _lossy_control),
    Target("lossy-header-copy", _lossy_headers, _lossy_header),
    Target("lossy-mask", lambda: [bytes([11, 0xFF, 0x07]), bytes([8, 0x81])], _lossy_mask),
    Target(
        "matchmaking-member",
        lambda: [pack(member_to_wire(m)) for m in _members()],
        lambda data: member_from_wire(unpack(data)),
    ),
    Target(
        "matchmaking-candidate",
        lambda: [pack(Candidate(m, NOW).to_wire()) for m in _members()],
        lambda data: Candidate.from_wire(unpack(data)),
    ),
    Target(
        "punch-offer",
        lambda: [pack(encode_offer("10.77.0.2", 40000))],
        lambda data: decode_offer(unpack(data)),
    ),
    Target(
        "relay-registered",
        lambda: [pack(["registered", 7000]), pack(["registered", 7000, 15.0])],
        _registered,
        (ProtocolError, PeerUnreachableError),
    ),
]
IDS = [t.name for t in TARGETS]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_typed_errors(target: Target, data: bytes) -> None:
    with contextlib.suppress(target.errors):
        target.decode(data)


def test_every_sample_decodes() -> None:
    """The starting points are valid, so mutations start from the real thing."""
    for target in TARGETS:
        for sample in target.samples():
            if target.name == "state-transfer" and sample == _state_headers()[1]:
                with pytest.raises(DonorBusy):
                    target.decode(sample)
                continue
            target.decode(sample)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
@given(data=st.binary(max_size=400))
@FUZZ
def test_random_bytes(target: Target, data: bytes) -> None:
    _only_typed_errors(target, data)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
@given(data=st.data())
@FUZZ
def test_truncated_encodings(target: Target, data: st.DataObject) -> None:
    sample = data.draw(st.sampled_from(target.samples()))
    cut = data.draw(st.integers(0, len(sample) - 1))
    _only_typed_errors(target, sample[:cut])


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
@given(data=st.data())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutated_encodings(target: Target, data: st.DataObject) -> None:
    sample = data.draw(st.sampled_from(target.samples()))
    mutations = data.draw(st.lists(_mutation, min_size=1, max_size=4))
    _only_typed_errors(target, mutate(sample, mutations))


# -- structure-aware: well-formed msgpack with the wrong shapes and values ------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
)
_documents = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=7) | st.dictionaries(_scalars, inner, max_size=3),
    max_leaves=20,
)


@given(
    st.sampled_from(["ping", "find_node", "find_value", "store", "nope"]) | _scalars,
    st.lists(_documents, max_size=3) | _documents,
)
@FUZZ
def test_dht_request_handlers_with_any_arguments(method: object, args: object) -> None:
    _answer_request(pack([method, args]))


@given(
    st.lists(_documents | st.integers(-2, 3) | st.floats(-1, 2), min_size=6, max_size=8),
    st.booleans(),
)
@FUZZ
def test_allreduce_header_with_any_fields(fields: list[object], our_version: bool) -> None:
    if our_version:  # get past the version check to the other fields
        fields[0] = PROTOCOL_VERSION
    with contextlib.suppress(ProtocolError):
        parse_sender_header(fields, _GROUP, _PARTITION, ALICE.peer_id)


@given(
    st.lists(_documents | st.integers(-2, 3) | st.floats(-1, 2), min_size=8, max_size=10),
    st.booleans(),
)
@FUZZ
def test_lossy_header_with_any_fields(fields: list[object], our_version: bool) -> None:
    """A lossy header (its stream's copy or its datagram copy's message)
    with any fields is parsed or refused with ``ProtocolError``."""
    if our_version:  # get past the version check to the other fields
        fields[0] = LOSSY_VERSION
    with contextlib.suppress(ProtocolError):
        parse_header(fields)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "float16", "bool", "int64", "complex128"]),
            st.lists(st.integers(0, 4) | st.sampled_from([2**31, 2**40, 2**62]), max_size=4),
        ),
        max_size=3,
    )
)
@example([("float32", [2**62, 2**62, 0])])  # strides overflow: torch raised RuntimeError
@FUZZ
def test_state_specs_with_any_shapes(specs: list[tuple[str, list[int]]]) -> None:
    header = {"skeleton": ["l", *(["T", i] for i in range(len(specs)))], "tensors": specs}
    _only_typed_errors(TARGETS[-1], pack(header))


# -- real sockets: the peer keeps serving others after a fuzzed burst -------------------

MALLORY = Identity.from_seed(b"m" * 32)
BURST = 600


def _fuzzed_datagrams(rng: random.Random) -> list[bytes]:
    """Random bytes, mutated signed datagrams, and signed datagrams with mutated
    bodies (which pass the signature and reach the request handlers)."""
    datagrams = []
    valid = _datagrams()
    bodies = [pack(b) for b in _BODIES]
    for i in range(BURST):
        ops = random_mutations(rng)
        if i % 3 == 0:
            datagrams.append(rng.randbytes(rng.randrange(0, 300)))
        elif i % 3 == 1:
            datagrams.append(mutate(rng.choice(valid), ops))
        else:
            try:
                body = unpack(mutate(rng.choice(bodies), ops))
            except ProtocolError:
                body = [rng.choice(["store", "find_value", "ping"]), body_noise(rng)]
            datagrams.append(
                messages.encode(MALLORY, messages.Kind.REQUEST, messages.new_msg_id(), body)
            )
    return datagrams


def random_mutations(rng: random.Random) -> list[tuple[Any, ...]]:
    """What ``_mutation`` draws, drawn from a seeded ``random.Random``."""
    ops: list[tuple[Any, ...]] = []
    for _ in range(rng.randrange(1, 4)):
        op, pos = rng.choice(["flip", "set", "insert", "delete", "cut"]), rng.randrange(2**16)
        arg = {
            "flip": (rng.randrange(8),),
            "set": (rng.randrange(256),),
            "insert": (rng.randbytes(rng.randrange(1, 8)),),
            "delete": (rng.randrange(1, 8),),
            "cut": (),
        }[op]
        ops.append((op, pos, *arg))
    return ops


def body_noise(rng: random.Random) -> list[Any]:
    return [rng.randbytes(rng.randrange(30)), None, rng.random(), rng.randrange(-5, 5)][
        : rng.randrange(5)
    ]


async def test_dht_node_serves_others_after_a_burst_of_fuzzed_datagrams() -> None:
    clock = ManualClock(NOW)
    config = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=5.0)
    async with open_pair(config, clock) as (target, honest):
        await send_datagrams(target, _fuzzed_datagrams(random.Random(11)))
        assert target.rate_limited_datagrams == 0  # every datagram reached the decoder
        assert target.dropped_datagrams >= BURST // 2
        assert await honest.store("after", [1, 2], NOW + 60)
        assert await honest.get("after") == DHTValue([1, 2], NOW + 60)
        (record,) = target._server.storage.records(
            make_record("after", [1, 2], NOW + 60, limits=LIMITS).key_id
        )
        assert record.decoded_value() == [1, 2]


async def _fuzzed_connection(port: int, rng: random.Random, kind: int) -> None:
    """One TCP connection to the listener: raw junk (0), a mutated handshake (1),
    or a real handshake followed by fuzzed but authentic frames (2)."""
    with trio.move_on_after(1):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                if kind == 0:
                    await stream.send_all(rng.randbytes(rng.randrange(1, 2000)))
                    return
                dialer = Handshake(MALLORY, initiator=True, expected_peer=BOB.peer_id)
                out = dialer.start()
                if kind == 1:
                    out = mutate(out, random_mutations(rng))
                await stream.send_all(out)
                while not dialer.complete:
                    data = await stream.receive_some(4096)
                    if not data:
                        return
                    out = dialer.receive_data(data)
                    if kind == 1 and out:
                        out = mutate(out, random_mutations(rng))
                    await stream.send_all(out)
                result = dialer.result
                encoder = FrameEncoder(
                    result.send_key, encrypt=result.encrypt, max_frame_size=1 << 20
                )
                for n in range(rng.randrange(1, 6)):
                    # mostly a stream to a real handler first, then anything
                    opening = n == 0 and rng.random() < 0.8
                    frame_kind = FrameKind.OPEN if opening else rng.choice(list(FrameKind))
                    payload = (
                        pack(["reply"])
                        if opening
                        else rng.choice(
                            [
                                pack(["reply"]),
                                pack(["nope"]),
                                pack({"x": 1}),
                                rng.randbytes(40),
                                b"",
                            ]
                        )
                    )
                    if not opening and rng.random() < 0.5:
                        payload = mutate(payload, random_mutations(rng))
                    for block in encoder.encode(frame_kind, payload):
                        await stream.send_all(bytes(block))
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
                return


async def test_listener_serves_others_after_a_burst_of_fuzzed_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def reply(stream: Stream) -> None:
        await stream.send(await stream.receive())

    caplog.set_level(logging.DEBUG, logger="swarm")
    async with open_connections(BOB) as listener, open_connections(ALICE) as honest:
        listener.set_handler("reply", reply)
        rng = random.Random(5)
        async with trio.open_nursery() as nursery:  # a burst: all at once
            for i in range(90):
                nursery.start_soon(
                    _fuzzed_connection, listener.port, random.Random(rng.randbytes(8)), i % 3
                )
        for _ in range(5000):  # bounded: until the listener has dealt with all of them
            if listener._inbound == 0:
                break
            await trio.sleep(0.001)
        answer = await honest.call(
            BOB.peer_id, ("127.0.0.1", listener.port), "reply", {"still": "here"}, timeout=10
        )
        assert answer == {"still": "here"}
    # the bad input was refused as the remote's fault: nothing crashed in our code
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("inbound connection failed" in r.getMessage() for r in caplog.records)
