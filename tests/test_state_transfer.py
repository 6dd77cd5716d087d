"""State transfer to newcomers, over real peers on 127.0.0.1 in one process.

Faults are injected by composition (the donor's ``before_chunk`` hook blocks,
raises, or signals the test to kill the donor's peer), and every wait is on an
event, so each outcome asserted here is determined. The invariant checked
everywhere: a newcomer that returns a state returns exactly the state of a
healthy donor, bit for bit.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from averaging._state_transfer import (
    UNCHECKED,
    DonorBusy,
    DonorInfo,
    DonorRefused,
    LoadedState,
    StateAssembler,
    StateTransferConfig,
    check_template,
    decode_header,
    encode_header,
    iter_chunks,
    load_state_from_peers,
    order_donors,
    parse_donors,
    serve_state,
    state_key,
    state_stream,
)
from dht import DHTConfig, DHTValue, owner_marker
from swarm import ConfigError, Identity, ProtocolError
from swarm._connections import Stream
from swarm._peer import AsyncPeer, PeerConfig, open_peer
from swarm._state import TensorSpec, flatten_state, unflatten_state
from swarm._wire import pack

PREFIX = "run"
# Small chunks, so that a small state still travels in many chunks.
CONFIG = StateTransferConfig(chunk_size=1024, chunk_timeout=5.0, retry_backoff=0.02)
DHT = DHTConfig(rpc_timeout=0.3)
Hook = Callable[[int, int], Awaitable[None]]


def make_state(seed: int = 0, width: int = 48) -> dict[str, Any]:
    """A model and an Adam optimizer after two steps: every kind of state tensor."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, width)).pow(2).sum().backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def assert_identical(got: Any, expected: Any, path: str = "state") -> None:
    """Same structure, same scalars, tensors of the same dtype, shape and bits."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        bits = got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        assert torch.equal(*bits), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), path
        for key in expected:
            assert_identical(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert type(got) is type(expected) and len(got) == len(expected), path
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_identical(a, b, f"{path}[{i}]")
    else:
        assert got == expected and type(got) is type(expected), path


def identity(seed: int) -> Identity:
    return Identity.from_seed(bytes([seed]) * 32)


@dataclass
class Donor:
    peer: AsyncPeer
    scope: trio.CancelScope  # cancel to kill the whole peer


@asynccontextmanager
async def open_swarm() -> AsyncIterator[tuple[trio.Nursery, AsyncPeer]]:
    """A nursery for donors and newcomers, and a DHT-only bootstrap peer that outlives them."""
    async with (
        open_peer(identity(1), PeerConfig(dht=DHT)) as bootstrap,
        trio.open_nursery() as nursery,
    ):
        yield nursery, bootstrap
        nursery.cancel_scope.cancel()


async def _run_donor(
    bootstrap: AsyncPeer,
    seed: int,
    get_state: Callable[[], tuple[dict[str, Any], Any]],
    kwargs: dict[str, Any],
    client_mode: bool,
    *,
    task_status: trio.TaskStatus[Donor],
) -> None:
    config = PeerConfig(initial_peers=(bootstrap.address,), dht=DHT, client_mode=client_mode)
    with trio.CancelScope() as scope:
        async with open_peer(identity(seed), config) as peer, trio.open_nursery() as nursery:
            await nursery.start(functools.partial(serve_state, peer, PREFIX, get_state, **kwargs))
            task_status.started(Donor(peer, scope))


async def start_donor(
    nursery: trio.Nursery,
    bootstrap: AsyncPeer,
    seed: int,
    state: Any,
    metadata: dict[str, Any],
    *,
    client_mode: bool = False,
    **kwargs: Any,
) -> Donor:
    kwargs.setdefault("config", CONFIG)
    donor: Donor = await nursery.start(
        _run_donor, bootstrap, seed, lambda: (metadata, state), kwargs, client_mode
    )
    return donor


@asynccontextmanager
async def open_newcomers(bootstrap: AsyncPeer, *seeds: int) -> AsyncIterator[list[AsyncPeer]]:
    config = PeerConfig(initial_peers=(bootstrap.address,), dht=DHT)
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_peer(identity(s), config)) for s in seeds]


async def load(peer: AsyncPeer, **kwargs: Any) -> LoadedState | None:
    kwargs.setdefault("config", CONFIG)
    kwargs.setdefault("timeout", 4.0)
    return await load_state_from_peers(peer, PREFIX, **kwargs)


# -- end to end -------------------------------------------------------------------


async def test_newcomer_downloads_the_exact_state() -> None:
    state = make_state()
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            donor = await start_donor(nursery, bootstrap, 2, state, {"epoch": 7, "lr": 0.5})
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                loaded = await load(newcomer, template=state)
    assert loaded is not None
    assert loaded.donor == donor.peer.peer_id
    assert loaded.version == 7  # the default version is the metadata's epoch
    assert loaded.metadata == {"epoch": 7, "lr": 0.5}
    assert_identical(loaded.state, state)
    # The result is what a training loop loads.
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Linear(48, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(loaded.state["model"])
    optimizer.load_state_dict(loaded.state["optimizer"])
    assert_identical(model.state_dict(), state["model"])


async def test_newest_donor_is_preferred_and_min_version_skips_old_ones() -> None:
    old, new = make_state(1), make_state(2)
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            await start_donor(nursery, bootstrap, 2, old, {"epoch": 3})
            newest = await start_donor(
                nursery, bootstrap, 3, new, {"epoch": 5}, get_version=lambda: 50
            )
            await start_donor(nursery, bootstrap, 4, old, {"epoch": 4})
            async with open_newcomers(bootstrap, 10, 11, 12) as newcomers:
                results = [await load(n) for n in newcomers]
                too_new = await load(newcomers[0], min_version=51)
    for loaded in results:
        assert loaded is not None and loaded.donor == newest.peer.peer_id
        assert loaded.metadata == {"epoch": 5} and loaded.version == 50
        assert_identical(loaded.state, new)
    assert too_new is None


async def test_min_version_is_checked_against_the_state_not_the_stale_announcement() -> None:
    # Regression (chaos run): a donor re-announces only every announce_interval,
    # so a peer that fell behind saw every announcement below the swarm's epoch,
    # skipped every donor ("no donor is announced") and never caught up.
    state = make_state()
    version = [1]
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            donor = await start_donor(
                nursery, bootstrap, 2, state, {"epoch": 1}, get_version=lambda: version[0]
            )
            version[0] = 5  # the donor stepped on; its announcement still says 1
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                loaded = await load(newcomer, min_version=3)
                version[0] = 2
                too_old = await load(newcomer, min_version=3)
    assert loaded is not None and loaded.donor == donor.peer.peer_id and loaded.version == 5
    assert too_old is None


async def test_busy_donor_sends_the_newcomer_elsewhere() -> None:
    state = make_state()
    uploading, release = trio.Event(), trio.Event()

    async def hold_first_upload(upload: int, chunk: int) -> None:
        if upload == 0 and chunk == 1:
            uploading.set()
            await release.wait()

    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            one_slot = StateTransferConfig(chunk_size=1024, max_uploads=1)
            newest = await start_donor(
                nursery,
                bootstrap,
                2,
                state,
                {"epoch": 5},
                config=one_slot,
                before_chunk=hold_first_upload,
            )
            older = await start_donor(nursery, bootstrap, 3, state, {"epoch": 4})
            async with open_newcomers(bootstrap, 10, 11) as (first, second):
                results: dict[str, LoadedState | None] = {}

                async def load_first() -> None:
                    results["first"] = await load(first)

                async with trio.open_nursery() as loads:
                    loads.start_soon(load_first)
                    await uploading.wait()  # the newest donor's only slot is taken
                    results["second"] = await load(second)
                    release.set()
    assert results["second"] is not None and results["second"].donor == older.peer.peer_id
    assert results["first"] is not None and results["first"].donor == newest.peer.peer_id
    for loaded in results.values():
        assert loaded is not None
        assert_identical(loaded.state, state)


async def test_three_newcomers_load_at_once_while_a_donor_is_killed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Donors A and B hold the same state. A stops after 2 chunks of its first
    upload and the test kills its peer there; B holds each upload after 1
    chunk until A is dead, so with two slots B cannot serve all three and A
    must get one of them mid-transfer. Every newcomer ends with the state."""
    caplog.set_level(logging.INFO)
    state = make_state(width=64)  # about 34 chunks of 1 KiB
    metadata = {"epoch": 12}
    a_mid_transfer, a_dead = trio.Event(), trio.Event()

    async def a_dies(upload: int, chunk: int) -> None:
        if chunk == 2:
            a_mid_transfer.set()
            await trio.sleep_forever()  # until the test kills the peer

    async def b_waits(upload: int, chunk: int) -> None:
        if chunk == 1:
            await a_dead.wait()

    with trio.fail_after(10):
        async with open_swarm() as (nursery, bootstrap):
            a = await start_donor(nursery, bootstrap, 2, state, metadata, before_chunk=a_dies)
            b = await start_donor(nursery, bootstrap, 3, state, metadata, before_chunk=b_waits)
            async with open_newcomers(bootstrap, 10, 11, 12) as newcomers:
                results: list[LoadedState | None] = [None] * 3

                async def run(i: int) -> None:
                    results[i] = await load(newcomers[i], timeout=8.0, template=state)

                async with trio.open_nursery() as loads:
                    for i in range(3):
                        loads.start_soon(run, i)
                    await a_mid_transfer.wait()
                    a.scope.cancel()  # kill A's whole peer mid-transfer
                    a_dead.set()
    assert failures_logged(caplog, a.peer)  # A was dropped mid-transfer, not skipped
    for loaded in results:
        assert loaded is not None
        assert loaded.donor == b.peer.peer_id
        assert loaded.metadata == metadata
        assert_identical(loaded.state, state)


