"""The butterfly all-reduce over real sockets on 127.0.0.1, several peers in one process.

Faults come from a ``FaultPlan`` and are counted in chunks, and slow peers are
slower than any deadline by orders of magnitude, so every outcome asserted here
is determined: no test waits on a sleep to win a race. The invariant checked
everywhere: each chunk of a healthy member's result is the exact weighted mean
over the members recorded as its contributors, those are the members the fault
plan says delivered it, and healthy members finish by the round deadline.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pytest
import torch
import trio

from averaging import _allreduce
from averaging._allreduce import (
    ALLREDUCE_STREAM,
    PROTOCOL_VERSION,
    RESULT_FLAG,
    AllReduceConfig,
    AllReduceResult,
    _registries,
    all_reduce,
    listen_to_sender_weights,
    sender_weights,
    serve_allreduce,
)
from averaging._codecs import FLOAT16, NONE, UINT4, UINT8, Codec, encode_split
from averaging._faults import FaultPlan, InjectedFault, MemberFault
from averaging._group import Group, GroupMember, MemberMode
from averaging._partition import flat_zeros_like, flatten
from swarm import ConfigError, Identity, ManualClock, PeerID, SwarmError
from swarm._bans import BanList
from swarm._connections import ConnectionConfig, Connections, Stream, open_connections

TOTAL = 1000
CHUNK = 64
# Generous against a loaded machine; faults are slower than these by far.
# min_chunks_per_part=1: the chunks are exactly chunk_elements, as the tests lay them out
CONFIG = AllReduceConfig(
    sender_timeout=2.0,
    reducer_timeout=4.0,
    round_timeout=15.0,
    chunk_elements=CHUNK,
    min_chunks_per_part=1,
)
FOREVER = 1e6
MODES = pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
N, C, A = MemberMode.NODE, MemberMode.CLIENT, MemberMode.AUX


@asynccontextmanager
async def open_peers(n: int, *, encrypt: bool = False) -> AsyncIterator[list[Connections]]:
    async with AsyncExitStack() as stack:
        nets = [
            await stack.enter_async_context(
                open_connections(
                    Identity.from_seed(bytes([i + 1]) * 32),
                    config=ConnectionConfig(encrypt=encrypt),
                )
            )
            for i in range(n)
        ]
        yield nets


def make_groups(
    nets: Sequence[Connections],
    modes: Sequence[MemberMode] | None = None,
    bandwidths: Sequence[float] | None = None,
    group_id: bytes = b"group-1",
) -> list[Group]:
    modes = modes or [N] * len(nets)
    bandwidths = bandwidths or [1.0] * len(nets)
    members = tuple(
        GroupMember(net.peer_id, "127.0.0.1", net.port, bw, mode)
        for net, mode, bw in zip(nets, modes, bandwidths, strict=True)
    )
    return [Group(group_id, members, i) for i in range(len(nets))]


def member_data(i: int, total: int = TOTAL) -> torch.Tensor:
    return torch.randn(total, generator=torch.Generator().manual_seed(100 + i))


@dataclass
class Outcome:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    results: list[AllReduceResult | BaseException | None]
    finished_at: list[float]
    started_at: float


async def run_round(
    nets: Sequence[Connections],
    groups: Sequence[Group],
    weights: Sequence[float],
    *,
    codec: Codec = NONE,
    plan: FaultPlan | None = None,
    inputs: list[torch.Tensor] | None = None,
    scopes: dict[int, trio.CancelScope] | None = None,
    config: AllReduceConfig = CONFIG,
    one_buffer: bool = False,
) -> Outcome:
    n = len(nets)
    inputs = inputs or [member_data(i) for i in range(n)]
    # Two tensors per member, so flatten/unflatten_into are exercised too;
    # ``one_buffer``: back to back in one buffer, which is averaged in place.
    tensors = [[x[:300].clone().view(30, 10), x[300:].clone()] for x in inputs]
    if one_buffer:
        tensors = [flat_zeros_like(ts) for ts in tensors]
        for ts, x in zip(tensors, inputs, strict=True):
            flat = flatten(ts)
            assert flat.data_ptr() == ts[0].data_ptr()  # a view: averaged in place
            flat.copy_(x)
    outcome = Outcome(inputs, [], [None] * n, [0.0] * n, trio.current_time())
    scopes = scopes or {}

    async def member(i: int) -> None:
        with scopes.get(i, trio.CancelScope()):
            try:
                outcome.results[i] = await all_reduce(
                    nets[i],
                    groups[i],
                    tensors[i],
                    weight=weights[i],
                    codec=codec,
                    config=config,
                    fault_plan=plan,
                )
            except InjectedFault as e:
                outcome.results[i] = e
        outcome.finished_at[i] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(member, i)
    outcome.outputs = [torch.cat([t[0].reshape(-1), t[1]]) for t in tensors]
    return outcome


def check(
    outcome: Outcome,
    weights: Sequence[float],
    healthy: Sequence[int],
    expected: dict[tuple[int, int], frozenset[int] | str],
    *,
    atol: float = 1e-5,
    stragglers: Sequence[int] = (),
) -> None:
    """Every chunk of every healthy member is the weighted mean of its recorded
    contributors, which are ``expected[(part, chunk)]`` ("local": only the member
    itself, because the reducer failed). Healthy members finish by the deadline."""
    for i in healthy:
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult), result
        assert outcome.finished_at[i] - outcome.started_at <= CONFIG.round_timeout + 0.5
        assert result.timed_out == (i in stragglers)
        for part, (start, _) in enumerate(result.part_bounds):
            for chunk, contributors in enumerate(result.contributors[part]):
                want = expected[(part, chunk)]
                assert contributors == (frozenset({i}) if want == "local" else want), (
                    i,
                    part,
                    chunk,
                    contributors,
                )
                a = start + chunk * result.chunk_elements
                b = min(a + result.chunk_elements, result.part_bounds[part][1])
                total_w = sum(weights[s] for s in contributors)
                mean = sum(weights[s] * outcome.inputs[s][a:b] for s in contributors) / total_w
                assert torch.allclose(outcome.outputs[i][a:b], mean, atol=atol, rtol=0), (
                    i,
                    part,
                    chunk,
                )


def uniform(
    groups: Sequence[Group], contributors: frozenset[int]
) -> dict[tuple[int, int], frozenset[int] | str]:
    from averaging._partition import Partition

    p = Partition.for_group(groups[0], TOTAL, CHUNK)
    return {(j, c): contributors for j in range(groups[0].size) for c in range(p.num_chunks(j))}


WEIGHTS = [1.0, 2.0, 0.5, 1.5]
ALL4 = frozenset(range(4))


@MODES
async def test_exact_weighted_mean_without_faults(encrypt: bool) -> None:
    async with open_peers(4, encrypt=encrypt) as nets:
        groups = make_groups(nets, bandwidths=[1.0, 3.0, 0.5, 2.0])
        outcome = await run_round(nets, groups, WEIGHTS)
    check(outcome, WEIGHTS, range(4), uniform(groups, ALL4))
    for i in range(1, 4):
        assert torch.equal(outcome.outputs[i], outcome.outputs[0])
    results = [r for r in outcome.results if isinstance(r, AllReduceResult)]
    assert all(not r.failed_senders and not r.failed_reducers for r in results)
    assert results[0].part_contributors(1) == ALL4


async def test_rounds_reuse_the_connections_of_earlier_rounds() -> None:
    """A sender ends its stream once it has every result, without waiting
    for the reducer's EOF; the connection still goes back to the pool and
    carries the next round's stream (no handshake per round and peer)."""
    async with open_peers(3) as nets:
        for round_ in range(3):
            groups = make_groups(nets, group_id=f"round-{round_}".encode())
            outcome = await run_round(nets, groups, [1.0, 1.0, 1.0])
            check(outcome, [1.0, 1.0, 1.0], range(3), uniform(groups, frozenset(range(3))))
            await trio.testing.wait_all_tasks_blocked()  # the reducers' EOF and DONE
            assert [net.dialed for net in nets] == [2, 2, 2]


