"""The pipelined ring all-reduce (``AllReduceConfig.ring``) over real sockets
on 127.0.0.1, several peers in one process, checked as the butterfly is
(``test_allreduce.check``): each chunk is the exact weighted mean of the
members recorded as its contributors, and a broken ring falls back to the
butterfly with the butterfly's promises."""

from __future__ import annotations

import threading
from contextlib import AsyncExitStack, suppress
from dataclasses import replace
from typing import Any

import pytest
import torch
import trio
from test_allreduce import (
    ALL4,
    CHUNK,
    CONFIG,
    TOTAL,
    WEIGHTS,
    A,
    C,
    N,
    check,
    make_groups,
    member_data,
    open_peers,
    run_round,
    uniform,
)
from test_connections import max_pacing_rates

from averaging._allreduce import (
    AllReduceResult,
    all_reduce,
    listen_to_sender_weights,
    sender_weights,
    serve_allreduce,
)
from averaging._codecs import FLOAT16
from averaging._faults import FaultPlan, MemberFault
from averaging._group import Group, GroupMember, contributor_mask
from averaging._link_meter import MIN_SAMPLE_BYTES, LinkMeter
from averaging._partition import Partition
from averaging._ring import (
    _ITEM,
    RESULT,
    RING_STREAM,
    RING_VERSION,
    SUM,
    _Ring,
    _Spares,
    ring_eligible,
)
from swarm import Identity, ManualClock, PeerID, ProtocolError, SwarmError
from swarm._bans import BanList
from swarm._bulk_io import Batches
from swarm._connections import open_connections

RING = replace(CONFIG, ring=True)


def _results(outcome_results: list[object]) -> list[AllReduceResult]:
    results = [r for r in outcome_results if isinstance(r, AllReduceResult)]
    assert len(results) == len(outcome_results)
    return results


async def test_ring_gives_the_exact_weighted_mean_over_one_connection_per_member() -> None:
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, config=RING)
        # a ring: each member dialed its successor only (the butterfly dials all)
        assert [net.dialed for net in nets] == [1, 1, 1, 1]
    check(outcome, WEIGHTS, range(4), uniform(groups, ALL4))
    for i in range(1, 4):  # everyone holds the reducer's bits
        assert torch.equal(outcome.outputs[i], outcome.outputs[0])
    for result in _results(outcome.results):
        assert not (result.failed_senders or result.failed_reducers or result.timed_out)


async def test_ring_encrypted_and_reusing_connections_across_rounds() -> None:
    async with open_peers(3, encrypt=True) as nets:
        for round_ in range(3):
            groups = make_groups(nets, group_id=f"ring-{round_}".encode())
            outcome = await run_round(nets, groups, WEIGHTS[:3], config=RING)
            check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))))
        assert [net.dialed for net in nets] == [1, 1, 1]


async def test_ring_leaves_out_weight_zero_and_a_member_whose_values_are_not_finite() -> None:
    """A member of weight 0 is in no result; a member whose own values hold
    NaN leaves itself out of that chunk only, and the others are not held up."""
    weights = [1.0, 0.0, 2.0, 1.5]
    inputs = [member_data(i) for i in range(4)]
    inputs[3][500 + CHUNK + 3] = float("nan")  # part 2 is [500, 750): its chunk 1
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, weights, inputs=inputs, config=RING)
    everyone = ALL4 - {1}
    expected = {k: (everyone - {3} if k == (2, 1) else everyone) for k in uniform(groups, ALL4)}
    check(outcome, weights, range(4), expected)


async def test_ring_chunk_whose_sum_overflows_keeps_local_values() -> None:
    inputs = [member_data(i) for i in range(3)]
    for x in inputs:
        x[3] = 3e38  # part 0, chunk 0: finite values whose sum overflows float32
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, [1.0, 1.0, 1.0], inputs=inputs, config=RING)
    for i in range(3):
        result = _results(outcome.results)[i]
        assert result.contributors[0][0] == frozenset()
        assert torch.equal(outcome.outputs[i][:CHUNK], inputs[i][:CHUNK])
        assert result.contributors[1][0] == frozenset(range(3))
        assert not result.failed_reducers


