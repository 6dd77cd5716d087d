"""The lossy all-reduce (``averaging._lossy``) over real sockets on 127.0.0.1.

Datagrams cross real UDP sockets; the loss, duplication and reordering come
from a seeded ``DatagramFaults`` filter at each receiver, composed into the
real round (as the TCP all-reduce's ``FaultPlan``). The invariant checked for
every member and every piece: the piece is the weighted mean over exactly the
members recorded as its contributors, and a piece recorded as the member's
alone holds its own values.
"""

from __future__ import annotations

import itertools
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import torch
import trio
import trio.testing

from averaging import AllReduceConfig, AllReduceResult, all_reduce
from averaging import _lossy as lossy_module
from averaging._codecs import FLOAT16
from averaging._datagrams import FULL_DATAGRAM, HEADER, PIECE_ELEMENTS, Kind, peek_route
from averaging._faults import DatagramFaults, DatagramFilter, FaultPlan
from averaging._group import Group, GroupMember, MemberMode
from averaging._lossy import (
    LOSSY_STREAM,
    LOSSY_VERSION,
    _AwaitedStream,
    _pacers,
    _segments,
    _tune,
    lossy_all_reduce,
    send_burst,
)
from averaging._partition import Partition
from swarm import ConfigError, Identity, ProtocolError, StreamResetError, SwarmError
from swarm._connections import ConnectionConfig, Connections, open_connections
from trainer import kept_own_fraction

TOTAL = 20_000  # about 15 pieces per part in a group of 4
LOSSY = AllReduceConfig(sender_timeout=2.0, reducer_timeout=4.0, round_timeout=15.0, lossy=True)
WEIGHTS = [1.0, 2.0, 0.5, 1.5]


@asynccontextmanager
async def open_peers(n: int, *, encrypt: bool = True) -> AsyncIterator[list[Connections]]:
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                open_connections(
                    Identity.from_seed(bytes([i + 1]) * 32),
                    config=ConnectionConfig(encrypt=encrypt),
                )
            )
            for i in range(n)
        ]


def make_groups(
    nets: Sequence[Connections], modes: Sequence[MemberMode] | None = None
) -> list[Group]:
    modes = modes or [MemberMode.NODE] * len(nets)
    members = tuple(
        GroupMember(net.peer_id, "127.0.0.1", net.port, 1.0, mode)
        for net, mode in zip(nets, modes, strict=True)
    )
    return [Group(b"lossy-group", members, i) for i in range(len(nets))]


def member_data(i: int) -> torch.Tensor:
    return torch.randn(TOTAL, generator=torch.Generator().manual_seed(100 + i))


async def run_round(
    nets: Sequence[Connections],
    groups: Sequence[Group],
    weights: Sequence[float],
    plan: FaultPlan | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[AllReduceResult]]:
    inputs = [member_data(i) for i in range(len(nets))]
    tensors = [[x[:300].clone().view(30, 10), x[300:].clone()] for x in inputs]
    done = await average_in_place(nets, groups, tensors, weights, plan)
    outputs = [torch.cat([t[0].reshape(-1), t[1]]) for t in tensors]
    return inputs, outputs, done


async def average_in_place(
    nets: Sequence[Connections],
    groups: Sequence[Group],
    tensors: Sequence[list[torch.Tensor]],
    weights: Sequence[float],
    plan: FaultPlan | None = None,
) -> list[AllReduceResult]:
    """One lossy round over member i's ``tensors[i]`` (averaged in place),
    weighted by ``weights``; the members' results in order."""
    results: list[AllReduceResult | None] = [None] * len(nets)

    async def member(i: int) -> None:
        results[i] = await all_reduce(
            nets[i], groups[i], tensors[i], weight=weights[i], config=LOSSY, fault_plan=plan
        )

    async with trio.open_nursery() as nursery:
        for i in range(len(nets)):
            nursery.start_soon(member, i)
    done = [r for r in results if r is not None]
    assert len(done) == len(nets)
    return done