def failures_logged(caplog: pytest.LogCaptureFixture, donor: AsyncPeer) -> list[str]:
    """The reasons newcomers logged for dropping ``donor`` (the test must have
    called ``caplog.set_level(logging.INFO)``)."""
    prefix = f"state from {donor.peer_id.short()} failed: "
    return [
        r.getMessage().removeprefix(prefix)
        for r in caplog.records
        if r.getMessage().startswith(prefix)
    ]


@pytest.mark.parametrize(
    ("corruption", "reason"),
    [
        ("nan", "holds NaN or Inf"),
        ("shape", r"\['1.weight'\]: expected torch.float32 \(3, 48\), got torch.float32 \(4, 48\)"),
        ("dtype", r"\['1.weight'\]: expected torch.float32 \(3, 48\), got torch.float64"),
        ("header", "exceeds the limit of 10000"),
        ("raises", "reset the stream: RuntimeError: injected fault"),
    ],
)
async def test_corrupted_donor_is_rejected_and_the_next_one_used(
    corruption: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    good = make_state(1)
    bad: Any = make_state(1)
    metadata: dict[str, Any] = {"epoch": 9}
    hook: Hook | None = None
    if corruption == "nan":
        bad["model"]["1.bias"] = bad["model"]["1.bias"].clone()
        bad["model"]["1.bias"][1] = float("nan")
    elif corruption == "shape":
        bad["model"]["1.weight"] = torch.zeros(4, 48)
    elif corruption == "dtype":
        bad["model"]["1.weight"] = bad["model"]["1.weight"].double()
    elif corruption == "header":
        metadata["junk"] = "x" * 20_000  # beyond the newcomer's max_header_bytes
    elif corruption == "raises":

        async def fail(upload: int, chunk: int) -> None:
            if chunk == 3:
                raise RuntimeError("injected fault")

        hook = fail
    config = StateTransferConfig(chunk_size=1024, max_header_bytes=10_000)
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            corrupt = await start_donor(nursery, bootstrap, 2, bad, metadata, before_chunk=hook)
            healthy = await start_donor(nursery, bootstrap, 3, good, {"epoch": 8})
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                loaded = await load(newcomer, template=good, config=config)
    [logged] = failures_logged(caplog, corrupt.peer)
    assert re.search(reason, logged), logged
    assert loaded is not None and loaded.donor == healthy.peer.peer_id
    assert loaded.metadata == {"epoch": 8}
    assert_identical(loaded.state, good)


async def test_state_beyond_max_bytes_is_refused_by_the_donor() -> None:
    state = make_state()
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            await start_donor(nursery, bootstrap, 2, state, {"epoch": 1})
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                assert await load(newcomer, max_bytes=1000) is None


async def test_stopping_a_donor_resets_its_uploads_and_refuses_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelling ``serve_state`` (the peer lives on) ends its running uploads."""
    caplog.set_level(logging.INFO)
    state = make_state()
    uploading = trio.Event()

    async def hold(upload: int, chunk: int) -> None:
        if chunk == 1:
            uploading.set()
            await trio.sleep_forever()

    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            healthy = await start_donor(nursery, bootstrap, 3, state, {"epoch": 1})
            async with open_newcomers(bootstrap, 2, 10, 11) as (stopping, first, second):
                serve = functools.partial(
                    serve_state,
                    stopping,
                    PREFIX,
                    lambda: ({"epoch": 2}, state),
                    config=CONFIG,
                    before_chunk=hold,
                )
                results: list[LoadedState | None] = []

                async def load_first() -> None:
                    results.append(await load(first))

                async with trio.open_nursery() as loads, trio.open_nursery() as serving:
                    await serving.start(serve)
                    loads.start_soon(load_first)
                    await uploading.wait()
                    serving.cancel_scope.cancel()
                # Its announcement outlives it (until the TTL): it refuses.
                results.append(await load(second))
    assert [r.donor if r else None for r in results] == [healthy.peer.peer_id] * 2
    assert failures_logged(caplog, stopping) == [
        f"StreamResetError: {stopping.peer_id.short()} reset the stream: ClosedError:"
        " this peer stopped serving its state during the upload",
        "DonorRefused: this peer no longer serves its state",
    ]


async def test_no_donor_gives_none_at_once() -> None:
    async with open_swarm() as (_, bootstrap), open_newcomers(bootstrap, 10) as (newcomer,):
        with trio.fail_after(2):
            assert await load(newcomer, timeout=30.0) is None


async def test_client_mode_peer_does_not_offer_its_state() -> None:
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            await start_donor(nursery, bootstrap, 2, make_state(), {"epoch": 1}, client_mode=True)
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                assert await load(newcomer) is None


async def _announce_raw(peer: AsyncPeer, handler: Callable[[Stream], Awaitable[None]]) -> None:
    peer.connections.set_handler(state_stream(PREFIX), handler)
    host, port = peer.endpoint
    await peer.dht.store(
        state_key(PREFIX),
        [host, port, 100],  # newer than any honest donor: tried first
        peer.dht.now() + 30,
        subkey=owner_marker(peer.peer_id),
    )


def _raw_upload(state: Any, metadata: dict[str, Any]) -> tuple[bytes, bytes]:
    header, blobs = encode_header(100, metadata, flatten_state(state))
    return header, b"".join(blobs)


@pytest.mark.parametrize(
    ("misbehaviour", "reason"),
    [
        ("stalls", "DeadlineError: .* sent nothing for 0.5 s"),
        ("too_much", "ProtocolError: state data: a chunk of"),
        ("message_header", "ProtocolError: state header: expected a raw frame"),
        ("early_eof", "EndOfStreamError: .* ended the stream"),
    ],
)
async def test_misbehaving_donor_is_dropped(
    misbehaviour: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A donor that speaks the protocol wrongly (its handler is written by hand)."""
    caplog.set_level(logging.INFO)
    state = make_state()
    header, data = _raw_upload(state, {"epoch": 1})

    async def handler(stream: Stream) -> None:
        await stream.receive()
        if misbehaviour == "message_header":
            await stream.send(["state", 100, {}, {"skeleton": None, "tensors": []}])
            return
        await stream.send_bytes(header)
        if misbehaviour == "stalls":
            await stream.send_bytes(data[:1024])
            await trio.sleep_forever()
        elif misbehaviour == "too_much":
            await stream.send_bytes(data + b"\0")
        elif misbehaviour == "early_eof":
            await stream.send_bytes(data[:-1])

    config = StateTransferConfig(chunk_size=1024, chunk_timeout=0.5)
    with trio.fail_after(5):
        async with open_swarm() as (nursery, bootstrap):
            healthy = await start_donor(nursery, bootstrap, 3, state, {"epoch": 8})
            async with open_newcomers(bootstrap, 2, 10) as (evil, newcomer):
                await _announce_raw(evil, handler)
                loaded = await load(newcomer, config=config)
    [logged] = failures_logged(caplog, evil)
    assert re.search(reason, logged), logged
    assert loaded is not None and loaded.donor == healthy.peer.peer_id
    assert_identical(loaded.state, state)


# -- pure code ----------------------------------------------------------------------


def test_chunks_reassemble_at_every_split() -> None:
    state = {
        "a": torch.arange(10, dtype=torch.float32),
        "empty": torch.zeros(0, 3),
        "b": torch.tensor(True),
        "c": (torch.arange(7, dtype=torch.int16), torch.tensor(2.5, dtype=torch.float64)),
    }
    header, blobs = encode_header(3, {"epoch": 3}, flatten_state(state))
    parsed = decode_header(header, max_header_bytes=10_000, max_bytes=10_000)
    total = sum(len(b) for b in blobs)
    for chunk_size in range(1, total + 2):
        assembler = StateAssembler(parsed.specs)
        for chunk in iter_chunks(blobs, chunk_size):
            assert 0 < len(chunk) <= chunk_size
            assembler.feed(bytes(chunk))
        assert assembler.done
        assert_identical(unflatten_state(parsed.skeleton, assembler.tensors()), state)


def test_assembler_refuses_wrong_chunks() -> None:
    specs = [TensorSpec(torch.float32, (2,))]
    with pytest.raises(ProtocolError):
        StateAssembler(specs).feed(b"")
    with pytest.raises(ProtocolError):
        StateAssembler(specs).feed(b"\0" * 9)
    with pytest.raises(ProtocolError):
        StateAssembler(specs).feed("not bytes")
    with pytest.raises(ProtocolError, match="missing"):
        assembler = StateAssembler(specs)
        assembler.feed(b"\0" * 4)
        assembler.tensors()


def test_header_limits_and_refusals() -> None:
    state = {"w": torch.zeros(100)}
    header, _ = encode_header(1, {"epoch": 1}, flatten_state(state))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(header, max_header_bytes=len(header) - 1, max_bytes=10_000)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(header, max_header_bytes=10_000, max_bytes=399)
    with pytest.raises(DonorBusy, match="2 uploads"):
        decode_header(pack(["busy", "2 uploads"]), max_header_bytes=100, max_bytes=0)
    with pytest.raises(DonorRefused):
        decode_header(pack(["refused", "no"]), max_header_bytes=100, max_bytes=0)


def test_template_check() -> None:
    state = make_state()
    check_template(state, state)
    check_template(state, {"model": state["model"], "optimizer": UNCHECKED})
    with pytest.raises(ProtocolError, match="keys differ"):
        check_template(state, {"model": state["model"]})
    wrong = dict(state["model"], **{"0.bias": torch.zeros(3)})
    with pytest.raises(ProtocolError, match=r"0\.bias"):
        check_template({"model": wrong, "optimizer": state["optimizer"]}, state)
    with pytest.raises(ProtocolError, match="expected a tensor"):
        check_template({"x": 1.0}, {"x": torch.zeros(1)})
    with pytest.raises(ProtocolError, match="expected a scalar"):
        check_template({"x": torch.zeros(1)}, {"x": 1.0})
    check_template({"lr": None}, {"lr": 0.1})  # scalar values may differ


def test_donors_are_parsed_leniently_and_ordered_newest_first() -> None:
    ids = [identity(s).peer_id for s in (2, 3, 4, 5)]
    entries = {
        owner_marker(ids[0]): DHTValue(["127.0.0.1", 1000, 3], 0.0),
        owner_marker(ids[1]): DHTValue(["127.0.0.1", 1001, 5], 0.0),
        owner_marker(ids[2]): DHTValue(["127.0.0.1", 1002, 5], 0.0),
        owner_marker(ids[3]): DHTValue(["127.0.0.1", 99999, 5], 0.0),  # bad port
        "plain": DHTValue(["127.0.0.1", 1003, 9], 0.0),  # not an owner's sub-key
        f"x{owner_marker(ids[3])}": DHTValue(["127.0.0.1", 1004, 9], 0.0),
    }
    donors = parse_donors(entries, exclude=ids[0])
    assert {d.peer_id for d in donors} == {ids[1], ids[2]}
    assert parse_donors(None) == [] and parse_donors("junk") == []
    orders = set()
    for seed in range(20):
        ordered = order_donors([*donors, DonorInfo(ids[0], "h", 1, 3)], random.Random(seed))
        assert [d.version for d in ordered] == [5, 5, 3]
        orders.add(tuple(d.peer_id for d in ordered))
    assert len(orders) == 2  # equally new donors come in both orders


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="announce_ttl"):
        StateTransferConfig(announce_interval=10, announce_ttl=5)
    with pytest.raises(ConfigError, match="max_uploads"):
        StateTransferConfig(max_uploads=0)
    with pytest.raises(ConfigError, match="chunk_size"):
        StateTransferConfig(chunk_size=64 * 2**20)
    with pytest.raises(ConfigError, match="chunk_timeout"):
        StateTransferConfig(chunk_timeout=float("nan"))