async def test_a_broken_ring_falls_back_to_the_butterfly_without_the_failed_member() -> None:
    plan = FaultPlan({2: MemberFault(fail_before_sending=True)})
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, plan=plan, config=RING)
    expected = {k: ("local" if k[0] == 2 else ALL4 - {2}) for k in uniform(groups, ALL4)}
    check(outcome, WEIGHTS, [0, 1, 3], expected)
    for i in (0, 1, 3):
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult)
        assert result.group_id == groups[i].group_id
        assert result.failed_reducers == {2} and result.failed_senders == {2}


async def test_groups_the_ring_cannot_serve_use_the_butterfly() -> None:
    """Clients and auxiliary members, parts cut for unequal links, and codecs
    other than raw float32 take the butterfly even with ``ring=True``: every
    member decides alike."""
    async with open_peers(4) as nets:
        groups = make_groups(nets, modes=[N, N, C, A])
        partition = Partition.for_group(groups[0], TOTAL, CHUNK)
        assert not ring_eligible(groups[0], partition)
        outcome = await run_round(nets, groups, [1.0, 1.0, 1.0, 0.0], config=RING)
        assert all(isinstance(r, AllReduceResult) for r in outcome.results)
        assert nets[0].dialed > 1
    async with open_peers(3) as nets:
        groups = make_groups(nets, bandwidths=[1.0, 3.0, 1.0])
        assert not ring_eligible(groups[0], Partition.for_group(groups[0], TOTAL, CHUNK))
        outcome = await run_round(nets, groups, WEIGHTS[:3], config=RING)
        check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))))
        assert [net.dialed for net in nets] == [2, 2, 2]
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS[:3], codec=FLOAT16, config=RING)
        check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))), atol=4e-3)
        assert [net.dialed for net in nets] == [2, 2, 2]


def _with_uploads(groups: list[Group], uploads: list[float]) -> list[Group]:
    """``groups`` with each member publishing its measured upload (bytes/s)."""
    members = tuple(replace(m, upload=u) for m, u in zip(groups[0].members, uploads, strict=True))
    return [Group(g.group_id, members, g.local_index) for g in groups]