@pytest.mark.parametrize(
    ("codec", "atol"), [(FLOAT16, 4e-3), (UINT8, 0.06), (UINT4, 0.8)], ids=["f16", "u8", "u4"]
)
async def test_quantized_codecs_close_to_mean_and_identical(codec: Codec, atol: float) -> None:
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS[:3], codec=codec)
    check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))), atol=atol)
    # Two-step quantization: the reducer keeps what it sent, so all members agree bit for bit.
    assert torch.equal(outcome.outputs[1], outcome.outputs[0])
    assert torch.equal(outcome.outputs[2], outcome.outputs[0])


async def test_a_codec_encodes_and_decodes_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Quantizing and dequantizing chunks (senders' parts, reducers' results)
    runs in worker threads: the event loop's other streams and DHT replies do
    not wait for it."""
    threads: dict[str, set[int]] = {"encode": set(), "decode": set()}

    def recorded(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads[kind].add(threading.get_ident())
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(_allreduce, "encode_split", recorded("encode", _allreduce.encode_split))
    monkeypatch.setattr(_allreduce, "decode_split", recorded("decode", _allreduce.decode_split))
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS[:3], codec=UINT8)
    check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))), atol=0.06)
    assert threads["encode"] and threads["decode"]
    assert threading.get_ident() not in threads["encode"] | threads["decode"]


async def test_a_member_learns_the_weights_of_group_mates_that_began_before_it() -> None:
    """The header of a stream a group-mate began carries its weight: the
    member has it (and its listeners hear of it) before entering the round."""
    heard: list[tuple[bytes, PeerID, float]] = []
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        serve_allreduce(nets[1])
        with listen_to_sender_weights(nets[1], lambda *weight: heard.append(weight)):
            async with trio.open_nursery() as nursery:
                tensors = [member_data(0)]
                nursery.start_soon(
                    partial(all_reduce, nets[0], groups[0], tensors, weight=96.0, config=CONFIG)
                )
                await trio.testing.wait_all_tasks_blocked()  # member 1 has not begun
                assert sender_weights(nets[1], b"group-1") == {nets[0].peer_id: 96.0}
                assert heard == [(b"group-1", nets[0].peer_id, 96.0)]
                await all_reduce(nets[1], groups[1], [member_data(1)], weight=32.0, config=CONFIG)
        assert sender_weights(nets[1], b"another group") == {}


async def test_client_and_auxiliary_members() -> None:
    async with open_peers(4) as nets:
        groups = make_groups(nets, modes=[N, C, A, N], bandwidths=[1.0, 5.0, 2.0, 1.0])
        outcome = await run_round(nets, groups, WEIGHTS)
    result = outcome.results[0]
    assert isinstance(result, AllReduceResult)
    assert result.part_bounds[1] == (250, 250)  # client mode: nothing to reduce
    check(outcome, WEIGHTS, [0, 1, 3], uniform(groups, frozenset({0, 1, 3})))
    aux = outcome.results[2]
    assert isinstance(aux, AllReduceResult)
    assert torch.equal(outcome.outputs[2], outcome.inputs[2])  # aux tensors untouched
    assert all(c == frozenset({0, 1, 3}) for c in aux.contributors[2])


def without(
    groups: Sequence[Group], victim: int, from_chunk: int
) -> dict[tuple[int, int], frozenset[int] | str]:
    """A sender that delivered chunks [0, from_chunk) of every part and nothing after."""
    table = uniform(groups, ALL4)
    return {k: (ALL4 if k[1] < from_chunk else ALL4 - {victim}) for k in table}


def reducer_lost(
    groups: Sequence[Group], victim: int, from_chunk: int
) -> dict[tuple[int, int], frozenset[int] | str]:
    """A reducer that returned chunks [0, from_chunk) of its part and nothing after."""
    table = uniform(groups, ALL4)
    return {k: ("local" if k[0] == victim and k[1] >= from_chunk else ALL4) for k in table}


async def test_member_fails_before_sending() -> None:
    plan = FaultPlan({2: MemberFault(fail_before_sending=True)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan)
    assert isinstance(outcome.results[2], InjectedFault)
    expected = {k: ("local" if k[0] == 2 else ALL4 - {2}) for k in uniform(groups, ALL4)}
    check(outcome, WEIGHTS, [0, 1, 3], expected)
    for i in (0, 1, 3):
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult)
        assert result.failed_reducers == {2} and result.failed_senders == {2}


async def test_member_fails_while_sending() -> None:
    plan = FaultPlan({2: MemberFault(fail_after_sending=2)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan)
    check(outcome, WEIGHTS, [0, 1, 3], without(groups, 2, 2))


async def test_member_sends_very_slowly() -> None:
    plan = FaultPlan({2: MemberFault(send_delay=FOREVER, send_delay_after=1)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan)
    check(outcome, WEIGHTS, [0, 1, 3], without(groups, 2, 1))
    # The slow member itself is not stuck either: it gets the others' mean.
    check(outcome, WEIGHTS, [2], without(groups, 2, 1))


async def test_member_fails_while_reducing() -> None:
    plan = FaultPlan({1: MemberFault(fail_after_reducing=2)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan)
    # Member 1 still sends and receives: it is healthy except as reducer of part 1.
    check(outcome, WEIGHTS, range(4), reducer_lost(groups, 1, 2))
    for i in (0, 2, 3):
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult) and result.failed_reducers == {1}


async def test_tensors_in_one_buffer_are_averaged_in_place() -> None:
    """``flat_zeros_like``'s tensors are the vector itself: results land in
    them directly, and where a reducer failed they keep the local values."""
    plan = FaultPlan({1: MemberFault(fail_after_reducing=2)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan, one_buffer=True)
    check(outcome, WEIGHTS, range(4), reducer_lost(groups, 1, 2))


async def test_member_reduces_very_slowly() -> None:
    plan = FaultPlan({1: MemberFault(reduce_delay=FOREVER, reduce_delay_after=1)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan)
    # The slow reducer stops serving once every sender has given up on it.
    check(outcome, WEIGHTS, range(4), reducer_lost(groups, 1, 1))


async def test_member_cancelled() -> None:
    scope = trio.CancelScope()
    plan = FaultPlan({3: MemberFault(cancel_before_chunk=0, cancel=scope.cancel)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan, scopes={3: scope})
    assert scope.cancelled_caught and outcome.results[3] is None
    expected = {k: ("local" if k[0] == 3 else ALL4 - {3}) for k in uniform(groups, ALL4)}
    check(outcome, WEIGHTS, [0, 1, 2], expected)


async def test_nan_sender_is_excluded_from_that_chunk_on() -> None:
    inputs = [member_data(i) for i in range(4)]
    inputs[1][500 + CHUNK + 3] = float("nan")  # part 2 is [500, 750): its chunk 1
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, inputs=inputs)
    expected = {k: (ALL4 - {1} if k[0] == 2 and k[1] >= 1 else ALL4) for k in uniform(groups, ALL4)}
    check(outcome, WEIGHTS, [0, 2, 3], expected)
    result = outcome.results[2]
    assert isinstance(result, AllReduceResult) and result.failed_senders == {1}


async def test_a_chunk_whose_sum_overflows_keeps_local_values_and_blames_nobody() -> None:
    inputs = [member_data(i) for i in range(2)]
    for x in inputs:
        x[3] = 3e38  # part 0, chunk 0: finite values, but their sum overflows float32
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, [1.0, 1.0], inputs=inputs)
    both = frozenset({0, 1})
    expected = uniform(groups, both)
    expected[(0, 0)] = "local"
    check(outcome, [1.0, 1.0], [0, 1], expected)
    for result in outcome.results:
        assert isinstance(result, AllReduceResult)
        assert not result.failed_reducers and not result.failed_senders


#: 400 kB chunks: their raw payloads are checked for NaN piece by piece as they
#: arrive (``_FiniteCheck``), small ones only once whole.
BIG_CHUNK = 100_000
SPOTS = pytest.mark.parametrize(
    "where", [3, BIG_CHUNK // 2 + 1, BIG_CHUNK - 1], ids=["head", "middle", "tail"]
)


@MODES
@SPOTS
async def test_nan_anywhere_in_a_large_chunk_excludes_its_sender(encrypt: bool, where: int) -> None:
    inputs = [member_data(i, 4 * BIG_CHUNK) for i in range(2)]  # two parts of two chunks
    inputs[0][2 * BIG_CHUNK + where] = float("nan")  # part 1 (member 1 reduces it), chunk 0
    config = replace(CONFIG, chunk_elements=BIG_CHUNK)
    async with open_peers(2, encrypt=encrypt) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, [1.0, 1.0], inputs=inputs, config=config)
    both, alone = frozenset({0, 1}), frozenset({1})
    expected = {(0, 0): both, (0, 1): both, (1, 0): alone, (1, 1): alone}
    check(outcome, [1.0, 1.0], [0, 1], expected)
    result = outcome.results[1]
    assert isinstance(result, AllReduceResult) and result.failed_senders == {0}


@MODES
@SPOTS
async def test_a_reducer_that_returns_nan_anywhere_is_dropped_and_banned(
    encrypt: bool, where: int
) -> None:
    """A lying reducer doubles the first chunk and puts a NaN in the second: the
    sender takes the first, keeps its local values for the second, and bans it."""
    x = member_data(0, 2 * BIG_CHUNK)
    original = x.clone()
    bans = BanList(clock=ManualClock(0.0))
    net_config = ConnectionConfig(encrypt=encrypt)
    liar_id = Identity.from_seed(bytes([2]) * 32)
    async with (
        open_connections(Identity.from_seed(bytes([1]) * 32), config=net_config, bans=bans) as net,
        open_connections(liar_id, config=net_config) as liar,
    ):

        async def lie(stream: Stream) -> None:
            await stream.receive()  # the sender's header
            for chunk in range(2):
                await stream.receive()  # the chunk's header
                values = torch.frombuffer(bytearray(await stream.receive()), dtype=torch.float32)
                values = values * 2
                if chunk == 1:
                    values[where] = float("nan")
                header, payload = encode_split(values, NONE)
                contributors = bytes([0b01, 0, 0, 0])  # member 0
                await stream.send_bytes_batch(
                    (struct.pack("<I", chunk) + contributors + header, payload)
                )

        liar.set_handler(ALLREDUCE_STREAM, lie)
        members = (
            GroupMember(net.peer_id, "127.0.0.1", net.port, 1.0, C),
            GroupMember(liar.peer_id, "127.0.0.1", liar.port, 1.0, N),
        )
        config = replace(CONFIG, chunk_elements=BIG_CHUNK)
        result = await all_reduce(net, Group(b"g", members, 0), [x], config=config)
    assert result.failed_reducers == {1}
    assert result.contributors[1] == (frozenset({0}), frozenset({0}))
    assert torch.equal(x[:BIG_CHUNK], 2 * original[:BIG_CHUNK])
    assert torch.equal(x[BIG_CHUNK:], original[BIG_CHUNK:])
    assert bans.is_banned(liar_id.peer_id) and "NaN" in (bans.reason(liar_id.peer_id) or "")


async def test_a_reducer_that_pushes_nan_on_its_own_stream_is_dropped_and_banned() -> None:
    """Between two members that both reduce a part, the results come on the
    reducer's own stream, among its chunks. A liar there sends its chunks of
    our part, then a good result and one with a NaN: we take the first, keep
    our local values for the second, and ban it."""
    total = 4 * BIG_CHUNK  # two parts of two chunks
    x = member_data(0, total)
    original = x.clone()
    bans = BanList(clock=ManualClock(0.0))
    liar_id = Identity.from_seed(bytes([2]) * 32)
    async with (
        open_connections(Identity.from_seed(bytes([1]) * 32), bans=bans) as net,
        open_connections(liar_id) as liar,
    ):
        members = (
            GroupMember(net.peer_id, "127.0.0.1", net.port, 1.0, N),
            GroupMember(liar.peer_id, "127.0.0.1", liar.port, 1.0, N),
        )
        group = Group(b"g", members, 0)

        async def swallow(stream: Stream) -> None:  # our chunks of its part, our results
            with contextlib.suppress(SwarmError):
                while True:
                    await stream.receive()

        async def lie() -> None:
            async with liar.open_stream(
                net.peer_id, ("127.0.0.1", net.port), ALLREDUCE_STREAM
            ) as stream:
                await stream.send([PROTOCOL_VERSION, b"g", 0, 1, 1.0, BIG_CHUNK, total])
                for chunk in range(2):  # its chunks of our part
                    header, payload = encode_split(torch.ones(BIG_CHUNK), NONE)
                    await stream.send_bytes_batch((struct.pack("<I", chunk) + header, payload))
                for chunk in range(2):  # its "results" of its part
                    values = torch.full((BIG_CHUNK,), 7.0)
                    if chunk == 1:
                        values[BIG_CHUNK // 2] = float("nan")
                    header, payload = encode_split(values, NONE)
                    index = struct.pack("<I", chunk | RESULT_FLAG)
                    both = bytes([0b11, 0, 0, 0])  # members 0 and 1
                    await stream.send_bytes_batch((index + both + header, payload))
                with contextlib.suppress(SwarmError):
                    await stream.receive()  # until we drop it

        liar.set_handler(ALLREDUCE_STREAM, swallow)
        config = replace(CONFIG, chunk_elements=BIG_CHUNK)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lie)
            result = await all_reduce(net, group, [x], config=config)
    half = 2 * BIG_CHUNK
    assert result.failed_reducers == {1}
    assert result.contributors[1] == (frozenset({0, 1}), frozenset({0}))
    assert torch.equal(x[half : half + BIG_CHUNK], torch.full((BIG_CHUNK,), 7.0))
    assert torch.equal(x[half + BIG_CHUNK :], original[half + BIG_CHUNK :])
    assert bans.is_banned(liar_id.peer_id) and "NaN" in (bans.reason(liar_id.peer_id) or "")


async def test_stream_for_unknown_group_is_refused() -> None:
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        other = make_groups(nets, group_id=b"other")
        # Member 1 runs another group: member 0's part-1 stream is refused, and
        # member 0 excludes member 1 as a sender after sender_timeout.
        outcome = Outcome([], [], [None, None], [0.0, 0.0], trio.current_time())
        x = [member_data(0), member_data(1)]

        async def one(i: int, group: Group) -> None:
            outcome.results[i] = await all_reduce(nets[i], group, [x[i]], config=CONFIG)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, groups[0])
            nursery.start_soon(one, 1, other[1])
    r0 = outcome.results[0]
    assert isinstance(r0, AllReduceResult)
    assert r0.failed_reducers == {1} and r0.failed_senders == {1}
    assert torch.equal(x[0], member_data(0))


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="must exceed sender_timeout"):
        AllReduceConfig(sender_timeout=5.0, reducer_timeout=5.0)
    with pytest.raises(ConfigError, match="chunk_elements"):
        AllReduceConfig(chunk_elements=1 << 22)
    with pytest.raises(ConfigError):
        AllReduceConfig(round_timeout=float("nan"))
    with pytest.raises(ConfigError, match="upload_pacing"):
        AllReduceConfig(upload_pacing=0.0)


async def test_stream_claiming_another_members_index_is_refused() -> None:
    async with open_peers(3) as nets:
        groups = make_groups(nets[:2])
        x = member_data(0)
        results: list[AllReduceResult] = []

        async def member0() -> None:
            results.append(await all_reduce(nets[0], groups[0], [x], config=CONFIG))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member0)
            # nets[2] is not in the group but claims to be member 1.
            header = [PROTOCOL_VERSION, groups[0].group_id, 0, 1, 1.0, CHUNK, TOTAL]
            with pytest.raises(SwarmError, match="another peer"):
                async with nets[2].open_stream(
                    nets[0].peer_id, ("127.0.0.1", nets[0].port), ALLREDUCE_STREAM
                ) as stream:
                    await stream.send(header)
                    await stream.receive()
    assert results[0].failed_senders == {1} and results[0].failed_reducers == {1}
    assert torch.equal(x, member_data(0))


async def test_sender_breaking_the_protocol_is_excluded() -> None:
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        x = member_data(0)
        results: list[AllReduceResult] = []

        async def member0() -> None:
            results.append(await all_reduce(nets[0], groups[0], [x], config=CONFIG))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member0)
            # Member 1, by hand: a valid header, then a chunk header of the wrong size.
            header = [PROTOCOL_VERSION, groups[0].group_id, 0, 1, 1.0, CHUNK, TOTAL]
            with pytest.raises(SwarmError):
                async with nets[1].open_stream(
                    nets[0].peer_id, ("127.0.0.1", nets[0].port), ALLREDUCE_STREAM
                ) as stream:
                    await stream.send(header)
                    await stream.send_bytes(b"\0" * 7)
                    await stream.send_bytes(b"\0" * 7)
                    await stream.receive()  # the reducer drops the stream
    assert results[0].failed_senders == {1}
    assert torch.equal(x, member_data(0))


async def test_member_entering_late_is_waited_for_when_serving_up_front() -> None:
    async with open_peers(2) as nets:
        for net in nets:
            serve_allreduce(net)
        groups = make_groups(nets)
        x = [member_data(0), member_data(1)]
        results: list[AllReduceResult | None] = [None, None]

        async def member(i: int) -> None:
            results[i] = await all_reduce(nets[i], groups[i], [x[i]], config=CONFIG)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0)
            # Member 1 enters only once member 0 runs its round (and may
            # already be dialing member 1): its stream waits for the round.
            while groups[0].group_id not in _registries[nets[0]]._rounds:
                await trio.lowlevel.checkpoint()
            nursery.start_soon(member, 1)
    mean = (member_data(0) + member_data(1)) / 2
    for i in range(2):
        result = results[i]
        assert result is not None and not result.failed_reducers and not result.failed_senders
        assert torch.allclose(x[i], mean, atol=1e-6)


async def test_caller_cancellation_propagates_cleanly() -> None:
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        x = member_data(0)
        # Member 1 never starts, so member 0 is still waiting when its caller gives up.
        with trio.move_on_after(0.2) as scope:
            await all_reduce(nets[0], groups[0], [x], config=CONFIG)
        assert scope.cancelled_caught
        assert torch.equal(x, member_data(0))
        # The peer is usable for the next round at once.
        serve_allreduce(nets[1])
        later = make_groups(nets, group_id=b"group-2")
        y = [member_data(0), member_data(1)]
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(partial(all_reduce, nets[i], later[i], [y[i]], config=CONFIG))
        assert torch.allclose(y[0], (member_data(0) + member_data(1)) / 2, atol=1e-6)


async def test_group_of_one_keeps_its_values() -> None:
    async with open_peers(1) as nets:
        x = member_data(0)
        result = await all_reduce(nets[0], make_groups(nets)[0], [x], weight=3.0, config=CONFIG)
    assert torch.equal(x, member_data(0))
    assert result.part_contributors(0) == {0} and not result.failed_reducers
