"""A pipelined ring all-reduce, for groups whose links are alike.

In the butterfly (``_allreduce``) every member sends to every other, so each
uplink and each downlink carries n - 1 TCP flows at once. Those flows start
and stop as their windows and results allow, and congestion control hands a
link back and forth between them too slowly to keep it full: on 4 peers x
100 Mbit/s its uploads sat below 80% of the link in 40% of 10 ms steps while
bytes were waiting (``benchmarks/allreduce.py --timeline``). A ring carries
one flow per link, from member i to member i + 1, busy all round.

The parts and chunks are the butterfly's (``Partition``). Member i sends, in
this order: the weighted sums of part i - 1 (its own data), then one item
for each item that arrives from member i - 1, in the order they arrive:

- the running sum of chunk c of part p (p != i): it adds its weighted values
  and forwards it; member p + 1 started it, member p ends it;
- the running sum of part i: the last one; it divides by the weight sum and
  sends the result on (``RESULT``), keeping it;
- a result of part p: it keeps it and forwards it, unless member i + 1
  reduced it (then everyone has it).

Each item that arrives was sent one part earlier than the item it becomes,
so as long as chunks arrive as fast as they leave, no link ever waits
(the pipelined ring of Patarasuk and Yuan, J. Parallel Distrib. Comput. 2009).
Every member ends with the same bits: the reducer's.

Wire protocol of the stream (name ``RING_STREAM``) from member i - 1 to i:
a header ``[version, group_id, sender, weight]`` (the sender's weight: it
adds no more, as a butterfly sender's header says; ``sender_weights``),
then per item a raw frame ``u8
kind | u32 part | u32 chunk | f64 weight sum | contributor mask`` (the mask
as ``_allreduce``'s) and, unless the mask is empty, a raw frame with the
float32 values. An empty mask: nobody with weight > 0 is in the sum yet, or
the sum of finite values overflowed float32 (kind ``OVERFLOW``), or the
result has none; then every member keeps its local values there.

A member whose weighted values would make a running sum NaN or Inf (its own
data is not finite, or the sum overflows) leaves itself out of that chunk.
A running sum or result that arrives with NaN or Inf breaks the protocol,
and its sender is banned.

Faults: the ring needs every member. Any failure (a stream that does not
open, breaks or stalls for ``reducer_timeout``, a broken protocol) ends it
at this member, which closes both of its streams so that its neighbours
notice at once, and so on around the ring. Results are kept apart from the
local values until the ring has finished, so a member whose ring failed
still holds its local values and can fall back to the butterfly
(``all_reduce`` does), which leaves a failed member out. A result from our
predecessor arrives straight in that vector, checked there, so the values
of a finished ring are copied once, into place at the end (on loopback,
4 x 25M floats, that copy less took 13-17 ms of CPU per peer and round).

Threads: the items from our predecessor are received, checked, added to and
put in place by one worker thread (``Stream.receive_sequence``); the trio
thread forwards what they become to our successor's stream, in batches.
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, AsyncExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
import trio

from swarm import PeerID, ProtocolError, SwarmError
from swarm._wire import expect_bytes, expect_int, expect_list

from ._codecs import all_finite
from ._group import Group, contributor_mask, mask_members, mask_size
from ._link_meter import RoundTraffic
from ._partition import Partition, ring_members
from ._rounds import RoundsByGroup

logger = logging.getLogger(__name__)

#: Name of the stream (connection handler) of the ring all-reduce.
RING_STREAM = "allreduce-ring"
RING_VERSION = 2
#: How long a ring stream for a group this peer does not (yet) run waits for
#: that round to start before it is refused (as ``UNKNOWN_GROUP_WAIT``).
RING_GROUP_WAIT = 2.0
#: The item kinds.
SUM = 0
RESULT = 1
#: a running sum of finite values that overflowed float32: it has no result
OVERFLOW = 2
_ITEM = struct.Struct("<BIId")
#: At most this many bytes of values go to the connection in one send
#: (``_send_all``), unless one item has more.
SEND_BATCH_BYTES = 4 * 2**20
#: What breaks a ring at a member: a peer's failure (``SwarmError``), a
#: deadline, a send to a stream that broke.
_BREAKS = (SwarmError, trio.TooSlowError, trio.BrokenResourceError)


def ring_eligible(group: Group, partition: Partition) -> bool:
    """Whether ``group`` can run the ring: at least two members, each a node
    (one that accepts connections and has data), with parts alike (within
    1%). Parts cut in proportion to unequal links are not: every link of a
    ring carries nearly two vectors' worth whatever the parts, so the
    slowest uplink would set the pace, where the butterfly gives it less to
    send. Members whose uploads are alike within 10% get equal
    parts when the ring may run (``_partition.RING_UPLOAD_SPREAD``), so
    measurement noise does not keep them off it. Every member computes the
    same from the group."""
    sizes = [partition.part_size(j) for j in range(group.size)]
    return (
        ring_members(group.members)
        and min(sizes) > 0
        and max(sizes) - min(sizes) <= max(sizes) // 100
    )


@dataclass(frozen=True)
class RingOutcome:
    """A finished ring: ``contributors[j][c]`` is whose data is in chunk c of
    part j (empty: it has no result, and keeps the local values)."""

    contributors: tuple[tuple[frozenset[int], ...], ...]


class RingFailed(SwarmError):
    """The ring did not finish here; the local values are untouched."""


class _Item:
    """One item that arrived or leaves: a running sum or a result of one chunk."""

    __slots__ = ("buffer", "chunk", "kind", "members", "part", "values", "weight")

    def __init__(
        self,
        kind: int,
        part: int,
        chunk: int,
        weight: float,
        members: frozenset[int],
        values: torch.Tensor | None,
        buffer: bytearray | None = None,
    ) -> None:
        self.kind = kind
        self.part = part
        self.chunk = chunk
        self.weight = weight
        self.members = members
        self.values = values
        #: the pooled buffer ``values`` lives in, if any: given back once sent
        self.buffer = buffer


class _Ring:
    """One member's ring round (module docstring)."""

    def __init__(
        self,
        group: Group,
        partition: Partition,
        flat: torch.Tensor,
        weight: float,
        reducer_timeout: float,
        spares: _Spares,
        upload_pacing: float | None = None,
        traffic: RoundTraffic | None = None,
    ) -> None:
        self.group = group
        #: where the round's sends and receives are timed for the link meter
        self.traffic = traffic
        #: our whole upload goes to our successor: its stream's pace
        self.upload_pacing = upload_pacing
        self.partition = partition
        self.flat = flat
        self.weight = weight
        self.reducer_timeout = reducer_timeout
        n, me = group.size, group.local_index
        self.me = me
        self.prev = (me - 1) % n
        self.next = (me + 1) % n
        #: results, kept apart from the local values until the ring finished
        self.results = spares.take_results(flat.numel())
        self.contributors: list[list[frozenset[int]]] = [
            [frozenset()] * partition.num_chunks(j) for j in range(n)
        ]
        self._incoming_send, self._incoming = trio.open_memory_channel[tuple[Any, trio.Event]](0)
        self._chunk_bytes = 4 * partition.chunk_elements
        self._pool = spares.pool(self._chunk_bytes)
        self._failed = False

    # --------------------------------------------------------------- streams

    def check_header(self, remote: PeerID, message: Any) -> None:
        """Raises ``ProtocolError`` unless ``message`` opens this round's ring
        stream from our predecessor."""
        fields = expect_list(message, 4, "ring header")
        if expect_int(fields[0], "version") != RING_VERSION:
            raise ProtocolError(f"ring protocol version {fields[0]}, expected {RING_VERSION}")
        if expect_int(fields[2], "sender") != self.prev:
            raise ProtocolError(f"ring stream from member {fields[2]}, expected {self.prev}")
        if remote != self.group.members[self.prev].peer_id:
            raise ProtocolError(f"member {self.prev} of the group is another peer")
        weight = fields[3]
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ProtocolError("ring header: the weight is not a number")
        if not (math.isfinite(weight) and weight >= 0):
            raise ProtocolError(f"ring header: weight {weight} is not a finite number >= 0")

    async def accept(self, stream: Any) -> None:
        """Hand our predecessor's stream to the round; return when it is done."""
        done = trio.Event()
        try:
            await self._incoming_send.send((stream, done))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ProtocolError("the ring round no longer accepts its stream") from None
        await done.wait()
        if self._failed:  # reset, so that our predecessor notices at once
            raise ProtocolError("the ring failed at this member")

    # ------------------------------------------------------------------ run

    async def run(self, net: Any) -> RingOutcome:
        """Run the ring; raises ``RingFailed`` (local values untouched) if it
        does not finish. Cancellation leaves the local values untouched too."""
        outgoing_send, outgoing = trio.open_memory_channel[_Item](math.inf)
        try:
            with self._incoming:
                async with trio.open_nursery() as nursery:
                    # Our own part leaves as soon as our successor accepts, and
                    # our predecessor's items are taken meanwhile: a ring that
                    # broke behind us ends here at once, not once we connected.
                    nursery.start_soon(self._downstream, net, outgoing)
                    async with outgoing_send:
                        await self._own_part(outgoing_send)
                        with trio.fail_after(self.reducer_timeout):
                            upstream, done = await self._incoming.receive()
                        try:
                            await self._receive_all(upstream, outgoing_send)
                        except ProtocolError as e:
                            self._failed = True
                            self._blame_predecessor(net, e)
                            raise
                        except BaseException:
                            self._failed = True  # before the handler wakes: it resets
                            raise
                        finally:
                            done.set()
        except _BREAKS as e:
            self._failed = True
            raise RingFailed(f"the ring broke at member {self.me}: {e!r}") from e
        except BaseExceptionGroup as group:  # from the nursery: one task's failure
            self._failed = True
            _, others = group.split(_BREAKS)
            if others is not None:
                raise
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise RingFailed(f"the ring broke at member {self.me}: {first!r}") from first
        except BaseException:
            self._failed = True
            raise
        self.flat.copy_(self.results)
        return RingOutcome(tuple(tuple(c) for c in self.contributors))

    async def _downstream(self, net: Any, items: trio.MemoryReceiveChannel[_Item]) -> None:
        """Open our stream to our successor, then send it every item."""
        member = self.group.members[self.next]
        async with AsyncExitStack() as stack:
            with trio.fail_after(self.reducer_timeout):
                stream = await stack.enter_async_context(
                    net.open_stream(member.peer_id, member.address, RING_STREAM)
                )
                await stream.send([RING_VERSION, self.group.group_id, self.me, self.weight])
            if self.upload_pacing is not None:
                stream.pace(self.upload_pacing)
                stack.callback(stream.pace, None)  # the connection goes back to the pool
            await self._send_all(stream, items)

    def _blame_predecessor(self, net: Any, error: ProtocolError) -> None:
        """Our predecessor broke the protocol (a malformed item, NaN or Inf:
        each member forwards only finite values it checked): it is banned,
        as a butterfly reducer bans a sender for the same."""
        peer = self.group.members[self.prev].peer_id
        net.report_offence(peer, f"ring all-reduce: {error}")

    def _take(self) -> bytearray:
        # the receiving worker thread and the trio thread both take and give
        try:
            return self._pool.pop()
        except IndexError:
            return bytearray(self._chunk_bytes)

    def _values(self, buffer: bytearray, size: int) -> torch.Tensor:
        return torch.frombuffer(buffer, dtype=torch.float32, count=size)

    def _local(self, part: int, chunk: int) -> torch.Tensor:
        start, _ = self.partition.part_bounds[part]
        a, b = self.partition.chunk_bounds(part, chunk)
        return self.flat[start + a : start + b]

    async def _own_part(self, outgoing: trio.MemorySendChannel[_Item]) -> None:
        """The running sums that start here: our weighted values of part ``prev``."""
        part = self.prev
        for chunk in range(self.partition.num_chunks(part)):
            await outgoing.send(self._add(_Item(SUM, part, chunk, 0.0, frozenset(), None)))
            await trio.lowlevel.checkpoint()

    async def _receive_all(self, stream: Any, outgoing: trio.MemorySendChannel[_Item]) -> None:
        """Take each item from our predecessor and hand on what it becomes.

        One worker thread receives them all (``Stream.receive_sequence``) and
        does the work of each (``_placed``): checking it, adding our values,
        reducing our part, putting results in place. The trio thread only
        forwards what they become, in batches: per item it had handed the
        values frame to a thread and back and opened the header, most of its
        samples on loopback at 2M floats (``docs/home-links.md``)."""
        n = self.group.size
        sums = [(self.prev - 1 - s) % n for s in range(n - 1)]
        results = [(self.prev - t) % n for t in range(n - 1)]
        expected = [
            (kind, part, chunk)
            for kind, parts in ((SUM, sums), (RESULT, results))
            for part in parts
            for chunk in range(self.partition.num_chunks(part))
        ]
        receipts = _Receipts()
        order = iter(expected)

        def place(header: memoryview) -> tuple[memoryview | None, Callable[[], _Item | None]]:
            return self._placed(header, *next(order), receipts)

        try:
            async with stream.receive_sequence(len(expected), place) as items:
                while True:
                    with trio.fail_after(self.reducer_timeout):
                        batch = await items.next_batch()
                    if not batch:
                        return
                    for out in batch:
                        if out is not None:
                            outgoing.send_nowait(out)
        finally:
            if self.traffic is not None:
                self.traffic.add_received(receipts.bytes, receipts.busy)

    def _placed(
        self, header: memoryview, kind: int, part: int, chunk: int, receipts: _Receipts
    ) -> tuple[memoryview | None, Callable[[], _Item | None]]:
        """In the receiving worker thread: the buffer for the values of the
        item ``header`` opens, which must be ``kind`` (or, for a sum,
        ``OVERFLOW``) of ``part``'s ``chunk``, and what makes the item to
        forward once they are there (None: nothing to forward).
        ``ProtocolError`` for anything else, and for values that are not all
        finite (a sum's are checked once ours are added: ``_add``)."""
        if len(header) != _ITEM.size + mask_size(self.group.size):
            raise ProtocolError(f"ring item header of {len(header)} bytes")
        got_kind, got_part, got_chunk, weight = _ITEM.unpack_from(header)
        if kind == SUM and got_kind == OVERFLOW:
            kind = OVERFLOW
        if (got_kind, got_part, got_chunk) != (kind, part, chunk):
            raise ProtocolError(
                f"ring item {(got_kind, got_part, got_chunk)} out of order,"
                f" expected {(kind, part, chunk)}"
            )
        members = mask_members(header[_ITEM.size :], self.group.size)
        valid = math.isfinite(weight) and weight >= 0 and (weight > 0) == bool(members)
        if not valid or (kind == OVERFLOW and members):
            raise ProtocolError(f"ring item with weight sum {weight} and members {sorted(members)}")
        values = buffer = view = None
        if members:
            if kind == RESULT:  # straight into place: kept apart until the end
                values = self._local_result(part, chunk)
                view = values.numpy().data.cast("B")
            else:
                a, b = self.partition.chunk_bounds(part, chunk)
                buffer = self._take()
                view = memoryview(buffer)[: 4 * (b - a)]
                values = self._values(buffer, b - a)
        item = _Item(kind, part, chunk, weight, members, values, buffer)
        started = time.monotonic()

        def complete() -> _Item | None:
            if view is not None:
                receipts.add(view.nbytes, time.monotonic() - started)
            if kind == RESULT or self.weight == 0:  # else ``_add`` checks the sum
                _check_finite(item)
            return self._result(item) if kind == RESULT else self._sum(item)

        return view, complete

    def _sum(self, item: _Item) -> _Item:
        """A running sum from our predecessor, with our weighted values added:
        the item to forward, or (our part) the result."""
        item = self._add(item)
        return item if item.part != self.me else self._reduce(item)

    def _add(self, item: _Item) -> _Item:
        """The running sum ``item`` with our weighted values added; as it is
        if our weight is 0 or our values are not finite; ``OVERFLOW`` if the
        sum of finite values is not."""
        if self.weight == 0 or item.kind == OVERFLOW:
            return item
        x = self._local(item.part, item.chunk)
        if item.values is None and self.weight == 1.0:
            if not all_finite(x):
                return item
            # the first value of the sum: sent from the vector itself, which
            # the ring does not change (results go elsewhere until the end)
            return _Item(SUM, item.part, item.chunk, 1.0, frozenset({self.me}), x)
        out_buffer = self._take()
        out = self._values(out_buffer, x.numel())
        if item.values is None:
            torch.mul(x, self.weight, out=out)
        else:
            torch.add(item.values, x, alpha=self.weight, out=out)
        # One pass checks both: the sum of finite values with a NaN or an Inf
        # is not finite. Only a sum that is not tells whose values were.
        if not all_finite(out):
            self._pool.append(out_buffer)
            _check_finite(item)
            if item.values is None or not all_finite(x):
                return item  # our values would spoil the sum: it goes on without them
            self._give(item)
            return _Item(OVERFLOW, item.part, item.chunk, 0.0, frozenset(), None)
        self._give(item)
        weight, members = item.weight + self.weight, item.members | {self.me}
        return _Item(SUM, item.part, item.chunk, weight, members, out, out_buffer)

    def _give(self, item: _Item) -> None:
        """``item``'s buffer goes back to the pool (its values are used up)."""
        if item.buffer is not None:
            self._pool.append(item.buffer)
            item.buffer = None

    def _reduce(self, item: _Item) -> _Item:
        """The last running sum of a chunk of our part: its result, kept and
        sent on. No result (every member keeps its local values) if nobody
        with weight > 0 is in it, or the sum overflowed."""
        result = self._local_result(item.part, item.chunk)
        members = item.members
        if item.values is not None:
            torch.div(item.values, item.weight, out=result)
            if not all_finite(result):
                members = frozenset()
        if not members:
            result.copy_(self._local(item.part, item.chunk))
        self._give(item)
        self.contributors[item.part][item.chunk] = members
        weight = item.weight if members else 0.0
        return _Item(RESULT, item.part, item.chunk, weight, members, result if members else None)

    def _result(self, item: _Item) -> _Item | None:
        """A result from our predecessor: kept (its values arrived in place,
        ``_receive_item``), and sent on unless our successor reduced it."""
        result = self._local_result(item.part, item.chunk)
        if item.values is None:
            result.copy_(self._local(item.part, item.chunk))
        self.contributors[item.part][item.chunk] = item.members
        if item.part == self.next:
            return None
        values = result if item.members else None
        return _Item(RESULT, item.part, item.chunk, item.weight, item.members, values)

    def _local_result(self, part: int, chunk: int) -> torch.Tensor:
        start, _ = self.partition.part_bounds[part]
        a, b = self.partition.chunk_bounds(part, chunk)
        return self.results[start + a : start + b]

    async def _send_all(self, stream: Any, items: trio.MemoryReceiveChannel[_Item]) -> None:
        """Send the items in order. The items ready are sent together, up to
        ``SEND_BATCH_BYTES``: each send ends with the trio thread handing the
        next one to the connection's worker thread, and on a full link every
        such hand-over that comes late leaves the link idle."""
        async with items:
            async for first in items:
                batch = [first]
                size = self._frames_size(first)
                while size < SEND_BATCH_BYTES:
                    try:
                        batch.append(items.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break  # none ready, or none to come: ``async for`` ends
                    size += self._frames_size(batch[-1])
                frames = [frame for item in batch for frame in self._frames(item)]
                with trio.fail_after(self.reducer_timeout), self._sending(stream, frames):
                    await stream.send_bytes_batch(frames)
                for item in batch:
                    self._give(item)

    def _sending(
        self, stream: Any, frames: list[bytes | memoryview]
    ) -> AbstractContextManager[None]:
        """Times a send to our successor for the link meter, as the butterfly
        times its sends (``_link_meter``): the bytes its connection had
        acknowledged while the send ran count."""
        if self.traffic is None:
            return nullcontext()
        return self.traffic.sending(sum(memoryview(f).nbytes for f in frames), stream)

    def _frames(self, item: _Item) -> list[bytes | memoryview]:
        header = _ITEM.pack(item.kind, item.part, item.chunk, item.weight)
        header += contributor_mask(item.members, self.group.size)
        if item.values is None:
            return [header]
        return [header, item.values.numpy().data.cast("B")]

    @staticmethod
    def _frames_size(item: _Item) -> int:
        return 0 if item.values is None else 4 * item.values.numel()


class _Receipts:
    """Values bytes the receiving worker thread took in, and for how long it
    waited for them after their headers: the link meter's download sample
    (``RoundTraffic.add_received``), timed there, as the trio clock cannot be."""

    def __init__(self) -> None:
        self.bytes = 0
        self.busy = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.busy += seconds


def _check_finite(item: _Item) -> None:
    """``ProtocolError`` if an item that arrived holds NaN or Inf."""
    if item.values is not None and not all_finite(item.values):
        raise ProtocolError(f"NaN or Inf in ring item {(item.kind, item.part, item.chunk)}")


class _Spares:
    """Memory a peer's ring rounds reuse: touching fresh memory page by page
    costs more than the additions (as ``_Registry.take_buffer``)."""

    def __init__(self) -> None:
        self._results: torch.Tensor | None = None
        self._pool: list[bytearray] = []

    def take_results(self, size: int) -> torch.Tensor:
        """A vector of ``size`` float32 values (contents undefined), the
        spare one while no round holds it."""
        spare, self._results = self._results, None
        if spare is None or spare.numel() < size:
            return torch.empty(size, dtype=torch.float32)
        return spare[:size]

    def give_results(self, results: torch.Tensor) -> None:
        base = results._base if isinstance(results._base, torch.Tensor) else results
        if self._results is None or base.numel() > self._results.numel():
            self._results = base

    def pool(self, chunk_bytes: int) -> list[bytearray]:
        """The chunk buffers (each ``chunk_bytes``) that rounds share: a round
        takes from it and gives back; two rounds at once only share it."""
        if self._pool and len(self._pool[0]) != chunk_bytes:
            self._pool = []
        return self._pool


class _RingRegistry:
    def __init__(self) -> None:
        self.rounds: RoundsByGroup[_Ring] = RoundsByGroup()
        self.spares = _Spares()
        #: hears ``(group_id, sender, weight)`` from each ring header, checked
        #: or not (``serve_ring``)
        self.on_weight: Callable[[bytes, PeerID, Any], None] | None = None

    async def handle(self, stream: Any) -> None:
        """The connection handler of ``RING_STREAM``: raises ``ProtocolError``
        to refuse the stream."""
        with trio.move_on_after(RING_GROUP_WAIT) as wait:
            header = await stream.receive()
        if wait.cancelled_caught:
            raise ProtocolError("no ring header in time")
        fields = expect_list(header, 4, "ring header")
        gid = expect_bytes(fields[1], "group id", max_size=64)
        if self.on_weight is not None:  # also before our round starts, as the butterfly's
            self.on_weight(gid, stream.remote, fields[3])
        rnd = await self.rounds.find(gid, wait=RING_GROUP_WAIT)
        if rnd is None:
            raise ProtocolError(f"no ring round for group {gid.hex()[:16]} here")
        rnd.check_header(stream.remote, header)
        await rnd.accept(stream)


_registries: WeakKeyDictionary[Any, _RingRegistry] = WeakKeyDictionary()


def serve_ring(net: Any, on_weight: Callable[[bytes, PeerID, Any], None] | None = None) -> None:
    """Accept ring streams on ``net`` from now on; ``on_weight(group_id,
    sender, weight)`` hears the weight in each ring header (unchecked: the
    listener checks it). Only a member's successor hears its weight: the
    ring has no stream to the others."""
    _ring_registry(net).on_weight = on_weight


def _ring_registry(net: Any) -> _RingRegistry:
    registry = _registries.get(net)
    if registry is None:
        registry = _registries[net] = _RingRegistry()
        net.set_handler(RING_STREAM, registry.handle)
    return registry


@contextmanager
def _registered(net: Any, rnd: _Ring) -> Iterator[None]:
    with _ring_registry(net).rounds.register(rnd.group.group_id, rnd):
        yield


async def ring_all_reduce(
    net: Any,
    group: Group,
    partition: Partition,
    flat: torch.Tensor,
    weight: float,
    reducer_timeout: float,
    upload_pacing: float | None = None,
    traffic: RoundTraffic | None = None,
) -> RingOutcome:
    """Average ``flat`` with ``group`` around the ring (module docstring), in
    place. Raises ``RingFailed``, with ``flat`` untouched, if the ring did not
    finish here. ``traffic``, if given, times the round's sends and receives
    for the link meter."""
    spares = _ring_registry(net).spares
    rnd = _Ring(group, partition, flat, weight, reducer_timeout, spares, upload_pacing, traffic)
    try:
        with _registered(net, rnd):
            return await rnd.run(net)
    finally:
        spares.give_results(rnd.results)