async def test_measured_uploads_a_few_percent_apart_run_around_the_ring() -> None:
    """Equal links measure uploads that differ by noise: the ring cuts equal
    parts and runs (each member dials its successor only); uploads 30% apart
    keep proportional parts and the butterfly."""
    async with open_peers(4) as nets:
        groups = _with_uploads(make_groups(nets), [12.5e6, 12.2e6, 12.4e6, 12.575e6])
        outcome = await run_round(nets, groups, WEIGHTS, config=RING)
        assert [net.dialed for net in nets] == [1, 1, 1, 1]
        equal = Partition.for_group(groups[0], TOTAL, CHUNK, ring=True)
        assert {equal.part_size(j) for j in range(4)} == {TOTAL // 4}
        expected = {(j, c): ALL4 for j in range(4) for c in range(equal.num_chunks(j))}
        for result in _results(outcome.results):
            assert result.part_bounds == equal.part_bounds
        check(outcome, WEIGHTS, range(4), expected)
    async with open_peers(4) as nets:
        uploads = [12.5e6, 8.75e6, 12.4e6, 12.575e6]
        groups = _with_uploads(make_groups(nets), uploads)
        outcome = await run_round(nets, groups, WEIGHTS, config=RING)
        assert [net.dialed for net in nets] == [3, 3, 3, 3]
        proportional = Partition.for_group(groups[0], TOTAL, CHUNK)
        assert proportional.part_size(1) < proportional.part_size(0)
        for result in _results(outcome.results):
            assert result.part_bounds == proportional.part_bounds
        expected = {(j, c): ALL4 for j in range(4) for c in range(proportional.num_chunks(j))}
        check(outcome, WEIGHTS, range(4), expected)


async def test_a_predecessor_that_sends_nan_is_banned_and_the_others_fall_back() -> None:
    """Member 3, played here by hand, opens its ring stream to member 0 and
    sends a running sum with NaN in it: member 0 bans it and breaks the ring,
    and members 0-2 average without it in the butterfly."""
    bans = BanList(clock=ManualClock(0.0))
    async with AsyncExitStack() as stack:
        nets = [
            await stack.enter_async_context(
                open_connections(Identity.from_seed(bytes([1]) * 32), bans=bans)
            ),
            *[
                await stack.enter_async_context(
                    open_connections(Identity.from_seed(bytes([i + 1]) * 32))
                )
                for i in range(1, 4)
            ],
        ]
        serve_allreduce(nets[3])  # member 2's ring stream waits here, then is refused
        groups = make_groups(nets)
        inputs = [member_data(i) for i in range(4)]
        outputs = [x.clone() for x in inputs]
        results: dict[int, AllReduceResult] = {}

        async def member(i: int) -> None:
            results[i] = await all_reduce(nets[i], groups[i], [outputs[i]], config=RING)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(member, i)
            async with nets[3].open_stream(
                nets[0].peer_id, ("127.0.0.1", nets[0].port), RING_STREAM
            ) as stream:
                await stream.send([RING_VERSION, groups[3].group_id, 3, 1.0])
                part = Partition.for_group(groups[3], TOTAL, CHUNK)
                a, b = part.chunk_bounds(2, 0)  # the first sum member 0 expects
                header = _ITEM.pack(SUM, 2, 0, 1.0) + contributor_mask(frozenset({3}), 4)
                await stream.send_bytes_batch(
                    [header, torch.full((b - a,), float("nan")).numpy().tobytes()]
                )
                with pytest.raises(SwarmError):
                    await stream.receive()  # member 0 resets the stream
    assert bans.is_banned(nets[3].peer_id)
    assert "NaN" in (bans.reason(nets[3].peer_id) or "")
    three = frozenset(range(3))
    for i in range(3):
        result = results[i]
        assert result.group_id == groups[i].group_id
        assert result.failed_reducers == {3} and result.failed_senders == {3}
        for j, (start, end) in enumerate(result.part_bounds):
            want = inputs[i][start:end] if j == 3 else sum(x[start:end] for x in inputs[:3]) / 3
            assert torch.allclose(outputs[i][start:end], want, atol=1e-5, rtol=0), (i, j)
            assert result.part_contributors(j) == (frozenset({i}) if j == 3 else three)


async def test_a_result_with_nan_is_refused_and_the_next_round_is_exact() -> None:
    """Results arrive straight into the round's result vector, which the
    peer's next round reuses. Member 1 of a ring of two, played here by
    hand, sends member 0 its sums and then a result with NaN: member 0 bans
    it and keeps its local values, and its next ring round (with member 2)
    holds the exact mean, nothing of the refused result."""
    bans = BanList(clock=ManualClock(0.0))
    async with AsyncExitStack() as stack:
        nets = [
            await stack.enter_async_context(
                open_connections(Identity.from_seed(bytes([i + 1]) * 32), bans=bans)
            )
            for i in range(3)
        ]

        async def drain(stream: Any) -> None:  # member 1 takes what member 0 sends it
            with suppress(SwarmError):
                while True:
                    await stream.receive()

        nets[1].set_handler(RING_STREAM, drain)
        groups = make_groups(nets[:2])
        part = Partition.for_group(groups[1], TOTAL, CHUNK)
        inputs = [member_data(i) for i in range(3)]
        output = inputs[0].clone()
        results: list[AllReduceResult] = []

        async def member_0() -> None:
            results.append(await all_reduce(nets[0], groups[0], [output], config=RING))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member_0)
            async with nets[1].open_stream(
                nets[0].peer_id, ("127.0.0.1", nets[0].port), RING_STREAM
            ) as stream:
                await stream.send([RING_VERSION, groups[1].group_id, 1, 1.0])
                for chunk in range(part.num_chunks(0)):  # the sums member 0 reduces
                    a, b = part.chunk_bounds(0, chunk)
                    header = _ITEM.pack(SUM, 0, chunk, 1.0) + contributor_mask(frozenset({1}), 2)
                    await stream.send_bytes_batch([header, inputs[1][a:b].numpy().tobytes()])
                a, b = part.chunk_bounds(1, 0)
                header = _ITEM.pack(RESULT, 1, 0, 2.0) + contributor_mask(frozenset({0, 1}), 2)
                await stream.send_bytes_batch(
                    [header, torch.full((b - a,), float("nan")).numpy().tobytes()]
                )
                with pytest.raises(SwarmError):
                    await stream.receive()  # member 0 resets the stream
        assert "NaN" in (bans.reason(nets[1].peer_id) or "")
        assert results[0].failed_reducers == {1}
        assert torch.equal(output, inputs[0])  # only its own values, in the fallback
        pair = [nets[0], nets[2]]
        outcome = await run_round(
            pair,
            make_groups(pair, group_id=b"group-2"),
            [1.0, 1.0],
            inputs=inputs[::2],
            config=RING,
        )
        for out in outcome.outputs:
            assert torch.allclose(out, (inputs[0] + inputs[2]) / 2, atol=1e-6, rtol=0)