def check_pieces(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    results: Sequence[AllReduceResult],
    weights: Sequence[float],
    members: Sequence[int],
) -> int:
    """The invariant for every piece of every member in ``members``; returns
    how many pieces hold fewer contributions than all senders'."""
    partial = 0
    for i in members:
        result = results[i]
        assert result.chunk_elements == PIECE_ELEMENTS
        assert not result.timed_out
        for part, (start, end) in enumerate(result.part_bounds):
            assert len(result.contributors[part]) == -(-(end - start) // PIECE_ELEMENTS)
            for piece, who in enumerate(result.contributors[part]):
                a = start + piece * PIECE_ELEMENTS
                b = min(a + PIECE_ELEMENTS, end)
                assert who, (i, part, piece)
                partial += len(who) < len(weights)
                total = sum(weights[s] for s in who)
                mean = sum(weights[s] * inputs[s][a:b] for s in who) / total
                assert torch.allclose(outputs[i][a:b], mean, atol=1e-5, rtol=0), (i, part, piece)
    return partial


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "encrypted"])
async def test_weighted_mean_over_a_clean_network(encrypt: bool) -> None:
    async with open_peers(4, encrypt=encrypt) as nets:
        inputs, outputs, results = await run_round(nets, make_groups(nets), WEIGHTS)
    assert check_pieces(inputs, outputs, results, WEIGHTS, range(4)) == 0
    expected = sum(w * x for w, x in zip(WEIGHTS, inputs, strict=True)) / sum(WEIGHTS)
    for out in outputs:
        assert torch.allclose(out, expected, atol=1e-5, rtol=0)
    for result in results:
        assert not result.failed_senders and not result.failed_reducers