_msgpack = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=20,
)
_header_like = st.builds(
    lambda version, metadata, skeleton, specs: [
        "state",
        version,
        metadata,
        {"skeleton": skeleton, "tensors": specs},
    ],
    st.integers(-(2**63), 2**64 - 1),
    _msgpack,
    _msgpack,
    st.lists(
        st.lists(st.sampled_from(["float32", "int8", "bool", "nope"]) | _msgpack, max_size=2)
        | st.tuples(
            st.sampled_from(["float32", "int64", "bool"]),
            st.lists(st.integers(-2, 5) | st.just(2**62), max_size=3),
        ).map(list),
        max_size=4,
    ),
)


@given(st.one_of(st.binary(max_size=200), _msgpack.map(pack), _header_like.map(pack)))
@example(pack(["state", 1, {}, {"skeleton": None, "tensors": [["float32", [0, 2**62, 2**62]]]}]))
@settings(max_examples=200, deadline=None)
def test_header_decoder_raises_only_protocol_errors(data: bytes) -> None:
    """Any bytes give a header, a refusal or ``ProtocolError``; a header's
    skeleton and specs then rebuild a state or raise ``ProtocolError``."""
    try:
        header = decode_header(data, max_header_bytes=4096, max_bytes=4096)
    except (ProtocolError, DonorBusy, DonorRefused):
        return
    assembler = StateAssembler(header.specs)
    if assembler.total:
        assembler.feed(b"\x01" * assembler.total)
    try:
        state = unflatten_state(header.skeleton, assembler.tensors())
    except ProtocolError:
        return
    assert flatten_state(state).tensors == [] or assembler.total > 0