async def test_paced_rounds_average_exactly_and_leave_their_connections_unpaced() -> None:
    """``upload_pacing`` caps each stream at its share of the rate while the
    round runs (butterfly and ring alike), and lifts the caps at its end:
    the pooled connections carry whatever comes next unpaced."""
    for config in (replace(CONFIG, upload_pacing=1e9), replace(RING, upload_pacing=1e9)):
        async with open_peers(3) as nets:
            groups = make_groups(nets)
            outcome = await run_round(nets, groups, WEIGHTS[:3], config=config)
            check(outcome, WEIGHTS[:3], range(3), uniform(groups, frozenset(range(3))))
            for net in nets:
                assert net._connections
                assert set(max_pacing_rates(net)) == {2**64 - 1}


async def test_a_ring_round_gives_its_link_rates_to_the_meter() -> None:
    """The ring's sends and receives are timed as the butterfly's are, so a
    trainer running the ring measures its link (``_link_meter``) and parts
    cut from those rates stay alike when the links are."""
    total = MIN_SAMPLE_BYTES  # floats: each member sends and receives 6 x what counts
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(total, generator=gen) for _ in range(4)]
    mean = torch.stack(inputs).mean(dim=0)
    meters = [LinkMeter(trio.current_time) for _ in range(4)]
    results: list[AllReduceResult] = []
    async with open_peers(4) as nets:
        groups = make_groups(nets)

        async def member(i: int) -> None:
            config = replace(RING, chunk_elements=1 << 15, min_chunks_per_part=1)
            results.append(
                await all_reduce(nets[i], groups[i], [inputs[i]], config=config, meter=meters[i])
            )

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(member, i)
        assert [net.dialed for net in nets] == [1, 1, 1, 1]  # it was the ring
    assert all(chunk == ALL4 for r in results for part in r.contributors for chunk in part)
    for x in inputs:
        torch.testing.assert_close(x, mean)
    for meter in meters:
        assert meter.upload > 0 and meter.download > 0