async def test_loss_duplicates_and_reordering_average_only_what_arrived(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan = FaultPlan(datagrams=DatagramFaults(drop=0.2, duplicate=0.2, reorder=0.2, seed=7))
    caplog.set_level(logging.INFO, logger="averaging._lossy")
    async with open_peers(4) as nets:
        inputs, outputs, results = await run_round(nets, make_groups(nets), WEIGHTS, plan)
    # 20% of about 2 x 4 x 3 x 15 datagrams are lost: many pieces are partial.
    assert check_pieces(inputs, outputs, results, WEIGHTS, range(4)) > 0
    for result in results:  # losing pieces is not a failure of anybody
        assert not result.failed_senders and not result.failed_reducers
    # Each member says how much data its result holds, and the duplicates
    # were dropped as replays (the same piece twice).
    lines = [r.getMessage() for r in caplog.records if "lossy all-reduce" in r.getMessage()]
    assert len([line for line in lines if "senders' data in our result" in line]) == 4
    assert any("'replayed'" in line for line in lines), lines


async def test_everything_lost_keeps_local_values() -> None:
    plan = FaultPlan(datagrams=DatagramFaults(drop=1.0, seed=1))
    async with open_peers(3) as nets:
        inputs, outputs, results = await run_round(nets, make_groups(nets), WEIGHTS[:3], plan)
    for i, result in enumerate(results):
        for part in range(len(result.part_bounds)):
            # Our own part holds our data only; the others' results never came.
            assert set(result.contributors[part]) == {frozenset({i})}
        assert torch.equal(outputs[i], inputs[i])


async def test_a_lossy_resynchronisation_contracts_the_spread_geometrically() -> None:
    """The trainer's re-synchronisation in a lossy run (``trainer._drift``):
    parameters averaged over the lossy plane at 10% loss, three times. Each
    member that got a piece back holds the very same value there, one whose
    piece was lost keeps its own (``kept_own_fraction``), so no element's
    spread grows and most fall to 0: the mean squared spread shrinks at least
    by ``c = 1 - 0.9**3 = 0.27`` a round in expectation with four members
    (0.03-0.1 measured: a member that kept its own is rarely at an extreme),
    geometrically, not to 0 at once as over TCP."""
    n, total = 4, 120 * PIECE_ELEMENTS  # 30 pieces a part
    values = [torch.randn(total, generator=torch.Generator().manual_seed(40 + i)) for i in range(n)]

    def spread(xs: Sequence[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(list(xs))
        return stacked.max(0).values - stacked.min(0).values

    squared = [float(spread(values).pow(2).mean())]
    async with open_peers(n) as nets:
        groups = make_groups(nets)
        for seed in range(3):
            before = [x.clone() for x in values]
            plan = FaultPlan(datagrams=DatagramFaults(drop=0.1, seed=seed))
            results = await average_in_place(nets, groups, [[x] for x in values], [1.0] * n, plan)
            low = torch.stack(before).min(0).values
            high = torch.stack(before).max(0).values
            kept = [torch.zeros(total, dtype=torch.bool) for _ in range(n)]
            for i, result in enumerate(results):
                for part, (start, end) in enumerate(result.part_bounds):
                    for piece, who in enumerate(result.contributors[part]):
                        a = start + piece * PIECE_ELEMENTS
                        kept[i][a : min(a + PIECE_ELEMENTS, end)] = part != i and who <= {i}
                assert torch.equal(values[i][kept[i]], before[i][kept[i]])
                assert kept_own_fraction(result) == pytest.approx(float(kept[i].float().mean()))
                assert bool(((values[i] >= low - 1e-6) & (values[i] <= high + 1e-6)).all())
            came_back = ~torch.stack(kept)  # [member, element]
            for i in range(1, n):  # where both got it back, two members are equal
                both = came_back[0] & came_back[i]
                assert torch.equal(values[0][both], values[i][both])
            squared.append(float(spread(values).pow(2).mean()))
    for before_sq, after_sq in itertools.pairwise(squared):
        assert after_sq < 0.6 * before_sq, squared
    assert squared[-1] > 0  # ~27% of the elements kept someone's own values each time


async def test_client_and_auxiliary_members() -> None:
    modes = [MemberMode.NODE, MemberMode.CLIENT, MemberMode.AUX]
    async with open_peers(3) as nets:
        inputs, outputs, _ = await run_round(nets, make_groups(nets, modes), [1.0, 3.0, 0.0])
    expected = (inputs[0] + 3 * inputs[1]) / 4
    assert torch.allclose(outputs[0], expected, atol=1e-5, rtol=0)
    assert torch.allclose(outputs[1], expected, atol=1e-5, rtol=0)
    assert torch.equal(outputs[2], inputs[2])  # auxiliary: reduces, keeps its tensors


async def test_rounds_reuse_connections_and_keys_differ() -> None:
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        for _ in range(3):
            inputs, outputs, results = await run_round(nets, groups, [1.0, 1.0])
            assert check_pieces(inputs, outputs, results, [1.0, 1.0], range(2)) == 0


async def test_what_a_member_got_reaches_its_reducer_with_the_next_header() -> None:
    """No round waits for a member to say what it got of a reducer's
    results: the report rides on its next header to that peer. From the
    second round on, each reducer's pacer is fed one report per other member
    and round, each about the results of the round before."""
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        for rounds in range(1, 4):
            inputs, outputs, results = await run_round(nets, groups, WEIGHTS[:3])
            assert check_pieces(inputs, outputs, results, WEIGHTS[:3], range(3)) == 0
            assert [_pacers(net).late_reports for net in nets] == [2 * (rounds - 1)] * 3


class HeldHeaders:
    """A member's network whose lossy control streams wait for ``release``
    before its handler reads them: their headers arrive late."""

    def __init__(self, net: Connections, release: trio.Event) -> None:
        self._net = net
        self._release = release

    @property
    def peer_id(self) -> Any:
        return self._net.peer_id

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        async def held(stream: Any) -> None:
            await self._release.wait()
            await handler(stream)

        self._net.set_handler(name, held)

    def open_stream(self, peer_id: Any, address: tuple[str, int], name: str) -> Any:
        return self._net.open_stream(peer_id, address, name)

    def inbound_key_exporters(self, peer_id: Any) -> list[Callable[[bytes], bytes]]:
        return self._net.inbound_key_exporters(peer_id)


class CountPart(DatagramFilter):
    """Lets every datagram through; sets ``done`` once ``n`` datagrams of
    ``route`` went by."""

    def __init__(self, route: tuple[int, int, int], n: int, done: trio.Event) -> None:
        super().__init__(DatagramFaults(), random.Random(0))
        self.route, self.left, self.done = route, n, done

    def __call__(self, datagram: bytes) -> list[bytes]:
        if peek_route(datagram) == self.route:
            self.left -= 1
            if self.left == 0:
                self.done.set()
        return [datagram]


class CountAt(DatagramFaults):
    def __init__(self, member: int, counter: CountPart) -> None:
        super().__init__()
        self.member, self.counter = member, counter

    def filter(self, member: int) -> DatagramFilter:
        return self.counter if member == self.member else super().filter(member)


async def test_a_sender_starts_on_the_reducers_offer_before_its_header_is_read() -> None:
    """Member 1's handler reads member 0's header only after every datagram
    of member 0's part 1 reached member 1: member 0 learned member 1's port
    and round from member 1's own header (the offer), sent its part without
    a reply, and member 1 kept the datagrams until the header brought the
    keys. Waiting for the reply, as before the offer, member 0 would send
    nothing and member 1 would leave it out."""
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        part = Partition.for_group(groups[1], TOTAL, PIECE_ELEMENTS).part_bounds[1]
        pieces = -(-(part[1] - part[0]) // PIECE_ELEMENTS)
        release = trio.Event()
        counter = CountPart((int(Kind.PART), 1, 0), pieces, release)
        plan = FaultPlan(datagrams=CountAt(1, counter))
        held = HeldHeaders(nets[1], release)
        inputs = [member_data(0), member_data(1)]
        flats = [x.clone() for x in inputs]
        outcomes: list[Any] = [None, None]

        async def member(i: int, net: Any) -> None:
            outcomes[i] = await lossy_all_reduce(
                net,
                groups[i],
                flats[i],
                1.0,
                sender_timeout=2.0,
                round_timeout=15.0,
                fault_plan=plan,
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0, nets[0])
            nursery.start_soon(member, 1, held)
    assert release.is_set()
    mean = (inputs[0] + inputs[1]) / 2
    for i in range(2):
        assert not outcomes[i].failed_senders and not outcomes[i].failed_reducers
        assert all(who == {0, 1} for parts in outcomes[i].contributors for who in parts)
        assert torch.allclose(flats[i], mean, atol=1e-6, rtol=0)


class HeaderBehindTheRound(HeldHeaders):
    """A member's network whose first lossy control stream sets ``opened``
    when it comes (its connection exists here from then on) and is read
    only once ``release`` is set; ``handled`` is set when its handler
    returned, ``failure`` what it raised. Later streams are read at once."""

    def __init__(self, net: Connections, release: trio.Event, opened: trio.Event) -> None:
        super().__init__(net, release)
        self.opened = opened
        self.handled = trio.Event()
        self.failure: BaseException | None = None

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        async def held(stream: Any) -> None:
            if self.opened.is_set():
                await handler(stream)
                return
            self.opened.set()
            await self._release.wait()
            try:
                await handler(stream)
            except BaseException as e:
                self.failure = e
                raise
            finally:
                self.handled.set()

        self._net.set_handler(name, held)


async def test_a_round_proceeds_on_the_headers_datagram_copy() -> None:
    """Member 1 reads member 0's header from its stream only after the round
    ended. Member 0 started on member 1's offer (read once member 1 had the
    connection: ``opened``) and sent its header as a datagram too, under a
    key of that connection: member 1 serves the pair on the copy, and every
    piece holds both members' data. Without the copy member 1 would leave
    member 0 out after ``sender_timeout``. The stream, when it comes, gets
    the messages sent meanwhile and ends cleanly: the next round reuses its
    connection."""
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        release, opened = trio.Event(), trio.Event()
        held = HeaderBehindTheRound(nets[1], release, opened)
        inputs = [member_data(0), member_data(1)]
        nets_used = [HeldHeaders(nets[0], opened), held]
        outcomes: list[Any] = [None, None]

        async def member(i: int, flat: torch.Tensor) -> None:
            outcomes[i] = await lossy_all_reduce(
                nets_used[i], groups[i], flat, 1.0, sender_timeout=2.0, round_timeout=6.0
            )

        for round_ in range(2):
            flats = [x.clone() for x in inputs]
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(member, i, flats[i])
            for i in range(2):
                assert not outcomes[i].failed_senders and not outcomes[i].failed_reducers
                assert all(who == {0, 1} for parts in outcomes[i].contributors for who in parts)
                assert torch.allclose(flats[i], (inputs[0] + inputs[1]) / 2, atol=1e-6, rtol=0)
            if round_ == 0:
                assert not held.handled.is_set()
                release.set()
                await held.handled.wait()
                assert held.failure is None
                [entry] = nets[0]._pool[nets[1].peer_id]
                with trio.fail_after(5):  # its EOF and DONE on their way to member 0
                    await entry.settled.wait()
                assert entry.ready
        assert nets[0].dialed == 1  # the late stream's connection carried the second round


async def test_an_awaited_stream_sends_what_waited_in_order_and_refuses_another_header() -> None:
    """The reducer's side of a pair served on its header's copy: what it
    sent before the stream came reaches the sender first and in order, what
    it sends later follows, a receive waits for the stream; a stream whose
    header differs from the copy is refused, and so is every later receive
    or send of the pair."""
    async with open_peers(2) as nets:
        header = [LOSSY_VERSION, b"g", 1, 0, 1.0, 10, 4000, [], -1]
        awaited: list[_AwaitedStream] = []
        failures: list[BaseException] = []

        async def handler(stream: Any) -> None:
            try:
                await awaited[-1].attach(stream, await stream.receive())
            except ProtocolError as e:
                failures.append(e)
                raise

        nets[1].set_handler("awaited", handler)
        for sent_header in (header, [*header[:4], 2.0, *header[5:]]):
            pair = _AwaitedStream(nets[0].peer_id, lambda label: bytes(32), header)  # no keys used
            awaited.append(pair)
            await pair.send("reply")
            await pair.send("report")
            async with nets[0].open_stream(
                nets[1].peer_id, ("127.0.0.1", nets[1].port), "awaited"
            ) as stream:
                await stream.send(sent_header)
                if sent_header is header:
                    assert [await stream.receive(), await stream.receive()] == ["reply", "report"]
                    await pair.send("marker")
                    assert await stream.receive() == "marker"
                    await stream.send("sent")
                    assert await pair.receive() == "sent"
                    pair.served.set()
                    await stream.send_eof()
                else:
                    with pytest.raises(StreamResetError):
                        await stream.receive()
                    with pytest.raises(ProtocolError):
                        await pair.receive()
                    with pytest.raises(ProtocolError):
                        await pair.send("marker")
        assert len(failures) == 1


class HeldMarker:
    """A stream whose end-of-results marker (the ``sent`` after the
    ``report``) leaves only once ``release`` is set."""

    def __init__(self, stream: Any, release: trio.Event) -> None:
        self._stream = stream
        self._release = release
        self._reported = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def send(self, message: Any) -> None:
        if self._reported and message[0] == "sent":
            await self._release.wait()
        self._reported = self._reported or message[0] == "report"
        await self._stream.send(message)


class HeldMarkers(HeldHeaders):
    """A member's network whose reducer holds back every end-of-results marker
    until ``release``."""

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        async def held(stream: Any) -> None:
            await handler(HeldMarker(stream, self._release))

        self._net.set_handler(name, held)


async def test_a_member_leaves_without_the_markers_its_results_made_moot() -> None:
    """Member 1 holds back its end-of-results marker to member 0, whose
    results all arrived by datagram: member 0's round ends without it, and
    the connection it leaves discards the marker when it comes and is reused
    by the next round. Waiting for the marker a while instead (as before),
    member 0 left the connection to be closed by the marker, and the next
    round dialled."""
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        release = trio.Event()
        held = HeldMarkers(nets[1], release)
        inputs = [member_data(0), member_data(1)]
        outcomes: list[Any] = [None, None]

        async def member(i: int, net: Any, flat: torch.Tensor) -> None:
            outcomes[i] = await lossy_all_reduce(
                net, groups[i], flat, 1.0, sender_timeout=2.0, round_timeout=15.0
            )

        for _ in range(2):
            flats = [x.clone() for x in inputs]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 1, held, flats[1])
                await member(0, nets[0], flats[0])
                release.set()  # the first time: member 0 left without the marker
            for i in range(2):
                assert not outcomes[i].failed_senders and not outcomes[i].failed_reducers
                assert torch.allclose(flats[i], (inputs[0] + inputs[1]) / 2, atol=1e-6, rtol=0)
            await trio.testing.wait_all_tasks_blocked()
            [entry] = nets[0]._pool[nets[1].peer_id]
            assert entry.ready  # the marker discarded, the remote's EOF and DONE in
            assert nets[0].dialed == 1


class LateControl:
    """A stream whose control messages (``"sent"`` and ``"report"``) reach
    the reading end only once ``release`` is set, as over a link that lost
    every segment of them until then: a receive that returns one waits for
    ``release``, and a cancelled wait keeps the message for the next
    receive. Leaving messages unread counts the one kept as read."""

    def __init__(self, stream: Any, release: trio.Event) -> None:
        self._stream = stream
        self._release = release
        self._kept: Any = None
        self.held = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def receive(self) -> Any:
        if self._kept is None:
            message = await self._stream.receive()
            if not (isinstance(message, list) and message and message[0] in ("sent", "report")):
                return message
            self._kept = message
            self.held += 1
        await self._release.wait()
        message, self._kept = self._kept, None
        return message

    def leave_unread(self, messages: int) -> None:
        self._stream.leave_unread(messages - (self._kept is not None))


class LateControlNetwork(HeldHeaders):
    """A member's network whose lossy control streams, opened or accepted,
    are ``LateControl``."""

    def __init__(self, net: Connections, release: trio.Event) -> None:
        super().__init__(net, release)
        self.streams: list[LateControl] = []

    def late(self, stream: Any) -> LateControl:
        self.streams.append(LateControl(stream, self._release))
        return self.streams[-1]

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        async def late(stream: Any) -> None:
            await handler(self.late(stream))

        self._net.set_handler(name, late)

    @asynccontextmanager
    async def open_stream(
        self, peer_id: Any, address: tuple[str, int], name: str
    ) -> AsyncIterator[LateControl]:
        async with self._net.open_stream(peer_id, address, name) as stream:
            yield self.late(stream)


class DropLastPieces(DatagramFilter):
    """Drops the last piece of every part and every result (the only short
    ones here): only a marker can tell that a sender is done."""

    def __init__(self) -> None:
        super().__init__(DatagramFaults(), random.Random(0))

    def __call__(self, datagram: bytes) -> list[bytes]:
        kind, short = datagram[2], len(datagram) < FULL_DATAGRAM
        return [] if kind in (Kind.PART, Kind.RESULT) and short else [datagram]


class DropLastPiecesEverywhere(DatagramFaults):
    def filter(self, member: int) -> DatagramFilter:
        return DropLastPieces()


async def test_a_round_ends_on_its_control_messages_datagram_copies(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every end-of-sending marker and report on the streams of two members
    arrives only after their rounds (held back at the reading end), and the
    last datagram of every part and result is lost: the rounds end on the
    markers' and reports' datagram copies, with every piece averaged as
    reported. Before the copies, each member waited for its reducer's report
    until the round's deadline and kept its own values. A marker's copy
    comes after every datagram it speaks of, on their flow, so a phase ends
    on it at once: with ``DRAIN`` at a minute the rounds still end in
    seconds (waiting ``DRAIN`` for a lost last datagram, as before, they
    timed out). Two rounds: the stream copies left unread are discarded by
    the pooled connections, which the second round reuses."""
    monkeypatch.setattr(lossy_module, "DRAIN", 60.0)
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        part = Partition.for_group(groups[0], TOTAL, PIECE_ELEMENTS)
        assert all((hi - lo) % PIECE_ELEMENTS for lo, hi in part.part_bounds)  # short last pieces
        release = trio.Event()
        late = [LateControlNetwork(net, release) for net in nets]
        plan = FaultPlan(datagrams=DropLastPiecesEverywhere())
        inputs = [member_data(0), member_data(1)]
        caplog.set_level(logging.INFO, logger="averaging._lossy")
        first_dials: list[int] = []
        flats: list[torch.Tensor] = []
        outcomes: list[Any] = [None, None]

        async def member(i: int) -> None:
            outcomes[i] = await lossy_all_reduce(
                late[i],
                groups[i],
                flats[i],
                1.0,
                sender_timeout=2.0,
                round_timeout=15.0,
                fault_plan=plan,
            )

        for round_ in range(2):
            flats[:] = [x.clone() for x in inputs]
            caplog.clear()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member, 0)
                nursery.start_soon(member, 1)
            # as a sender a report and an end of results, as a reducer an end of sending
            taken = [
                r.getMessage() for r in caplog.records if "control taken from" in r.getMessage()
            ]
            assert len(taken) == 2
            assert all(line.endswith("control taken from: {'datagram copy': 3}") for line in taken)
            # each stream held back the first control message read from it
            assert sorted(s.held for s in late[0].streams + late[1].streams) == [1, 1, 1, 1]
            for i, outcome in enumerate(outcomes):
                assert not outcome.timed_out
                assert not outcome.failed_senders and not outcome.failed_reducers
                for p, (lo, hi) in enumerate(part.part_bounds):
                    whole = part.part_size(p) // PIECE_ELEMENTS
                    # the last piece: the sender's or the result lost, our own values
                    assert outcome.contributors[p] == (frozenset({0, 1}),) * whole + (
                        frozenset({i}),
                    )
                    both = slice(lo, lo + whole * PIECE_ELEMENTS)
                    mean = (inputs[0][both] + inputs[1][both]) / 2
                    assert torch.allclose(flats[i][both], mean, atol=1e-6, rtol=0), (i, p)
                    ours = slice(lo + whole * PIECE_ELEMENTS, hi)
                    assert torch.equal(flats[i][ours], inputs[i][ours])
            late[0].streams.clear()
            late[1].streams.clear()
            await trio.testing.wait_all_tasks_blocked()
            dials = [net.dialed for net in nets]
            if round_ == 0:
                first_dials = dials
        assert dials == first_dials  # the second round found the connections in the pool


class AlteredReports(HeldHeaders):
    """A member's network whose reducer's reports on the streams say another
    time than their datagram copies (sealed before the change)."""

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None:
        async def altered(stream: Any) -> None:
            await handler(AlteredReport(stream))

        self._net.set_handler(name, altered)


class AlteredReport:
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def send(self, message: Any) -> None:
        if message[0] == "report":
            message = [*message[:2], message[2] + 1.0, *message[3:]]
        await self._stream.send(message)


class ReportAfterItsCopy(LateControl):
    """A stream that hands out a report only once ``release`` is set and
    every task that could run has run (its datagram copy, delivered when
    ``release`` was set, acted on); the other control messages at once."""

    async def receive(self) -> Any:
        if self._kept is None:
            message = await self._stream.receive()
            if message[0] != "report":
                return message
            self._kept = message
        await self._release.wait()
        await trio.testing.wait_all_tasks_blocked()
        message, self._kept = self._kept, None
        return message


class ReportAfterCopy(LateControlNetwork):
    def late(self, stream: Any) -> LateControl:
        return ReportAfterItsCopy(stream, self._release)


class CopyFirst(DatagramFilter):
    """Member 0's receiver: sets ``report`` as the report's datagram copy
    from reducer 1 goes by (it is delivered before anything else runs), and
    drops the copies of reducer 1's end of results and its last result
    piece, so that the marker can come only by stream, behind its report."""

    def __init__(self, report: trio.Event) -> None:
        super().__init__(DatagramFaults(), random.Random(0))
        self.report = report

    def __call__(self, datagram: bytes) -> list[bytes]:
        fields = HEADER.unpack_from(datagram)
        kind, part, sender, index = fields[2], fields[5], fields[6], fields[7]
        if (kind, part, sender) == (Kind.REDUCER_CONTROL, 1, 0):
            if index > 0:  # a message after the report
                return []
            self.report.set()
        if (kind, part, sender) == (Kind.RESULT, 1, 0) and len(datagram) < FULL_DATAGRAM:
            return []
        return [datagram]


class CopyFirstAt(DatagramFaults):
    def __init__(self, report: trio.Event) -> None:
        super().__init__()
        self.report = report

    def filter(self, member: int) -> DatagramFilter:
        return CopyFirst(self.report) if member == 0 else super().filter(member)


async def test_a_report_whose_stream_copy_differs_from_the_datagram_copy_is_refused() -> None:
    """Reducer 1's report on its stream to member 0 differs from the
    datagram copy that member 0 acted on, and member 0 reads it (behind it
    comes the end of results, which has no other way through): member 0
    refuses the reducer, keeps its own values of part 1, and still averages
    its own part with member 1's values."""
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        bounds = Partition.for_group(groups[0], TOTAL, PIECE_ELEMENTS).part_bounds
        report = trio.Event()
        plan = FaultPlan(datagrams=CopyFirstAt(report))
        members = [ReportAfterCopy(nets[0], report), AlteredReports(nets[1], trio.Event())]
        inputs = [member_data(0), member_data(1)]
        flats = [x.clone() for x in inputs]
        outcomes: list[Any] = [None, None]

        async def member(i: int) -> None:
            outcomes[i] = await lossy_all_reduce(
                members[i],
                groups[i],
                flats[i],
                1.0,
                sender_timeout=2.0,
                round_timeout=15.0,
                fault_plan=plan,
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member, 0)
            nursery.start_soon(member, 1)
    assert outcomes[0].failed_reducers == {1} and not outcomes[0].failed_senders
    (lo0, hi0), (lo1, hi1) = bounds
    assert torch.equal(flats[0][lo1:hi1], inputs[0][lo1:hi1])
    mean = (inputs[0][lo0:hi0] + inputs[1][lo0:hi0]) / 2
    assert torch.allclose(flats[0][lo0:hi0], mean, atol=1e-6, rtol=0)


async def test_lossy_needs_raw_float32_and_the_mean() -> None:
    from averaging import CenteredClip

    with pytest.raises(ConfigError):
        AllReduceConfig(lossy=True, aggregation=CenteredClip(tau=1.0))
    async with open_peers(2) as nets:
        groups = make_groups(nets)
        with pytest.raises(ConfigError):
            await all_reduce(nets[0], groups[0], [torch.zeros(10)], config=LOSSY, codec=FLOAT16)


async def test_control_streams_that_break_the_rules_are_refused() -> None:
    """Member 0 runs a round with member 1, which never shows up; peer 2, not
    a member, opens control streams to member 0 by hand: claiming member 1's
    index, another version, a malformed report on earlier results, or naming
    a group member 0 does not run. Each is refused with a one-line reason,
    and member 0 ends with its own values and member 1 out."""
    async with open_peers(3) as nets:
        groups = make_groups(nets[:2])
        x = member_data(0)
        results: list[AllReduceResult] = []

        async def member0() -> None:
            results.append(await all_reduce(nets[0], groups[0], [x], config=LOSSY))

        async def refused(header: list[object], reason: str) -> None:
            with pytest.raises(SwarmError, match=reason):
                async with nets[2].open_stream(
                    nets[0].peer_id, ("127.0.0.1", nets[0].port), LOSSY_STREAM
                ) as stream:
                    await stream.send(header)
                    await stream.receive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(member0)
            gid = groups[0].group_id
            await refused([LOSSY_VERSION, gid, 0, 1, 1.0, TOTAL, 9, [], -1], "another peer")
            await refused([LOSSY_VERSION + 1, gid, 0, 1, 1.0, TOTAL, 9, [], -1], "version")
            await refused([LOSSY_VERSION, gid, 0, 1, 1.0, TOTAL, 9, [1, 2], -1], "results received")
            await refused([LOSSY_VERSION, gid, 0, 1, 1.0, TOTAL, 9, [1, -2, 0.0], -1], "received")
            await refused([LOSSY_VERSION, gid, 0, 1, 1.0, TOTAL, 9, [], -2], "offered round")
            await refused(
                [LOSSY_VERSION, b"nope", 0, 1, 1.0, TOTAL, 9, [], -1], "no lossy all-reduce"
            )
    assert results[0].failed_senders == {1} and results[0].failed_reducers == {1}
    assert torch.equal(x, member_data(0))


def burst_of(n: int, last: int, seed: int) -> list[bytes]:
    """``n`` datagrams of distinct random bytes, all full but the last (``last`` bytes)."""
    rng = random.Random(seed)
    sizes = [FULL_DATAGRAM] * (n - 1) + [last]
    return [rng.randbytes(size) for size in sizes]


async def receive_all(receiver: socket.socket, n: int) -> list[bytes]:
    got = []
    with trio.fail_after(5):
        while len(got) < n:
            await trio.lowlevel.wait_readable(receiver)
            got.append(receiver.recv(2048))
    return got


@pytest.mark.parametrize(
    "n, last, segment, stays_segmented",
    [
        (32, 100, True, True),  # one segmented send, cut into 32 datagrams
        (32, 100, False, False),  # no segmentation: one send per datagram
        (1, FULL_DATAGRAM, True, True),  # a single datagram needs no segmentation
        # 67,152 bytes: over what one send may carry; the kernel refuses, and
        # the burst goes again one datagram at a time, as do all after it
        (48, FULL_DATAGRAM, True, False),
    ],
)
async def test_a_burst_arrives_as_exactly_its_datagrams(
    n: int, last: int, segment: bool, stays_segmented: bool
) -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver,
    ):
        for sock in (sender, receiver):
            sock.setblocking(False)
        segmented, _, _ = _tune(sender)  # large buffers; UDP_SEGMENT where Linux has it
        assert segmented, "this kernel segments UDP sends (Linux 4.18 and later)"
        receiver.bind(("127.0.0.1", 0))
        burst = burst_of(n, last, seed=n)
        address = receiver.getsockname()
        assert await send_burst(sender, burst, address, segment) is stays_segmented
        assert await receive_all(receiver, n) == burst
        # and nothing more came
        with pytest.raises(BlockingIOError):
            receiver.recv(2048)


@pytest.mark.parametrize("n, last", [(32, 100), (46, FULL_DATAGRAM), (1, 100)])
async def test_a_coalesced_read_is_cut_into_exactly_the_datagrams_sent(n: int, last: int) -> None:
    """A segmented send arrives at a socket that coalesces (``UDP_GRO``) as
    few reads, which ``_segments`` cuts back into the datagrams sent, with
    the kernel's receive time."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver,
    ):
        for sock in (sender, receiver):
            sock.setblocking(False)
        _tune(sender)
        _, stamped, coalesced = _tune(receiver)
        assert stamped and coalesced, "this kernel coalesces UDP reads (Linux 5.0 and later)"
        receiver.bind(("127.0.0.1", 0))
        burst = burst_of(n, last, seed=n)
        before = time.time()
        assert await send_burst(sender, burst, receiver.getsockname(), True)
        got: list[bytes] = []
        reads = 0
        space = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(4)
        with trio.fail_after(5):
            while len(got) < n:
                await trio.lowlevel.wait_readable(receiver)
                data, cmsgs, _, _ = receiver.recvmsg(65535, space)
                when, datagrams = _segments(data, cmsgs)
                assert before - 1 <= when <= time.time() + 1  # the kernel's clock
                got += datagrams
                reads += 1
        assert got == burst
        assert reads < n or n == 1


class DropFirstPieces(DatagramFilter):
    """Drops the first piece of every part and every result (a full piece:
    the last ones are short here), so every phase misses one piece but
    receives its last datagram."""

    def __init__(self) -> None:
        super().__init__(DatagramFaults(), random.Random(0))

    def __call__(self, datagram: bytes) -> list[bytes]:
        kind, piece = datagram[2], HEADER.unpack_from(datagram)[7]
        return [] if kind in (Kind.PART, Kind.RESULT) and piece == 0 else [datagram]


class DropFirstPiecesEverywhere(DatagramFaults):
    def filter(self, member: int) -> DatagramFilter:
        return DropFirstPieces()


async def test_a_phase_whose_last_datagram_arrived_waits_no_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A phase that lost a piece but received the last datagram its remote
    sends ends at once: on a path that keeps datagrams in order nothing sent
    before the last is still on its way. With ``DRAIN`` at a minute, a round
    whose every phase misses its first piece still ends in seconds, each of
    those pieces left out of the estimate."""
    monkeypatch.setattr(lossy_module, "DRAIN", 60.0)
    async with open_peers(3) as nets:
        groups = make_groups(nets)
        part = Partition.for_group(groups[0], TOTAL, PIECE_ELEMENTS)
        assert all((hi - lo) % PIECE_ELEMENTS for lo, hi in part.part_bounds)  # short last pieces
        weights = WEIGHTS[:3]
        with trio.fail_after(30):
            inputs, outputs, results = await run_round(
                nets, groups, weights, FaultPlan(datagrams=DropFirstPiecesEverywhere())
            )
        partial = check_pieces(inputs, outputs, results, weights, range(3))
        assert partial > 0  # the first pieces were lost, and left out