async def test_a_donor_whose_state_lock_is_held_is_busy_until_it_is_released() -> None:
    # A training thread holds the lock while it steps: the donor never waits
    # for it (the trio thread stays free) and never sends a half-stepped state.
    state = make_state()
    lock = threading.Lock()
    lock.acquire()
    with trio.fail_after(10):
        async with open_swarm() as (nursery, bootstrap):
            await start_donor(nursery, bootstrap, 2, state, {"epoch": 1}, state_lock=lock)
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                assert await load(newcomer, timeout=0.5) is None  # busy all along
                trio.lowlevel.current_trio_token().run_sync_soon(lock.release)
                loaded = await load(newcomer, timeout=4.0)
    assert loaded is not None
    assert_identical(loaded.state, state)
    assert lock.acquire(blocking=False)  # the upload let it go


@pytest.mark.parametrize("with_lock", [True, False])
async def test_a_donor_copies_its_state_off_the_event_loop_when_it_has_a_state_lock(
    with_lock: bool,
) -> None:
    # With a lock, the owner changes its state only under it, so the copy of a
    # model-sized state can run in a worker thread holding it and never stall
    # the event loop; without one, trio tasks may change the state, so the
    # snapshot is taken in trio, before the upload's first await.
    state = make_state()
    lock = threading.Lock()
    calls: list[tuple[int, bool]] = []

    def get_state() -> tuple[dict[str, Any], Any]:
        calls.append((threading.get_ident(), lock.locked()))
        return {"epoch": 1}, state

    kwargs: dict[str, Any] = {"config": CONFIG, "get_version": lambda: 1}
    if with_lock:
        kwargs["state_lock"] = lock
    with trio.fail_after(10):
        async with open_swarm() as (nursery, bootstrap):
            await nursery.start(_run_donor, bootstrap, 2, get_state, kwargs, False)
            async with open_newcomers(bootstrap, 10) as (newcomer,):
                loaded = await load(newcomer, timeout=4.0)
    assert loaded is not None
    assert_identical(loaded.state, state)
    [(thread, held)] = calls  # one upload, one snapshot
    assert (thread != threading.get_ident()) is with_lock
    assert held is with_lock
    assert lock.acquire(blocking=False)  # let go after the copy