async def test_each_ring_member_hears_its_predecessors_weight_when_it_begins() -> None:
    """The ring header carries the sender's weight, as the butterfly's does
    (``sender_weights``, which the trainer's count of final samples reads):
    around a ring only the successor hears it."""
    heard: list[tuple[int, bytes, PeerID, float]] = []
    async with open_peers(4) as nets, AsyncExitStack() as stack:
        groups = make_groups(nets)
        for i, net in enumerate(nets):
            serve_allreduce(net)

            def note(gid: bytes, peer: PeerID, weight: float, i: int = i) -> None:
                heard.append((i, gid, peer, weight))

            stack.enter_context(listen_to_sender_weights(net, note))
        await run_round(nets, groups, WEIGHTS, config=RING)
        for i, net in enumerate(nets):
            before = (i - 1) % 4
            assert sender_weights(net, groups[i].group_id) == {
                nets[before].peer_id: WEIGHTS[before]
            }
    assert sorted((i, peer, w) for i, _, peer, w in heard) == [
        (i, nets[(i - 1) % 4].peer_id, WEIGHTS[(i - 1) % 4]) for i in range(4)
    ]


def test_a_ring_header_without_a_finite_weight_is_refused() -> None:
    members = tuple(
        GroupMember(Identity.from_seed(bytes([i + 1]) * 32).peer_id, "127.0.0.1", 1 + i)
        for i in range(3)
    )
    group = Group(b"g", members, 1)
    partition = Partition.for_group(group, TOTAL, CHUNK)
    rnd = _Ring(group, partition, torch.zeros(TOTAL), 1.0, 5.0, _Spares())
    predecessor = members[0].peer_id
    rnd.check_header(predecessor, [RING_VERSION, b"g", 0, 2])  # an int weight is a weight
    for bad in ("1", True, None, -1.0, float("nan"), float("inf")):
        with pytest.raises(ProtocolError, match="weight"):
            rnd.check_header(predecessor, [RING_VERSION, b"g", 0, bad])
    with pytest.raises(ProtocolError, match="4 items"):
        rnd.check_header(predecessor, [RING_VERSION, b"g", 0])  # version 1's header


async def test_a_member_cancelled_mid_ring_leaves_no_receiving_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Member 2 is cancelled (as by its caller) once its receiving worker
    thread has taken two items: every ring stream's worker, its own and
    those of the members whose ring broke with it, has returned when the
    round ends, and the others average without member 2 in the butterfly."""
    mid_ring, go_on = threading.Event(), threading.Event()
    placed = _Ring._placed

    def counting(self: _Ring, header: memoryview, *rest: Any) -> Any:
        if self.me == 2 and rest[:3] == (SUM, *_second_item(self)):
            mid_ring.set()
            go_on.wait(60)  # the worker holds here until member 2 is cancelled
        return placed(self, header, *rest)

    workers: list[Batches[Any]] = []
    start = Batches._start

    def recorded(self: Batches[Any], work: Any) -> None:
        workers.append(self)
        start(self, work)

    monkeypatch.setattr(_Ring, "_placed", counting)
    monkeypatch.setattr(Batches, "_start", recorded)
    scopes = {2: trio.CancelScope()}
    async with open_peers(4) as nets, trio.open_nursery() as nursery:

        async def cancel_mid_ring() -> None:
            assert await trio.to_thread.run_sync(mid_ring.wait, 60)
            scopes[2].cancel()
            go_on.set()

        nursery.start_soon(cancel_mid_ring)
        groups = make_groups(nets)
        outcome = await run_round(nets, groups, WEIGHTS, scopes=scopes, config=RING)
    assert workers and all(batches._returned for batches in workers)
    for i in (0, 1, 3):
        result = outcome.results[i]
        assert isinstance(result, AllReduceResult)
        assert 2 in result.failed_reducers


def _second_item(ring: _Ring) -> tuple[int, int]:
    """(part, chunk) of the second item a ring member receives."""
    part = (ring.prev - 1) % ring.group.size
    if ring.partition.num_chunks(part) > 1:
        return part, 1
    return (ring.prev - 2) % ring.group.size, 0
