"""Fault-tolerant butterfly all-reduce within one group, over peer connections.

Member i reduces part i of the flattened vector (``_partition``). Every member
that has data opens one stream to each reducer (its own part goes over an
in-memory stream through the very same code), sends a header and then its
part in chunks; the reducer accumulates the chunks (``PartReducer``) and
streams each averaged chunk to every sender as soon as every live sender has
delivered it, so sending, reducing and receiving overlap. Between two members
that both send data and reduce a part, the results travel on the reducer's
own stream to the other member, behind its chunks of that member's part
(``results_on_reducer_stream``): each direction between them is then one
TCP flow whose order the sender chooses, not two that compete for the link.
A member that cannot take those (a client, an auxiliary member, an empty
part) gets the results back on its own stream.

Wire protocol of one stream (name ``ALLREDUCE_STREAM``), sender -> reducer:

1. header, msgpack: ``[version, group_id, part, sender, weight, chunk_elements, total]``
2. per chunk, two raw frames: ``u32 chunk index | blob header`` (16 bytes), then
   the blob's payload (``_codecs``).

Results, per chunk: a raw frame ``u32 chunk index | contributor bit mask |
blob header``, then a raw frame with the blob's payload. The mask has one bit
per member (bit i of byte i // 8), padded to a multiple of 4 bytes; an
all-zero mask means the chunk has no result (nobody with weight > 0 delivered
it): then there is no blob header and no payload frame. Results go reducer ->
sender on the sender's stream, or, between two members that both reduce a
part, sender -> reducer on the reducer's stream to that member, among its
chunks, with ``RESULT_FLAG`` set in the index; nothing then comes back on
that stream, and the receiving member ends it once it has all it expects. A
refused stream is reset with a one-line reason.

A member that withdraws from a formed group before its round (a cancelled
``ScheduledRound``) opens one stream to each member that accepts
connections and sends ``["withdraw", version, group_id]``; the member answers
``["ok"]``. Its reducer then excludes the withdrawn member at once, also if
its own round starts later (the notice is kept ``WITHDRAWAL_TTL`` seconds),
instead of waiting ``sender_timeout`` for it; and the withdrawn member
refuses the streams of that group at once, so its senders keep their local
values for its part without waiting either. A withdrawal only ever names the
peer whose connection carries it (its proven peer id). The lossy data plane
does not take withdrawals: there the others wait ``sender_timeout``.

Payloads travel as frames of their own, each with the small header in front
of it in the same system call (``send_bytes_batch``), so that an uncompressed
chunk is sent straight from the tensor's memory (the sender's vector, the
reducer's accumulator) and received straight into a reusable buffer
(``receive_into``): no copy on either side beyond the one into place.

Quantized codecs are two-step, as in Flash Communication (Li et al. 2024,
sec. 3): senders quantize their part, the reducer dequantizes, averages in
float32 and re-quantizes the result before sending it back; the reducer itself
uses the decoded re-quantized values, so every member ends with the same bits.

Faults (DESIGN.md, "Butterfly all-reduce"):

- A sender that does not open its stream within ``sender_timeout`` of the
  reducer's start, or whose next chunk does not arrive within
  ``sender_timeout``, breaks its stream, breaks the protocol or sends NaN/Inf
  is excluded from the chunks it did not deliver; they are averaged over
  those who did, weights renormalised.
- A reducer whose next averaged chunk does not arrive within
  ``reducer_timeout``, who breaks its stream or the protocol, or sends NaN/Inf
  leaves the rest of its part at each member's local values.
- ``reducer_timeout > sender_timeout`` so a reducer waiting out one slow sender
  is not itself dropped by the others.
- Nothing outlives ``round_timeout``: at that deadline every member stops and
  keeps what it has, so healthy members always finish by it.
- A chunk whose weighted sum overflows float32 has no result (``_reducer``):
  every member keeps its local values there, and nobody is blamed.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import struct
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    contextmanager,
    nullcontext,
)
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, NoReturn, Protocol, TypeVar
from weakref import WeakKeyDictionary

import torch
import trio

from swarm import (
    ConfigError,
    EndOfStreamError,
    PeerID,
    ProtocolError,
    SelfDialError,
    SwarmError,
)
from swarm._wire import expect_bytes, expect_float, expect_int, expect_list

from ._codecs import (
    HEADER,
    NONE,
    Codec,
    CodecKind,
    all_finite,
    decode_split,
    encode_split,
    is_raw_float32,
    payload_size,
)
from ._faults import FaultPlan, InjectedFault, MemberFault
from ._group import Group, GroupMember, MemberMode, contributor_mask, mask_members, mask_size
from ._link_meter import LinkMeter, RoundTraffic
from ._lossy import lossy_all_reduce, serve_lossy_allreduce
from ._partition import Partition, flatten, unflatten_into
from ._reducer import PartReducer, ReceivedParts
from ._ring import RingFailed, ring_all_reduce, ring_eligible, serve_ring
from ._robust import CenteredClip
from ._rounds import RoundsByGroup
from ._staging import LocalTensorError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Name of the stream (connection handler) of the all-reduce.
ALLREDUCE_STREAM = "allreduce"
PROTOCOL_VERSION = 4
#: How long a stream for a group id this peer does not (yet) run waits for
#: that round to start before it is refused: members enter a round a little
#: apart, but not by seconds.
UNKNOWN_GROUP_WAIT = 2.0
#: How long a reducer waits for a stream's header.
HEADER_TIMEOUT = 5.0
#: The first item of a withdrawal notice (``withdraw_from_round``).
WITHDRAW = "withdraw"
#: How long a peer remembers a withdrawal (its own, or a group-mate's notice):
#: longer than any member waits to begin a round it found ahead of time.
WITHDRAWAL_TTL = 120.0
#: At most this many withdrawal notices from others are kept (the oldest
#: give way): a peer cannot be made to hold memory by notices for made-up groups.
MAX_WITHDRAWAL_NOTICES = 1024
#: Bytes of frame that are not the codec blob, at most (index + mask of 256 members).
_FRAME_OVERHEAD = 4 + 32
_CHUNK_INDEX = struct.Struct("<I")
#: Set in the chunk index of a result frame that travels on the reducer's own
#: stream to a member, among the reducer's chunks for that member's part.
RESULT_FLAG = 1 << 31
_CHUNK_HEADER_SIZE = _CHUNK_INDEX.size + HEADER.size
#: Smallest chunk (elements) that ``min_chunks_per_part`` cuts parts into:
#: below it the per-chunk costs outweigh the overlap.
MIN_PIPELINED_CHUNK = 1 << 14
#: Receive buffers kept between rounds, each at most one chunk (4 MiB by
#: default): a member of a group of 4 receives on 3 remote streams that each
#: bring chunks and results, each kind into two buffers (``_dispatched``).
_SPARE_SCRATCH = 12


@dataclass(frozen=True)
class AllReduceConfig:
    """Deadlines and chunking of one all-reduce round (seconds, elements).

    Defaults follow hivemind's (sender 5 s, reducer 10 s). ``chunk_elements``
    sizes the unit of overlap. Per-chunk costs (Python and scheduling per
    frame, the checks and bookkeeping of each chunk) dominate below a few MiB,
    while smaller chunks overlap better on small vectors. Since the
    connection layer authenticates large payloads in cache-sized slices as
    they arrive, larger chunks no longer cost a pass over memory: on the
    benchmark (4 peers, 25M floats), 4 MiB chunks take 10-20% less CPU than
    2 MiB ones, and 8 MiB ones no less than 4 MiB. The default keeps a
    float32 payload within 4 MiB, four of the connection layer's 1 MiB
    sealing chunks in encrypted mode. A chunk must fit
    ``ConnectionConfig.max_frame_size`` (8 MiB by default) as float32.
    """

    sender_timeout: float = 5.0
    reducer_timeout: float = 10.0
    round_timeout: float = 60.0
    chunk_elements: int = (1 << 20) - 16
    #: None: each reducer returns the weighted mean of its part. ``CenteredClip``:
    #: each reducer returns, chunk by chunk, the CenteredClip of its senders'
    #: values (``_robust``), which bounds the pull of Byzantine senders on every
    #: chunk; it keeps every sender's copy of unfinished chunks (``_reducer``).
    #: Every member must use the same setting.
    aggregation: CenteredClip | None = None
    #: Wire bytes a sender may send to a reducer ahead of the averaged chunks
    #: it has received back from it (at least two chunks). Without a bound,
    #: the reduce-scatter runs ahead of the all-gather on every uplink (TCP
    #: shares a link between flows, not between phases), and a round ends with
    #: a backlog of results that a few uplinks send while the others idle.
    #: Enough to keep a link busy while a chunk's result makes its round trip;
    #: in bytes, so that small (quantized) chunks get as much in flight.
    window_bytes: int = 4 * 2**20
    #: Parts are cut into at least this many chunks (chunks no smaller than
    #: ``MIN_PIPELINED_CHUNK`` elements, no larger than ``chunk_elements``):
    #: results flow back only chunk by chunk, so a part in one or two chunks
    #: leaves the all-gather idle until the reduce-scatter is nearly done. On
    #: 4 x 100 Mbit/s links (5M floats) 64K-element chunks reached 80% of the
    #: link limit where 1M-element ones reached 70%.
    min_chunks_per_part: int = 8
    #: The lossy data plane (``_lossy``, issue 18): payload in authenticated,
    #: paced UDP datagrams that are never retransmitted, each piece averaged
    #: over the contributions that arrived. For lossy or long links, where TCP
    #: spends its time on retransmissions; it costs accuracy per round (lost
    #: pieces) and drift between members (``trainer``'s re-synchronisation).
    #: Raw float32 only (codec ``NONE``), weighted mean only. Every member
    #: must use the same setting.
    lossy: bool = False
    #: Run the pipelined ring (``_ring``) where the group allows it (every
    #: member a node, uploads alike within ``_partition.RING_UPLOAD_SPREAD``,
    #: which then cut equal parts; codec ``NONE``, weighted mean): one TCP
    #: flow per link instead of n - 1, which keeps links of equal speed full.
    #: If the ring breaks, the round falls back to the butterfly in the time
    #: left (a failed member is left out there). Fault plans (``_faults``)
    #: act on the butterfly only. Every member must use the same setting.
    ring: bool = False
    #: This peer's upload rate in bytes per second, if known: each of its
    #: streams to a reducer (or, around the ring, to its successor) is then
    #: paced (``SO_MAX_PACING_RATE``) at its share of that rate, the share of
    #: the round's bytes it carries. Unpaced, the n - 1 flows of an uplink
    #: build a queue at the link and take it from each other in turns; paced
    #: to their shares, each flow keeps to its own. On 4 peers x 100 Mbit/s
    #: (BBR), 97-98.5 Mbit/s here took the butterfly from 79-82% of the link
    #: limit to 92-94%, past gloo's 88-91% in the same launches. A local
    #: setting: members may differ. The rate counts IP packets (the link
    #: counts its frames' headers too): set it a little under the link's.
    #: Overrides ``auto_pacing``.
    upload_pacing: float | None = None
    #: Without ``upload_pacing``, pace at the upload this peer's unpaced
    #: rounds measured (``LinkMeter.pacing_rate``: a round unpaced now and
    #: then, to follow a link that got faster or slower), where the
    #: all-reduce is given a meter, as the averager gives its own. False:
    #: unpaced. A local setting: members may differ.
    auto_pacing: bool = True

    def __post_init__(self) -> None:
        for name in ("sender_timeout", "reducer_timeout", "round_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value} must be a positive number of seconds")
        if self.reducer_timeout <= self.sender_timeout:
            raise ConfigError(
                f"reducer_timeout ({self.reducer_timeout}) must exceed sender_timeout"
                f" ({self.sender_timeout}): a reducer waits up to sender_timeout for a slow"
                " sender before it can answer, and must not be dropped meanwhile"
            )
        if self.aggregation is not None and not isinstance(self.aggregation, CenteredClip):
            raise ConfigError(
                f"aggregation must be None or CenteredClip(tau=...), not {self.aggregation!r}"
            )
        if self.lossy and self.aggregation is not None:
            raise ConfigError("lossy=True averages by weighted mean: aggregation must be None")
        if not 1 <= self.min_chunks_per_part <= 1 << 20:
            raise ConfigError(
                f"min_chunks_per_part={self.min_chunks_per_part} must be in [1, 2**20]"
            )
        if self.upload_pacing is not None and not (
            math.isfinite(self.upload_pacing) and self.upload_pacing >= 1
        ):
            raise ConfigError(
                f"upload_pacing={self.upload_pacing} must be None or a number of bytes"
                " per second >= 1"
            )
        if not 1 <= self.window_bytes <= 1 << 40:
            raise ConfigError(f"window_bytes={self.window_bytes} must be in [1, 2**40]")
        if not 1 <= self.chunk_elements <= (1 << 21) - 1024:
            raise ConfigError(
                f"chunk_elements={self.chunk_elements} must be in [1, 2**21 - 1024]"
                " so that a float32 chunk fits one 8 MiB frame"
            )


@dataclass(frozen=True)
class AllReduceResult:
    """What one member's all-reduce did.

    ``contributors[j][c]`` is the set of members whose data is averaged into
    chunk c of part j of the local result. ``{local_index}`` alone means the
    chunk kept its local values (its reducer failed, or only we delivered it).
    An auxiliary member has no result of its own: its sets are empty except
    for the part it reduced.
    """

    group_id: bytes
    local_index: int
    part_bounds: tuple[tuple[int, int], ...]
    chunk_elements: int
    contributors: tuple[tuple[frozenset[int], ...], ...]
    #: Senders our reducer excluded from at least one chunk of our part.
    failed_senders: frozenset[int]
    #: Reducers whose part we did not get back whole (a remote failure).
    failed_reducers: frozenset[int]
    #: True if the round deadline stopped the round before everything finished.
    timed_out: bool
    #: Reducers whose announced address led back to this very peer
    #: (``SelfDialError``): our data is not in their parts, which kept our
    #: local values unless their results came on their own streams to us
    #: (``results_on_reducer_stream``); they did not fail, so they are not in
    #: ``failed_reducers``.
    self_dialed: frozenset[int] = frozenset()
    #: The round ran over the lossy data plane (``_lossy``): a chunk is one
    #: piece, and losing pieces is no failure of anybody.
    lossy: bool = False

    def part_contributors(self, part: int) -> frozenset[int]:
        """Members whose data is in every chunk of ``part`` of the local result."""
        chunks = self.contributors[part]
        if not chunks:
            return frozenset()
        return frozenset.intersection(*chunks)


# The parts of the connections API (swarm._connections) the all-reduce uses.


class StreamLike(Protocol):
    remote: PeerID

    async def send(self, message: Any) -> None: ...
    async def send_bytes(self, data: bytes | bytearray | memoryview) -> None: ...
    async def send_bytes_batch(self, frames: Sequence[bytes | bytearray | memoryview]) -> None: ...
    async def receive(self) -> Any: ...
    async def receive_into(
        self,
        buffer: bytearray | memoryview,
        progress: Callable[[memoryview, int], None] | None = None,
    ) -> int: ...
    async def aclose(self) -> None: ...
    def unacknowledged_bytes(self) -> int: ...
    def queueing_delay(self) -> float | None: ...
    def pace(self, rate: float | None) -> None: ...


class Network(Protocol):
    @property
    def peer_id(self) -> PeerID: ...

    def set_handler(self, name: str, handler: Callable[[Any], Awaitable[None]]) -> None: ...

    def open_stream(
        self, peer_id: PeerID, address: tuple[str, int], name: str
    ) -> AbstractAsyncContextManager[Any]: ...

    def report_offence(self, peer_id: PeerID, reason: str) -> None: ...

    def inbound_key_exporters(self, peer_id: PeerID) -> list[Callable[[bytes], bytes]]: ...


async def all_reduce(
    net: Network,
    group: Group,
    tensors: Sequence[torch.Tensor],
    *,
    weight: float = 1.0,
    codec: Codec = NONE,
    config: AllReduceConfig | None = None,
    fault_plan: FaultPlan | None = None,
    meter: LinkMeter | None = None,
) -> AllReduceResult:
    """Average ``tensors`` with ``group``, in place; return who contributed where.

    Every member calls this with the same ``group`` (but its own
    ``local_index``), tensors of the same shapes, and the same ``config``.
    The result written into ``tensors`` is, chunk by chunk, the ``weight``-ed
    mean over the members that delivered that chunk to its reducer, or the
    local values where the reducer failed. An ``AUX`` member's tensors only
    give the shapes; they are not changed.

    Returns at the latest ``config.round_timeout`` after the call, also when
    peers fail (``timed_out`` tells). Raises ``ConfigError`` for a bad weight
    and ``InjectedFault`` if the fault plan says so. On cancellation, the
    tensors hold a mix of averaged and local chunks (each chunk whole) and
    the cancellation propagates; remote members see us fail.

    ``meter``, if given, gets this round's upload and download rates
    (``_link_meter``) if nothing failed in it; a lossy round measures nothing.
    """
    config = config if config is not None else AllReduceConfig()
    plan = fault_plan if fault_plan is not None else FaultPlan()
    me = group.local_index
    fault = plan.for_member(me)
    if fault.fail_before_sending:
        raise InjectedFault("fault plan: fail before sending")
    if not (math.isfinite(weight) and weight >= 0):
        raise ConfigError(f"weight must be a finite number >= 0, got {weight}")
    if net.peer_id != group.local.peer_id:
        raise ConfigError("the group's local member is not this peer")
    if config.lossy:  # the seam of the lossy data plane (issue 18): averaging/_lossy.py
        return await _lossy_round(net, group, tensors, weight, codec, config, plan)
    config = _auto_paced(config, meter)
    started = trio.current_time()
    flat = flatten(tensors)
    # the ring serves raw float32 and the weighted mean; where it may run,
    # uploads alike within 10% cut equal parts, so that it does
    ring = config.ring and codec == NONE and config.aggregation is None
    partition = Partition.for_group(group, flat.numel(), config.chunk_elements, ring=ring)
    chunk = pipelined_chunk_elements(partition, config)
    if chunk != partition.chunk_elements:
        partition = Partition(partition.total, partition.part_bounds, chunk)
    if ring and ring_eligible(group, partition):
        return await _ring_round(net, group, tensors, flat, partition, weight, codec, config, meter)
    traffic = meter.round_traffic() if meter is not None else None
    rnd = _Round(net, group, partition, flat, weight, codec, config, fault, traffic)
    with (
        trio.move_on_after(config.round_timeout) as deadline,
        rnd.reducer_buffer(),
        _registry(net).register(rnd) if rnd.reducer is not None else _nothing(),
    ):
        async with (
            traffic.watching_drains() if traffic is not None else nullcontext(),
            trio.open_nursery() as nursery,
        ):
            if rnd.reducer is not None:
                nursery.start_soon(rnd.reduce, _registry(net).withdrawn_from(group.group_id))
            if group.local.mode is not MemberMode.AUX:
                for part in range(group.size):
                    if partition.part_size(part) > 0:
                        nursery.start_soon(rnd.send_part, part)
    result = rnd.result(timed_out=deadline.cancelled_caught)
    if meter is not None and traffic is not None and _fault_free(result):
        meter.record(traffic, config.upload_pacing)
    if group.local.mode is not MemberMode.AUX:
        unflatten_into(flat, tensors)
        _log_contributors(result, len(group.senders()), started)
    return result


def _auto_paced(config: AllReduceConfig, meter: LinkMeter | None) -> AllReduceConfig:
    """``config`` with the pace ``meter`` gives this round (``auto_pacing``),
    unless the user set one (``upload_pacing``) or turned it off."""
    if config.upload_pacing is not None or not config.auto_pacing or meter is None:
        return config
    rate = meter.pacing_rate()
    return config if rate is None else dataclasses.replace(config, upload_pacing=rate)


async def _ring_round(
    net: Network,
    group: Group,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    partition: Partition,
    weight: float,
    codec: Codec,
    config: AllReduceConfig,
    meter: LinkMeter | None,
) -> AllReduceResult:
    """``all_reduce`` around the ring (``_ring``); if the ring breaks, the
    butterfly in the time left, under a group id of its own (so that its
    streams never meet the ring's), with the same promises. ``meter`` gets
    the rates of a ring that finished, or of a fallback that nothing failed in."""
    # The butterfly's handler too, from now on: a member whose ring broke
    # earlier than ours begins its fallback before we begin ours.
    serve_allreduce(net)
    started = trio.current_time()
    outcome = None
    traffic = meter.round_traffic() if meter is not None else None
    with trio.move_on_after(config.round_timeout) as deadline:
        try:
            async with traffic.watching_drains() if traffic is not None else nullcontext():
                outcome = await ring_all_reduce(
                    net,
                    group,
                    partition,
                    flat,
                    weight,
                    config.reducer_timeout,
                    config.upload_pacing,
                    traffic,
                )
        except RingFailed as e:
            logger.info(
                "all-reduce %s: %s; falling back to the butterfly", group.group_id.hex()[:8], e
            )
    left = config.round_timeout - (trio.current_time() - started)
    if outcome is None:
        fallback = dataclasses.replace(config, ring=False, round_timeout=max(left, 1e-3))
        if deadline.cancelled_caught or left <= 0:
            fallback = dataclasses.replace(fallback, round_timeout=1e-3)
        result = await all_reduce(
            net,
            group.sub_round(b"ring fallback"),
            tensors,
            weight=weight,
            codec=codec,
            config=fallback,
            meter=meter,
        )
        return dataclasses.replace(result, group_id=group.group_id)
    if meter is not None and traffic is not None:
        meter.record(traffic, config.upload_pacing)
    result = AllReduceResult(
        group_id=group.group_id,
        local_index=group.local_index,
        part_bounds=partition.part_bounds,
        chunk_elements=partition.chunk_elements,
        contributors=outcome.contributors,
        failed_senders=frozenset(),
        failed_reducers=frozenset(),
        timed_out=False,
    )
    unflatten_into(flat, tensors)
    _log_contributors(result, len(group.senders()), started, ring=True)
    return result


async def withdraw_from_round(net: Network, group: Group, *, timeout: float) -> frozenset[PeerID]:
    """Withdraw this peer from ``group``'s round before it began here.

    From now on this peer refuses the group's streams at once (its part then
    keeps each sender's local values), and each member that accepts
    connections is told, so that its reducer excludes this peer at once
    instead of waiting ``sender_timeout``. Returns the members that
    acknowledged the notice within ``timeout`` seconds; the others wait for
    this peer as for a failed one. Never raises for a member's failure (a
    per-peer boundary); on cancellation the notices not yet sent are not sent.
    """
    if net.peer_id != group.local.peer_id:
        raise ConfigError("the group's local member is not this peer")
    _registry(net).withdraw(group.group_id)
    told: set[PeerID] = set()

    async def tell(member: GroupMember) -> None:
        try:
            with trio.fail_after(timeout):
                async with net.open_stream(
                    member.peer_id, member.address, ALLREDUCE_STREAM
                ) as stream:
                    await stream.send([WITHDRAW, PROTOCOL_VERSION, group.group_id])
                    if await stream.receive() == ["ok"]:
                        told.add(member.peer_id)
        except (SwarmError, trio.TooSlowError) as e:  # per-peer boundary
            logger.info("could not tell %s of our withdrawal: %r", member.peer_id.short(), e)

    async with trio.open_nursery() as nursery:
        for i, member in enumerate(group.members):
            if i != group.local_index and member.mode is not MemberMode.CLIENT:
                nursery.start_soon(tell, member)
    return frozenset(told)


async def _lossy_round(
    net: Network,
    group: Group,
    tensors: Sequence[torch.Tensor],
    weight: float,
    codec: Codec,
    config: AllReduceConfig,
    plan: FaultPlan,
) -> AllReduceResult:
    """``all_reduce`` over the lossy data plane (``_lossy``): same promises,
    but a chunk of the result is one piece (``PIECE_ELEMENTS`` values)."""
    if codec != NONE:
        raise ConfigError(
            f"the lossy all-reduce sends raw float32: codec must be NONE, not {codec}"
        )
    started = trio.current_time()
    flat = flatten(tensors)
    outcome = await lossy_all_reduce(
        net,
        group,
        flat,
        weight,
        sender_timeout=config.sender_timeout,
        round_timeout=config.round_timeout,
        fault_plan=plan,
    )
    result = AllReduceResult(
        group_id=group.group_id,
        local_index=group.local_index,
        part_bounds=outcome.partition.part_bounds,
        chunk_elements=outcome.partition.chunk_elements,
        contributors=outcome.contributors,
        failed_senders=outcome.failed_senders,
        failed_reducers=outcome.failed_reducers,
        timed_out=outcome.timed_out,
        lossy=True,
    )
    if group.local.mode is not MemberMode.AUX:
        unflatten_into(flat, tensors)
        _log_contributors(result, len(group.senders()), started)
    return result


def _fault_free(result: AllReduceResult) -> bool:
    """Whether a round measured links only: a stalled or failed member makes
    the others' sends to it look slow."""
    return not (
        result.timed_out or result.failed_senders or result.failed_reducers or result.self_dialed
    )


def _log_contributors(
    result: AllReduceResult, senders: int, started: float, *, ring: bool = False
) -> None:
    """One line per round saying whose data is in *every* element of our
    result: what a caller may truthfully report as "averaged with k peers";
    and how long the round took since ``started`` (trio's clock), which the
    logs of a training run need to tell the data plane's share of a step."""
    parts = [result.part_contributors(j) for j, (a, b) in enumerate(result.part_bounds) if b > a]
    everywhere = frozenset.intersection(*parts) if parts else frozenset()
    logger.info(
        "all-reduce %s: data of %d of %d senders in every part in %.3f s%s%s",
        result.group_id.hex()[:8],
        len(everywhere),
        senders,
        trio.current_time() - started,
        " (around the ring)" if ring else "",
        f" (self-dialed members {sorted(result.self_dialed)})" if result.self_dialed else "",
    )


def pipelined_chunk_elements(partition: Partition, config: AllReduceConfig) -> int:
    """The chunk size of a round: ``config.chunk_elements``, or smaller so that
    the largest part has ``min_chunks_per_part`` chunks, but not below
    ``MIN_PIPELINED_CHUNK``. Every member computes the same from the group."""
    largest = max(partition.part_size(j) for j in range(len(partition.part_bounds)))
    wanted = max(MIN_PIPELINED_CHUNK, -(-largest // config.min_chunks_per_part))
    return min(config.chunk_elements, wanted)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def results_on_reducer_stream(
    group: Group, partition: Partition, reducer: int, member: int
) -> bool:
    """Whether the reducer of part ``reducer`` sends its results to ``member``
    on its own stream to that member, behind its chunks of ``member``'s part,
    rather than back on the member's stream.

    So each direction between two members carries one TCP flow, not two:
    what a member uploads to another (its data for their part and its results
    of its own part) shares one connection, whose order it chooses, instead of
    two connections that compete for the link, one of them often idle while
    its results wait for the slowest sender. On a 100 Mbit/s bed that idled
    uplinks for whole tenths of a second at the end of each round. It takes a
    stream that the reducer opens anyway: both members send data and reduce
    a part (neither is a client, an auxiliary member or has an empty part).
    Every member computes the same from the group.
    """
    if reducer == member:
        return False
    for index in (reducer, member):
        if partition.part_size(index) == 0 or group.members[index].mode is MemberMode.AUX:
            return False
    return True


class _Round:
    """One member's state for one round: its reducer role and its sender role."""

    def __init__(
        self,
        net: Network,
        group: Group,
        partition: Partition,
        flat: torch.Tensor,
        weight: float,
        codec: Codec,
        config: AllReduceConfig,
        fault: MemberFault,
        traffic: RoundTraffic | None = None,
    ) -> None:
        self.net = net
        self.traffic = traffic
        self.group = group
        self.partition = partition
        self.flat = flat
        self.weight = weight
        self.codec = codec
        self.config = config
        self.fault = fault
        me = group.local_index
        self.received = ReceivedParts([partition.num_chunks(j) for j in range(group.size)], me)
        # Reducer role.
        self.reducer: PartReducer | None = None
        self.buffer: torch.Tensor | None = None
        if partition.part_size(me) > 0:
            self.buffer = _registry(net).take_buffer(partition.part_size(me))
            self.reducer = PartReducer(
                partition.chunk_sizes(me),
                dict.fromkeys(group.senders(), 0.0),
                buffer=self.buffer,
                aggregation=config.aggregation,
            )
        # a sender's stream, or None: the sender withdrew (``withdraw``)
        self._incoming_send, self._incoming_receive = trio.open_memory_channel[
            tuple[StreamLike | None, int, float, trio.Event]
        ](0)
        self._connected: set[int] = set()
        n_chunks = partition.num_chunks(me) if self.reducer is not None else 0
        self._chunk_done = [trio.Event() for _ in range(n_chunks)]
        self._frames: dict[int, tuple[bytes | bytearray | memoryview, ...]] = {}
        self._frame_waiters: dict[int, set[int]] = {}
        self._responders: set[int] = set()
        self.self_dialed: set[int] = set()
        #: members that get our results on our stream to them (not on theirs)
        self._pushed = frozenset(
            j for j in range(group.size) if results_on_reducer_stream(group, partition, me, j)
        )
        #: members whose results come on their stream to us (not on ours)
        self._pulled = frozenset(
            j for j in range(group.size) if results_on_reducer_stream(group, partition, j, me)
        )
        self._responders.update(self._pushed)
        #: set once we know whether we opened our stream to a pushed member
        self._push_decided = {j: trio.Event() for j in self._pushed}
        #: pushed members we could not open a stream to
        self._unpushed: set[int] = set()
        chunk_bytes = codec.encoded_size(partition.chunk_elements)
        window_chunks = max(2, config.window_bytes // chunk_bytes)
        self._windows = [_Window(window_chunks) for _ in range(group.size)]

    # ----------------------------------------------------------------- reducer

    @contextmanager
    def reducer_buffer(self) -> Iterator[None]:
        """At the end of the round: refuse streams still waiting to be accepted
        (also if ``reduce`` never ran) and give the accumulator back to the
        registry for the next round."""
        try:
            yield
        finally:
            self._incoming_receive.close()
            if self.buffer is not None:
                _registry(self.net).give_buffer(self.buffer)
                self.buffer = None

    def check_header(self, stream: StreamLike, message: Any) -> tuple[int, float]:
        """Validate a sender's header; return (sender index, weight).

        Raises ``ProtocolError`` with the one-line reason for the refusal.
        """
        return parse_sender_header(message, self.group, self.partition, stream.remote)

    async def accept(self, stream: StreamLike, sender: int, weight: float) -> None:
        """Hand an incoming sender stream to the reducer; return when it is served.

        Raises ``ProtocolError`` (the refusal) if the sender already has a
        stream, or the reducer stopped accepting (round over, or the sender is
        later than ``sender_timeout``).
        """
        done = trio.Event()
        try:
            await self._incoming_send.send((stream, sender, weight, done))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ProtocolError("the round no longer accepts senders") from None
        await done.wait()

    async def withdraw(self, peer_id: PeerID) -> None:
        """``peer_id`` withdrew from this round: if it is a sender that has not
        connected, exclude it now rather than after ``sender_timeout``."""
        senders = self.group.senders()
        index = next((i for i in senders if self.group.members[i].peer_id == peer_id), None)
        if index is None or self.reducer is None:
            return
        done = trio.Event()
        try:
            await self._incoming_send.send((None, index, 0.0, done))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the reducer no longer waits for senders
        await done.wait()

    async def reduce(self, withdrawn: frozenset[PeerID] = frozenset()) -> None:
        """The reducer role: accept senders, serve each, until all are served.
        Senders in ``withdrawn`` (notices that came before the round) are
        excluded from the start."""
        assert self.reducer is not None
        reducer = self.reducer
        expected = set(self.group.senders())
        gone = {i for i in expected if self.group.members[i].peer_id in withdrawn}
        if gone:
            logger.info("all-reduce: members %s withdrew from this round", sorted(gone))
            await self._completed(reducer.fail_all(gone))
        async with trio.open_nursery() as nursery:
            with self._incoming_receive:
                with trio.move_on_after(self.config.sender_timeout):
                    while expected - self._connected - reducer.failed:
                        stream, sender, weight, done = await self._incoming_receive.receive()
                        if stream is None:  # a withdrawal notice
                            if sender not in self._connected and sender not in reducer.failed:
                                logger.info("all-reduce: member %d withdrew", sender)
                                await self._completed(reducer.fail(sender))
                            done.set()
                            continue
                        if sender in self._connected or sender in reducer.failed:
                            nursery.start_soon(_refuse, done, stream, "duplicate sender stream")
                            continue
                        self._connected.add(sender)
                        reducer.set_weight(sender, weight)
                        if sender not in self._pushed:
                            self._responders.add(sender)
                        nursery.start_soon(self._serve_sender, stream, sender, done)
            late = expected - self._connected
            if late:
                logger.info("all-reduce: senders %s did not connect in time", sorted(late))
                await self._completed(reducer.fail_all(late))
                for member in late & self._pulled:
                    self._windows[member].open()  # its results would have come with it

    async def _serve_sender(self, stream: StreamLike, sender: int, done: trio.Event) -> None:
        """Receive one sender's chunks and stream the averaged chunks back.

        The per-sender boundary: any failure excludes this sender (and ends
        this stream) and nothing else.
        """
        assert self.reducer is not None
        try:
            if sender in self._pulled:  # its results come here too; ours go on our stream
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._reply_unless_pushed, stream, sender)
                    await self._receive_both(stream, sender)
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive_chunks, stream, sender, nursery.cancel_scope)
                try:
                    await self._reply(stream, sender)
                except Exception as e:  # per-peer boundary
                    logger.info("all-reduce: replying to member %d failed: %r", sender, e)
                    await self._completed(self.reducer.fail(sender))
                    await stream.aclose()
                nursery.cancel_scope.cancel()
        finally:
            if sender in self._pulled:
                self._windows[sender].open()  # no more results: nothing to wait for
            else:
                self._release_responder(sender)
            done.set()

    async def _reply_unless_pushed(self, stream: StreamLike, sender: int) -> None:
        """Our results for ``sender`` go on our own stream to it, unless we
        could not open one (it announced an address that leads back to us,
        or a NAT lets it dial us but not us it): then they go back on its
        stream, as to a client. The per-peer boundary of that reply."""
        await self._push_decided[sender].wait()
        if sender not in self._unpushed:
            return
        try:
            await self._reply(stream, sender)
        except Exception as e:  # per-peer boundary
            logger.info("all-reduce: replying to member %d failed: %r", sender, e)
        finally:
            self._release_responder(sender)

    async def _receive_chunks(
        self, stream: StreamLike, sender: int, serving: trio.CancelScope
    ) -> None:
        """Feed one sender's chunks to the reducer, then drain its stream.

        Chunk k+1 arrives while chunk k is decoded and added (``_overlapped``).
        When the stream ends or breaks, replying is pointless (a sender leaves
        only once it has everything or has given up on us): ``serving`` is
        cancelled. A sender excluded for ``sender_timeout`` keeps its stream
        and still gets the results.
        """
        assert self.reducer is not None
        reducer = self.reducer
        sizes = reducer.chunk_sizes
        next_chunk = reducer.delivered(sender)
        missed = False

        async def receive(turn: int) -> _Arrival | None:
            nonlocal next_chunk, missed
            chunk, scratch = next_chunk, scratches[turn % 2]
            if not reducer.expects(sender) or chunk == len(sizes):
                return None
            check = _FiniteCheck()
            with trio.move_on_after(self.config.sender_timeout):
                header, size = parse_chunk_header(await stream.receive(), chunk, sizes[chunk])
                with self._receiving(stream, size):
                    payload = await scratch.receive(stream, size, check.watch(header))
                next_chunk += 1
                return _Arrival(chunk, header, payload, check)
            missed = True
            return None

        try:
            with _registry(self.net).scratch() as first, _registry(self.net).scratch() as second:
                scratches = (first, second)
                await _overlapped(receive, partial(self._add, sender))
            if missed and reducer.expects(sender):
                logger.info("all-reduce: member %d missed sender_timeout", sender)
                await self._completed(reducer.fail(sender))
            # Excluded or finished: drain whatever it still sends, so a slow
            # sender is never blocked writing to us while it waits for results.
            while True:
                await stream.receive()
        except Exception as e:  # per-peer boundary
            self._blame(sender, e)
            if reducer.expects(sender):
                logger.info("all-reduce: member %d failed as a sender: %r", sender, e)
                await self._completed(reducer.fail(sender))
                await stream.aclose()  # not a clean end: the sender sees it fail
            serving.cancel()

    async def _receive_both(self, stream: StreamLike, sender: int) -> None:
        """Feed a sender's chunks to the reducer and put its results of its own
        part into place (``results_on_reducer_stream``), in the order it sends
        them; return when nothing more is expected.

        The next item arrives while the last chunk is decoded and added and the
        last result decoded and copied
        (``_dispatched``). The deadlines are those of separate streams: a
        sender whose next chunk does not come within ``sender_timeout`` is
        excluded from the chunks it did not deliver, and its results still
        count; a result that does not come within ``reducer_timeout`` of the
        last one, a broken stream or a broken protocol (NaN or Inf in a chunk
        or a result included) ends the stream: the sender is excluded, and
        the results of its part not yet here keep our local values.
        """
        assert self.reducer is not None
        reducer = self.reducer
        sizes = reducer.chunk_sizes
        num_results = self.partition.num_chunks(sender)
        senders = frozenset(self.group.senders())
        next_chunk = reducer.delivered(sender)
        next_result = self.received.next_chunk(sender)
        chunk_due = trio.current_time() + self.config.sender_timeout
        result_due = trio.current_time() + self.config.reducer_timeout

        async def receive() -> _Item | None:
            nonlocal next_chunk, next_result, chunk_due, result_due
            while True:
                # by what arrived: ``add`` may still be at work on the last chunk
                chunks_left = next_chunk < len(sizes) and sender in reducer.alive
                results_left = next_result < num_results
                if not (chunks_left or results_left):
                    return None
                due = min(
                    chunk_due if chunks_left else math.inf, result_due if results_left else math.inf
                )
                frame = None
                with trio.move_on_at(due):
                    frame = await stream.receive()
                if frame is None:
                    if results_left and trio.current_time() >= result_due:
                        raise trio.TooSlowError("no result within reducer_timeout")
                    logger.info("all-reduce: member %d missed sender_timeout", sender)
                    await self._completed(reducer.fail(sender))
                    continue
                data = memoryview(_expect_frame(frame, "chunk header")).cast("B")
                if len(data) < _CHUNK_INDEX.size:
                    raise ProtocolError(f"chunk header of {len(data)} bytes")
                if _CHUNK_INDEX.unpack_from(data)[0] & RESULT_FLAG:
                    if not results_left:
                        raise ProtocolError(f"more than the {num_results} results of the part")
                    a, b = self.partition.chunk_bounds(sender, next_result)
                    contributors, blob_header, size = parse_result_header(
                        data, next_result | RESULT_FLAG, self.group.size, senders, b - a
                    )
                    check = _FiniteCheck()
                    blob = None
                    if blob_header is not None:
                        # two alternate, as in ``_overlapped``: one is being placed
                        scratch = result_scratches[next_result % 2]
                        with trio.fail_at(result_due), self._receiving(stream, size):
                            payload = await scratch.receive(stream, size, check.watch(blob_header))
                        blob = (blob_header, payload)
                    next_result += 1
                    result_due = trio.current_time() + self.config.reducer_timeout
                    return _Item(None, _Result(next_result - 1, contributors, blob, check))
                if next_chunk == len(sizes):
                    raise ProtocolError(f"more than the {len(sizes)} chunks of the part")
                header, size = parse_chunk_header(data, next_chunk, sizes[next_chunk])
                check = _FiniteCheck()
                scratch = chunk_scratches[next_chunk % 2]
                with trio.fail_at(due), self._receiving(stream, size):
                    payload = await scratch.receive(stream, size, check.watch(header))
                next_chunk += 1
                chunk_due = trio.current_time() + self.config.sender_timeout
                # Excluded meanwhile: the chunk is dropped. Its buffer may be one
                # that ``add`` still decodes, but the reducer ignores whatever an
                # excluded sender's chunks hold.
                if chunks_left:
                    return _Item(_Arrival(next_chunk - 1, header, payload, check), None)

        registry = _registry(self.net)
        try:
            with (
                registry.scratch() as c0,
                registry.scratch() as c1,
                registry.scratch() as r0,
                registry.scratch() as r1,
            ):
                chunk_scratches, result_scratches = (c0, c1), (r0, r1)
                await _dispatched(
                    receive, partial(self._add, sender), partial(self._place, sender, own=False)
                )
            # Nothing more is expected: what the sender still sends (an excluded
            # sender's chunks) the connection layer drops.
        except Exception as e:  # per-peer boundary
            self._blame(sender, e)
            if reducer.expects(sender):
                logger.info("all-reduce: member %d failed as a sender: %r", sender, e)
                await self._completed(reducer.fail(sender))
            if not self.received.is_complete(sender):
                logger.info("all-reduce: reducer of part %d failed: %r", sender, e)
            if reducer.expects(sender) or not self.received.is_complete(sender):
                await stream.aclose()  # not a clean end: the sender sees it fail

    async def _add(self, sender: int, arrival: _Arrival) -> None:
        """Decode a sender's chunk and add it to the reducer (excluding the
        sender, and banning it, if it holds NaN or Inf)."""
        assert self.reducer is not None
        reducer = self.reducer
        if not reducer.expects(sender):
            return  # excluded while this chunk arrived
        chunk = arrival.chunk
        values, finite = await _decode(
            arrival.header, arrival.payload, reducer.chunk_sizes[chunk], arrival.check
        )
        if not finite:  # excluded, and banned
            self._blame(sender, ProtocolError(f"sent NaN or Inf in chunk {chunk}"))
            await self._completed(reducer.fail(sender))
            return
        await self._completed(reducer.add(sender, chunk, values, finite=True))

    async def _place(self, part: int, result: _Result, *, own: bool) -> None:
        """Put a reducer's result chunk of ``part`` into place once it is known
        to be good (a failed chunk keeps the local values): ``ProtocolError``
        if it holds NaN or Inf. ``own``: it comes from our own reducer, whose
        float32 results are finite (``PartReducer``); encoded ones can
        overflow a codec (FLOAT16), and another reducer's can be a lie."""
        chunk = result.chunk
        if result.blob is not None:
            start, _ = self.partition.part_bounds[part]
            a, b = self.partition.chunk_bounds(part, chunk)
            blob_header, payload = result.blob
            check = None if own and is_raw_float32(blob_header) else result.check
            values, finite = await _decode(blob_header, payload, b - a, check)
            if not finite:
                raise ProtocolError("the reducer sent NaN or Inf")
            self.flat[start + a : start + b].copy_(values)
        self.received.received(part, chunk, result.contributors)
        self._windows[part].advance(chunk + 1)

    def _sending(
        self, stream: StreamLike, frames: Sequence[bytes | bytearray | memoryview]
    ) -> AbstractContextManager[None]:
        """Times a send to another peer for the link meter (not our own part)."""
        if self.traffic is None or isinstance(stream, _LocalStream):
            return nullcontext()
        return self.traffic.sending(sum(memoryview(f).nbytes for f in frames), stream)

    def _receiving(self, stream: StreamLike, size: int) -> AbstractContextManager[None]:
        """Times the receipt of a payload from another peer for the link meter.
        The payload follows its header in the same send: from the header on,
        the receive waits only for the payload's bytes to cross the link."""
        if self.traffic is None or isinstance(stream, _LocalStream):
            return nullcontext()
        return self.traffic.receiving(size)

    def _blame(self, member: int, error: Exception) -> None:
        """A member that broke the all-reduce protocol (a malformed or NaN part,
        a forged result) is banned by the connection layer; other failures
        (timeouts, lost connections) are not offences."""
        if isinstance(error, ProtocolError) and member != self.group.local_index:
            peer = self.group.members[member].peer_id
            self.net.report_offence(peer, f"all-reduce: {error}")

    async def _reply(self, stream: StreamLike, sender: int, *, pushed: bool = False) -> None:
        """Send our part's results to ``sender``, chunk by chunk as they are
        finished; ``pushed``: on our own stream to it, flagged (``RESULT_FLAG``)."""
        for chunk, done in enumerate(self._chunk_done):
            await done.wait()
            await self.fault.before_reply(chunk)
            # A sender that stops reading must not hold the round open.
            frames = self._frames[chunk]
            if pushed:
                flagged = bytearray(frames[0])
                flagged[_CHUNK_INDEX.size - 1] |= RESULT_FLAG >> 24  # the index's top byte
                frames = (flagged, *frames[1:])
            with trio.fail_after(self.config.reducer_timeout), self._sending(stream, frames):
                await stream.send_bytes_batch(frames)
            self._frame_sent(chunk, sender)

    async def _completed(self, chunks: range) -> None:
        """Encode each newly finished chunk once, for every responder, and wake
        them. Shielded: a chunk the reducer finished is always published, also
        while the caller is being cancelled (encoding takes bounded time)."""
        assert self.reducer is not None
        for chunk in chunks:
            contributors = self.reducer.contributors(chunk)
            prefix = _CHUNK_INDEX.pack(chunk) + contributor_mask(contributors, self.group.size)
            values = self.reducer.result(chunk)
            if values is None:
                self._frames[chunk] = (prefix,)
            else:
                # NONE sends the accumulator's own memory: a finished chunk is
                # not written again, and the accumulator outlives the replies.
                with trio.CancelScope(shield=True):
                    header, payload = await _encode(values, self.codec)
                self._frames[chunk] = (prefix + header, payload)
            self._frame_waiters[chunk] = set(self._responders)
            if not self._responders:
                del self._frames[chunk]
            self._chunk_done[chunk].set()

    def _frame_sent(self, chunk: int, sender: int) -> None:
        waiting = self._frame_waiters.get(chunk)
        if waiting is None:
            return
        waiting.discard(sender)
        if not waiting:
            del self._frame_waiters[chunk]
            self._frames.pop(chunk, None)

    def _release_responder(self, sender: int) -> None:
        self._responders.discard(sender)
        for chunk in list(self._frame_waiters):
            self._frame_sent(chunk, sender)

    # ------------------------------------------------------------------ sender

    async def send_part(self, part: int) -> None:
        """The sender role for one part: send it, receive it averaged.

        The per-reducer boundary: any failure (or ``reducer_timeout``) leaves
        the chunks of this part not yet received at their local values.
        """
        member = self.group.members[part]
        try:
            if part == self.group.local_index:
                local, remote = _local_stream_pair(member.peer_id)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._serve_local, remote)
                    try:
                        await self._exchange(local, part)
                    finally:
                        await local.aclose()
            else:
                async with self.net.open_stream(
                    member.peer_id, member.address, ALLREDUCE_STREAM
                ) as stream:
                    if part in self._pushed:
                        self._push_decided[part].set()  # our results for it go here
                    rate = self._pacing(part)
                    if rate is not None:
                        stream.pace(rate)
                    try:
                        await self._exchange(stream, part)
                    except ProtocolError as e:
                        self._blame(part, e)
                        raise
                    finally:
                        if rate is not None:
                            stream.pace(None)  # the connection goes back to the pool
        except SelfDialError as e:
            self.self_dialed.add(part)
            logger.warning(
                "all-reduce: member %d (%s) announced %s:%d, which leads back to this peer (%s);"
                " our data is not in its part",
                part,
                member.peer_id.short(),
                *member.address,
                e,
            )
        except LocalTensorError:
            raise  # our own tensors cannot be encoded: our failure, not the reducer's
        except Exception as e:  # per-peer boundary
            if part in self._pushed:  # its results come on its own stream
                logger.info("all-reduce: sending to member %d failed: %r", part, e)
            else:
                logger.info("all-reduce: reducer of part %d failed: %r", part, e)
        finally:
            if part in self._pushed:
                if self._push_decided[part].is_set():
                    self._release_responder(part)
                else:  # no stream to it: our results go back on its stream
                    self._unpushed.add(part)
                    self._push_decided[part].set()
        if part not in self._pulled:
            self.received.reducer_failed(part)

    def _pacing(self, part: int) -> float | None:
        """The pace of our stream to the reducer of ``part``: our upload rate
        (``upload_pacing``) times the share of our round's upload that goes
        on that stream (our data of its part, and our results for it if they
        go there too). The replies on others' streams count in the whole."""
        rate = self.config.upload_pacing
        if rate is None or self.group.local.mode is MemberMode.AUX:
            return None
        me = self.group.local_index
        ours = self.codec.encoded_size(self.partition.part_size(me))

        def upload(j: int) -> int:  # what we send on our stream to member j
            data = self.codec.encoded_size(self.partition.part_size(j))
            return data + (ours if j in self._pushed else 0)

        remote = [j for j in range(self.group.size) if j != me]
        replies = sum(ours for j in remote if j not in self._pushed and j in self.group.senders())
        total = sum(upload(j) for j in remote) + (replies if self.reducer is not None else 0)
        return rate * upload(part) / total if total else None

    async def _serve_local(self, stream: _LocalStream) -> None:
        """Our own part, reduced by our own reducer, through the same code."""
        try:
            header = await stream.receive()
            sender, weight = self.check_header(stream, header)
            await self.accept(stream, sender, weight)
        except Exception as e:  # per-peer boundary (here: ourselves)
            logger.info("all-reduce: local reducer refused: %r", e)
        finally:
            await stream.aclose()

    async def _exchange(self, stream: StreamLike, part: int) -> None:
        g = self.group
        await stream.send(
            [
                PROTOCOL_VERSION,
                g.group_id,
                part,
                g.local_index,
                self.weight,
                self.partition.chunk_elements,
                self.partition.total,
            ]
        )
        failure: list[BaseException] = []
        window = self._windows[part]
        pushing = part in self._pushed
        async with trio.open_nursery() as nursery:
            whole = nursery.cancel_scope
            if pushing:
                # Our results for that member go here too, and a failure to
                # send our chunks must not stop them (the member excludes us
                # from the chunks that do not come); its results come on its
                # own stream, or back here (``_results_or_end``).
                nursery.start_soon(self._send_chunks, stream, part, window, None, failure)
                nursery.start_soon(self._results_or_end, stream, part, whole, failure)
            else:
                nursery.start_soon(self._send_chunks, stream, part, window, whole, failure)
            try:
                if pushing:
                    await self._reply(stream, part, pushed=True)
                    # Chunks that its reducer finished without us need not be sent.
                    await window.wait_finished(self.partition.num_chunks(part))
                else:
                    await self._receive_results(stream, part)
            except Exception as e:  # per-peer boundary, re-raised outside the nursery
                failure.insert(0, e)
            whole.cancel()  # done, or failed: what is still being sent is not needed
        if failure and (pushing or not self.received.is_complete(part)):
            raise failure[0]

    async def _results_or_end(
        self,
        stream: StreamLike,
        part: int,
        scope: trio.CancelScope,
        failure: list[BaseException],
    ) -> None:
        """Our stream to a member whose results come on its own stream
        (``results_on_reducer_stream``) carries nothing back, unless that
        member could not open its stream to us: then its results come back
        here, as to a client. Once the member ends the stream, it expects
        nothing more from us (it ends it cleanly once it has everything, or
        resets it when it gives up on us), so ``scope``'s sends stop. A
        failure is added to ``failure``."""
        try:
            try:
                first = await stream.receive()
            except EndOfStreamError:
                scope.cancel()
                return
            await self._receive_results(stream, part, first)
        except Exception as e:  # per-peer boundary: the caller raises it
            failure.append(e)
            scope.cancel()

    async def _send_chunks(
        self,
        stream: StreamLike,
        part: int,
        window: _Window,
        scope: trio.CancelScope | None,
        failure: list[BaseException],
    ) -> None:
        """Send the part's chunks as the window allows; chunk k+1 is encoded
        while chunk k is sent (``_overlapped``). A failure is added to
        ``failure`` and cancels ``scope``; without a scope (our results go on
        the same stream, and keep going) the reducer excludes us when the
        next chunk does not come."""
        start, _ = self.partition.part_bounds[part]
        num_chunks = self.partition.num_chunks(part)

        async def encode(chunk: int) -> _Frames | None:
            if chunk == num_chunks:
                return None
            await window.wait_to_send(chunk)
            await self.fault.before_send(chunk)
            a, b = self.partition.chunk_bounds(part, chunk)
            # NONE sends the vector's own memory. That is safe: results for
            # this chunk, which overwrite it, come only once the reducer
            # has all of it (or has excluded us and ignores the rest).
            header, payload = await _encode(self.flat[start + a : start + b], self.codec)
            return (_CHUNK_INDEX.pack(chunk) + header, payload)

        async def send(frames: _Frames) -> None:
            with self._sending(stream, frames):
                await stream.send_bytes_batch(frames)

        try:
            await _overlapped(encode, send)
        except Exception as e:  # per-peer boundary: ends this exchange
            failure.append(e)
            if scope is not None:
                scope.cancel()

    async def _receive_results(self, stream: StreamLike, part: int, first: Any = None) -> None:
        """Put the reducer's averaged chunks of ``part`` into place, in order;
        chunk k+1 arrives while chunk k is decoded and copied (``_overlapped``).
        ``first``: the first frame, if the caller received it already."""
        pending = [] if first is None else [first]
        senders = frozenset(self.group.senders())
        next_chunk = self.received.next_chunk(part)
        num_chunks = self.partition.num_chunks(part)

        async def receive(turn: int) -> _Result | None:
            nonlocal next_chunk
            chunk, scratch = next_chunk, scratches[turn % 2]
            if chunk == num_chunks:
                return None
            a, b = self.partition.chunk_bounds(part, chunk)
            check = _FiniteCheck()
            payload = None
            with trio.fail_after(self.config.reducer_timeout):
                frame = pending.pop() if pending else await stream.receive()
                contributors, blob_header, size = parse_result_header(
                    frame, chunk, self.group.size, senders, b - a
                )
                if blob_header is not None:
                    with self._receiving(stream, size):
                        payload = await scratch.receive(stream, size, check.watch(blob_header))
            next_chunk += 1
            blob = None if blob_header is None or payload is None else (blob_header, payload)
            return _Result(chunk, contributors, blob, check)

        with _registry(self.net).scratch() as first, _registry(self.net).scratch() as second:
            scratches = (first, second)
            await _overlapped(
                receive, partial(self._place, part, own=isinstance(stream, _LocalStream))
            )

    # ------------------------------------------------------------------ result

    def result(self, *, timed_out: bool) -> AllReduceResult:
        me = self.group.local_index
        if self.group.local.mode is MemberMode.AUX:
            contributors: list[tuple[frozenset[int], ...]] = [
                tuple(frozenset() for _ in range(self.partition.num_chunks(j)))
                for j in range(self.group.size)
            ]
            if self.reducer is not None:
                contributors[me] = tuple(
                    self.reducer.contributors(c) if c < self.reducer.completed else frozenset()
                    for c in range(self.reducer.num_chunks)
                )
            table = tuple(contributors)
        else:
            table = self.received.contributors()
        failed_reducers = frozenset(
            j
            for j in range(self.group.size)
            if self.group.local.mode is not MemberMode.AUX
            and not self.received.is_complete(j)
            and j not in self.self_dialed
        )
        return AllReduceResult(
            group_id=self.group.group_id,
            local_index=me,
            part_bounds=self.partition.part_bounds,
            chunk_elements=self.partition.chunk_elements,
            contributors=table,
            failed_senders=self.reducer.failed if self.reducer is not None else frozenset(),
            failed_reducers=failed_reducers,
            timed_out=timed_out,
            self_dialed=frozenset(self.self_dialed),
        )


class _Window:
    """How many chunks a sender may run ahead of the results (``window_bytes``)."""

    def __init__(self, size: int) -> None:
        self.size: float = size
        self.results = 0
        self._changed = trio.Event()

    def advance(self, results: int) -> None:
        """``results`` averaged chunks of the part have come back."""
        self.results = results
        self._changed.set()
        self._changed = trio.Event()

    def open(self) -> None:
        """No more results will come back (they come on another stream, which
        ended): the sender sends the rest of its part without waiting."""
        self.size = math.inf
        self.advance(self.results)

    async def wait_finished(self, num_chunks: int) -> None:
        """Return once all ``num_chunks`` results came back, or no more will."""
        while self.results < num_chunks and self.size != math.inf:
            await self._changed.wait()

    async def wait_to_send(self, chunk: int) -> None:
        """Return once ``chunk`` is within the window."""
        while chunk - self.results >= self.size:
            await self._changed.wait()


def parse_sender_header(
    message: Any, group: Group, partition: Partition, remote: PeerID
) -> tuple[int, float]:
    """A sender's stream header, checked against this round; (sender index, weight).

    Raises ``ProtocolError`` (and nothing else) with the one-line reason for
    the refusal: malformed, another version, part or vector layout, a member
    index that is not ``remote`` or is auxiliary, a negative or non-finite weight.
    """
    fields = expect_list(message, 7, "all-reduce header")
    version = expect_int(fields[0], "version")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"all-reduce protocol version {version}, expected {PROTOCOL_VERSION}")
    part = expect_int(fields[2], "part")
    if part != group.local_index:
        raise ProtocolError(f"part {part} is not reduced here (this is member {group.local_index})")
    sender = expect_int(fields[3], "sender", lo=0, hi=group.size - 1)
    weight = expect_float(fields[4], "weight")
    if weight < 0:
        raise ProtocolError("weight must be >= 0")
    if expect_int(fields[5], "chunk_elements") != partition.chunk_elements:
        raise ProtocolError(f"chunk_elements differ: ours is {partition.chunk_elements}")
    if expect_int(fields[6], "total") != partition.total:
        raise ProtocolError(f"vector sizes differ: ours has {partition.total} elements")
    member = group.members[sender]
    if remote != member.peer_id:
        raise ProtocolError(f"member {sender} of the group is another peer")
    if member.mode is MemberMode.AUX:
        raise ProtocolError(f"member {sender} is auxiliary and sends no data")
    return sender, weight


def parse_chunk_header(
    frame: Any, expected_chunk: int, expected_length: int
) -> tuple[memoryview, int]:
    """A sender's chunk header frame, ``u32 chunk index | blob header``.

    Returns the blob header and the payload size it announces. Raises
    ``ProtocolError`` (and nothing else) if the frame is not raw bytes of that
    size, names another chunk than ``expected_chunk`` or a blob that is not
    ``expected_length`` values.
    """
    data = memoryview(_expect_frame(frame, "chunk header")).cast("B")
    if len(data) != _CHUNK_HEADER_SIZE:
        raise ProtocolError(f"chunk header of {len(data)} bytes")
    (chunk,) = _CHUNK_INDEX.unpack_from(data)
    if chunk != expected_chunk:
        raise ProtocolError(f"chunk {chunk} out of order, expected {expected_chunk}")
    blob_header = data[_CHUNK_INDEX.size :]
    return blob_header, payload_size(blob_header, expected_length=expected_length)


def parse_result_header(
    frame: Any,
    expected_chunk: int,
    group_size: int,
    senders: frozenset[int],
    expected_length: int,
) -> tuple[frozenset[int], memoryview | None, int]:
    """A reducer's result frame, ``u32 chunk index | contributor mask | blob header``.

    Returns the contributors, the blob header (None when the chunk has no
    result: no contributors, no blob, no payload frame) and the payload size.
    Raises ``ProtocolError`` (and nothing else) for a frame of the wrong size
    or chunk, contributors that are not ``senders``, or a bad blob header.
    """
    data = memoryview(_expect_frame(frame, "result frame")).cast("B")
    header = _CHUNK_INDEX.size + mask_size(group_size)
    if len(data) < header:
        raise ProtocolError("result frame shorter than its header")
    (index,) = _CHUNK_INDEX.unpack_from(data)
    if index != expected_chunk:
        raise ProtocolError(f"result chunk {index} out of order, expected {expected_chunk}")
    mask = data[_CHUNK_INDEX.size : header]
    contributors = mask_members(mask, group_size)
    if not contributors <= senders:
        raise ProtocolError("result names contributors that are not senders")
    if not contributors:
        if len(data) != header:
            raise ProtocolError("a result without contributors carries no values")
        return contributors, None, 0
    blob_header = data[header:]
    return contributors, blob_header, payload_size(blob_header, expected_length=expected_length)


def _expect_frame(obj: Any, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(obj, bytes | bytearray | memoryview):
        raise ProtocolError(f"{what}: expected raw bytes, got {type(obj).__name__}")
    return obj


#: Bytes of payload a ``_FiniteCheck`` lets arrive before it sums them: smaller
#: pieces cost more in calls than they save.
_CHECK_BYTES = 256 * 1024


#: codec work runs in one worker thread of the trio run at a time: torch
#: spreads each cast or quantization over the cores already, and several at
#: once oversubscribe them (three members in one process: 3.2 s for five
#: rounds against 2.3 s inline, before this limit)
_CODEC_WORKER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("codec_worker")


def _codec_worker() -> trio.CapacityLimiter:
    try:
        return _CODEC_WORKER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(1)
        _CODEC_WORKER.set(limiter)
        return limiter


async def _encode(
    values: torch.Tensor, codec: Codec
) -> tuple[bytes, bytes | bytearray | memoryview]:
    """``encode_split`` of a chunk, in a worker thread unless it is only a view
    (``NONE``): casting or quantizing a chunk of a million values takes
    milliseconds that the event loop's other streams and DHT replies must not
    wait for."""
    if codec.kind is CodecKind.NONE:
        return encode_split(values, codec)
    return await trio.to_thread.run_sync(encode_split, values, codec, limiter=_codec_worker())


async def _decode(
    header: bytes | bytearray | memoryview,
    payload: bytes | bytearray | memoryview,
    length: int,
    check: _FiniteCheck | None,
) -> tuple[torch.Tensor, bool]:
    """A received chunk's values (``decode_split``, ``length`` of them) and
    whether they are all finite (True without a ``check``: trusted values).
    Raw float32 is a view of ``payload``, checked as it arrived, so it stays
    on this thread; any other codec is decoded and checked in a worker thread
    (``payload`` must stay untouched until this returns)."""

    def decode() -> tuple[torch.Tensor, bool]:
        values = decode_split(header, payload, expected_length=length)
        return values, check is None or check.all_finite(values)

    if is_raw_float32(header):
        return decode()
    return await trio.to_thread.run_sync(decode, limiter=_codec_worker())


class _FiniteCheck:
    """Whether a part's values are free of NaN and Inf, checked as they arrive.

    A raw float32 payload is summed piece by piece while ``receive_into``
    reports it in place (``watch``), a few hundred KiB at a time, instead of
    in one pass over the whole 4 MiB payload once it is there. Summing was
    the largest cost of the all-reduce after the kernel's copies and the MAC
    (``benchmarks/allreduce.py --profile``); in encrypted sessions each piece
    has just been written by the decryption, so it is read from the CPU's
    cache rather than from memory.
    In plaintext sessions the pieces are not yet authenticated when they are
    summed, which is harmless: the check only reads, and nothing uses its
    answer before the whole frame has been authenticated and returned.
    ``all_finite`` checks what the pieces did not cover (any other codec:
    everything).
    """

    def __init__(self) -> None:
        self._checked = 0  # values of the payload summed so far, from its start
        self._finite = True
        self._values: torch.Tensor | None = None  # the payload, once it is watched

    def watch(
        self, blob_header: bytes | bytearray | memoryview
    ) -> Callable[[memoryview, int], None] | None:
        """The ``progress`` hook for the payload of ``blob_header``'s blob, if
        its bytes are the values themselves."""
        return self._progress if is_raw_float32(blob_header) else None

    def _progress(self, payload: memoryview, done: int) -> None:
        end = done // 4
        if (end - self._checked) * 4 < _CHECK_BYTES or payload.nbytes % 4:
            return  # a payload of another size is refused anyway
        if self._values is None:
            self._values = torch.frombuffer(payload, dtype=torch.float32)
        if self._finite:
            self._finite = all_finite(self._values[self._checked : end])
        self._checked = end

    def all_finite(self, values: torch.Tensor) -> bool:
        """Whether every one of ``values``, decoded from the payload, is finite."""
        return self._finite and all_finite(values[self._checked :])


class _Scratch:
    """A reusable receive buffer for the payloads of one stream."""

    def __init__(self, buffer: bytearray) -> None:
        self.buffer = buffer

    async def receive(
        self,
        stream: StreamLike,
        size: int,
        progress: Callable[[memoryview, int], None] | None = None,
    ) -> memoryview:
        """Receive the next raw frame, of exactly ``size`` bytes, into the
        buffer; the view is valid until the next call. ``ProtocolError`` if the
        frame is larger (from the stream) or smaller. ``progress`` watches it
        arrive (``receive_into``)."""
        if isinstance(stream, _LocalStream):
            # Our own part: the frame is the sender's memory, which stays
            # unchanged until the receiver is done with it. No copy.
            view = memoryview(_expect_frame(await stream.receive(), "payload")).cast("B")
            received = view.nbytes
        else:
            if len(self.buffer) < size:
                self.buffer = bytearray(size)
            view = memoryview(self.buffer)[:size]
            received = await stream.receive_into(view, progress)
        if received != size:
            raise ProtocolError(f"payload of {received} bytes, expected {size}")
        return view


#: A chunk's two frames as sent: its header, then its payload.
_Frames = tuple[bytes, bytes | bytearray | memoryview]


class _Arrival(NamedTuple):
    """A sender's chunk, received into a scratch buffer, not yet decoded."""

    chunk: int
    header: memoryview
    payload: memoryview
    check: _FiniteCheck


class _Result(NamedTuple):
    """A reducer's averaged chunk, received into a scratch buffer, not yet
    decoded; ``blob`` (header, payload) is None when the chunk has no result."""

    chunk: int
    contributors: frozenset[int]
    blob: tuple[memoryview, memoryview] | None
    check: _FiniteCheck


class _Item(NamedTuple):
    """What a stream with both a sender's chunks and its results brings: one of them."""

    arrival: _Arrival | None
    result: _Result | None


async def _dispatched(
    produce: Callable[[], Awaitable[_Item | None]],
    add: Callable[[_Arrival], Awaitable[None]],
    place: Callable[[_Result], Awaitable[None]],
) -> None:
    """``_overlapped`` for a stream of chunks and results: each kind has its
    own consumer, so that decoding one kind (a codec's work in the worker
    thread) does not hold up the other, as when they came on two streams.
    Chunk k+1 is handed to ``add`` only once it returned for chunk k (and
    so for results): each kind's items may alternate between two buffers.
    Failures as in ``_overlapped``."""
    arrivals_in, arrivals = trio.open_memory_channel[_Arrival](0)
    results_in, results = trio.open_memory_channel[_Result](0)

    async def feed() -> None:
        async with arrivals_in, results_in:
            while (item := await produce()) is not None:
                if item.arrival is not None:
                    await arrivals_in.send(item.arrival)
                if item.result is not None:
                    await results_in.send(item.result)

    await _pumped(feed, (arrivals, add), (results, place))


async def _use_all(
    items: trio.MemoryReceiveChannel[_T], use: Callable[[_T], Awaitable[None]]
) -> None:
    async with items:
        async for item in items:
            await use(item)


async def _pumped(
    feed: Callable[[], Awaitable[None]],
    *consumers: tuple[trio.MemoryReceiveChannel[Any], Callable[[Any], Awaitable[None]]],
) -> None:
    """Run ``feed`` (which sends to the consumers' channels and closes them)
    beside each consumer's ``use`` of its channel's items. A failure of
    ``feed`` is raised once the consumers are done with what it sent before
    it; a failure of a consumer ends everything at once. Either is raised as
    itself, not in a group."""
    failure: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            for items, use in consumers:
                nursery.start_soon(_use_all, items, use)
            try:
                await feed()
            except Exception as e:  # raised once the items before it are used
                failure = e
    except BaseExceptionGroup as group:
        _raise_first_failure(group)
    if failure is not None:
        raise failure


def _raise_first_failure(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the first failure of ``group`` alone (or the group, if it holds
    only cancellations). Where an enclosing scope is cancelled meanwhile,
    the group holds its Cancelled beside the failure. Raised alone, the
    failure reaches the caller's per-peer boundary; the Cancelled comes
    again at the caller's next checkpoint (a cancelled scope stays cancelled)."""
    _, failures = group.split(trio.Cancelled)
    if failures is None:
        raise group
    first: BaseException = failures
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    raise first from first.__cause__


async def _overlapped(
    produce: Callable[[int], Awaitable[_T | None]],
    use: Callable[[_T], Awaitable[None]],
) -> None:
    """Hand the items ``produce(0)``, ``produce(1)``, ... (None: no more) to
    ``use`` in order, producing item k+1 while ``use`` works on item k.

    A codec's decoding or encoding takes the worker thread milliseconds per
    chunk; a stream's loop that waited for it left the socket unread (or
    unfed) meanwhile (float16 at 2 Gbit/s: 0.81 s a round, against 0.50 s
    with the codec inline). The channel has no room: item k+1 is handed over
    only once ``use`` returned for item k, so ``produce(k + 2)`` may reuse
    what item k held (a receive buffer: two alternate).

    A failure of ``produce`` is raised once ``use`` is done with what was
    produced before it: a chunk that arrived whole is still added, and one
    whose send began is still sent, as when the two did not overlap. A
    failure of ``use`` ends both at once. Either is raised as itself, not in
    a group (``_pumped``).
    """
    send, produced = trio.open_memory_channel[_T](0)

    async def feed() -> None:
        async with send:
            for turn in itertools.count():
                item = await produce(turn)
                if item is None:
                    break
                await send.send(item)

    await _pumped(feed, (produced, use))


async def _refuse(done: trio.Event, stream: StreamLike, reason: str) -> None:
    logger.info("all-reduce: refused a stream from %s: %s", stream.remote, reason)
    await stream.aclose()
    done.set()


# ---------------------------------------------------------------- the registry


class _Registry:
    """The rounds this peer runs now, by group id; routes incoming streams."""

    def __init__(self) -> None:
        self._rounds: RoundsByGroup[_Round] = RoundsByGroup()
        self._spares: list[torch.Tensor] = []
        self._spare_scratch: list[bytearray] = []
        #: groups this peer withdrew from, until when it refuses their streams
        self._withdrawn: dict[bytes, float] = {}
        #: withdrawal notices of others: (group id, peer) -> until when
        self._notices: dict[tuple[bytes, PeerID], float] = {}
        #: the weights group-mates announced in the headers of the streams they
        #: began to this peer: (group id, peer) -> (weight, until when)
        self._weights: dict[tuple[bytes, PeerID], tuple[float, float]] = {}
        self._weight_listeners: list[Callable[[bytes, PeerID, float], None]] = []

    def _expire(self) -> None:
        now = trio.current_time()
        for gid in [g for g, until in self._withdrawn.items() if until <= now]:
            del self._withdrawn[gid]
        for key in [k for k, until in self._notices.items() if until <= now]:
            del self._notices[key]
        for wkey in [k for k, (_, until) in self._weights.items() if until <= now]:
            del self._weights[wkey]

    def withdraw(self, group_id: bytes) -> None:
        """This peer withdrew from ``group_id``: refuse its streams from now on
        (also those already waiting for the round to start)."""
        self._expire()
        self._withdrawn[group_id] = trio.current_time() + WITHDRAWAL_TTL
        self._rounds.wake()

    def has_withdrawn(self, group_id: bytes) -> bool:
        return group_id in self._withdrawn

    def withdrawn_from(self, group_id: bytes) -> frozenset[PeerID]:
        """The peers whose notices say they withdrew from ``group_id``."""
        self._expire()
        return frozenset(peer for gid, peer in self._notices if gid == group_id)

    async def _note_withdrawal(self, stream: StreamLike, message: Any) -> None:
        """A group-mate's ``["withdraw", version, group_id]``: remember it, tell
        the round if it runs, and answer ``["ok"]``. Raises ``ProtocolError``
        if the notice is malformed."""
        fields = expect_list(message, 3, "withdrawal notice")
        version = expect_int(fields[1], "version")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"all-reduce protocol version {version}, expected {PROTOCOL_VERSION}"
            )
        gid = expect_bytes(fields[2], "group id", max_size=64)
        self._expire()
        while len(self._notices) >= MAX_WITHDRAWAL_NOTICES:
            del self._notices[next(iter(self._notices))]
        self._notices[(gid, stream.remote)] = trio.current_time() + WITHDRAWAL_TTL
        rnd = await self._rounds.find(gid, wait=0)
        if rnd is not None:
            await rnd.withdraw(stream.remote)
        await stream.send(["ok"])

    def note_weight(self, group_id: bytes, peer: PeerID, weight: Any) -> None:
        """A group-mate began its all-reduce to us announcing ``weight`` (in a
        butterfly or a ring header): keep it (bounded, like withdrawal notices)
        and tell the listeners. A weight that is no finite number >= 0 is left
        for ``check_header`` to refuse."""
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            return
        self._expire()
        while len(self._weights) >= MAX_WITHDRAWAL_NOTICES:
            del self._weights[next(iter(self._weights))]
        self._weights[(group_id, peer)] = (float(weight), trio.current_time() + WITHDRAWAL_TTL)
        for listener in self._weight_listeners:
            listener(group_id, peer, float(weight))

    def sender_weights(self, group_id: bytes) -> dict[PeerID, float]:
        self._expire()
        return {peer: w for (gid, peer), (w, _) in self._weights.items() if gid == group_id}

    @contextmanager
    def listen_to_weights(self, listener: Callable[[bytes, PeerID, float], None]) -> Iterator[None]:
        self._weight_listeners.append(listener)
        try:
            yield
        finally:
            self._weight_listeners.remove(listener)

    def take_buffer(self, size: int) -> torch.Tensor:
        """An accumulator of at least ``size`` float32 values (contents undefined).

        The spare from an earlier round is reused if it is large enough:
        touching fresh memory page by page costs more than the reduction.
        """
        for i, spare in enumerate(self._spares):
            if spare.numel() >= size:
                return self._spares.pop(i)
        return torch.empty(size, dtype=torch.float32)

    def give_buffer(self, buffer: torch.Tensor) -> None:
        # One spare: rounds of one peer rarely overlap, and a spare is memory
        # held between rounds.
        if not self._spares or buffer.numel() > self._spares[0].numel():
            self._spares = [buffer]

    @contextmanager
    def scratch(self) -> Iterator[_Scratch]:
        """A receive buffer for one stream of a round, reused by later rounds:
        allocating and zeroing several MiB per stream and round cost more
        than the checks on what it receives."""
        scratch = _Scratch(self._spare_scratch.pop() if self._spare_scratch else bytearray())
        try:
            yield scratch
        finally:
            if len(self._spare_scratch) < _SPARE_SCRATCH:
                self._spare_scratch.append(scratch.buffer)

    def register(self, rnd: _Round) -> AbstractContextManager[None]:
        """``rnd`` receives its group's streams while the block runs."""
        return self._rounds.register(rnd.group.group_id, rnd)

    async def handle(self, stream: StreamLike) -> None:
        """The connection handler of ``ALLREDUCE_STREAM``.

        Raises ``ProtocolError`` to refuse a stream (the connections manager
        resets it with that reason): malformed header, unknown group after
        ``UNKNOWN_GROUP_WAIT``, finished round, header inconsistent with the
        group. Otherwise returns when the round has served the stream.
        """
        with trio.move_on_after(HEADER_TIMEOUT) as wait:
            header = await stream.receive()
        if wait.cancelled_caught:
            raise ProtocolError("no all-reduce header in time")
        if isinstance(header, list) and header and header[0] == WITHDRAW:
            await self._note_withdrawal(stream, header)
            return
        fields = expect_list(header, 7, "all-reduce header")
        gid = expect_bytes(fields[1], "group id", max_size=64)
        self.note_weight(gid, stream.remote, fields[4])
        rnd = await self._rounds.find(
            gid, wait=UNKNOWN_GROUP_WAIT, unless=lambda: gid in self._withdrawn
        )
        if gid in self._withdrawn:
            raise ProtocolError(f"this member withdrew from the round of group {gid.hex()[:16]}")
        if rnd is None:
            raise ProtocolError(f"no all-reduce round for group {gid.hex()[:16]} here")
        sender, weight = rnd.check_header(stream, header)
        await rnd.accept(stream, sender, weight)


_registries: WeakKeyDictionary[Any, _Registry] = WeakKeyDictionary()


def serve_allreduce(net: Network) -> None:
    """Accept all-reduce streams on ``net`` from now on.

    ``all_reduce`` does this itself, but a peer that will join groups should do
    it up front: a member that enters the round a moment before this peer would
    otherwise find no handler here and count this peer as a failed reducer.
    The lossy round's control streams (``_lossy``) are served from then on too.
    """
    registry = _registry(net)
    serve_lossy_allreduce(net)
    serve_ring(net, registry.note_weight)


def sender_weights(net: Network, group_id: bytes) -> dict[PeerID, float]:
    """The weights that members of group ``group_id`` announced when they began
    sending their all-reduce to this peer (kept for a while, also when this
    peer has not started that round yet): a member that began its round has
    stopped adding to it, and its weight is final. Around the ring
    (``AllReduceConfig.ring``) a member sends only to its successor, so only
    our predecessor's weight arrives here."""
    return _registry(net).sender_weights(group_id)


def listen_to_sender_weights(
    net: Network, listener: Callable[[bytes, PeerID, float], None]
) -> AbstractContextManager[None]:
    """While the block runs, ``listener(group_id, peer, weight)`` hears of each
    weight as ``sender_weights`` keeps it (on the trio thread)."""
    return _registry(net).listen_to_weights(listener)


def _registry(net: Network) -> _Registry:
    registry = _registries.get(net)
    if registry is None:
        registry = _registries[net] = _Registry()
        net.set_handler(ALLREDUCE_STREAM, registry.handle)
    return registry


# ------------------------------------------------------ the in-memory stream


class _LocalStream:
    """One end of an in-memory stream, for the part a member reduces itself."""

    def __init__(
        self,
        remote: PeerID,
        send: trio.MemorySendChannel[Any],
        receive: trio.MemoryReceiveChannel[Any],
    ) -> None:
        self.remote = remote
        self._send = send
        self._receive = receive

    async def send(self, message: Any) -> None:
        await self._send.send(message)

    async def send_bytes(self, data: bytes | bytearray | memoryview) -> None:
        # Frames are buffers that the sender does not change before the
        # receiver is done with them (the vector's chunk until its result
        # comes, a finished chunk of the accumulator).
        await self._send.send(data)

    async def send_bytes_batch(self, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        for data in frames:
            await self._send.send(data)

    async def receive(self) -> Any:
        return await self._receive.receive()

    async def receive_into(
        self,
        buffer: bytearray | memoryview,
        progress: Callable[[memoryview, int], None] | None = None,
    ) -> int:
        # ``progress`` may skip pieces, so it skips all: the caller checks them.
        data = memoryview(await self._receive.receive()).cast("B")
        view = memoryview(buffer).cast("B")
        if data.nbytes > view.nbytes:
            raise ProtocolError(f"a frame of {data.nbytes} bytes, more than {view.nbytes}")
        view[: data.nbytes] = data
        return data.nbytes

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()

    def unacknowledged_bytes(self) -> int:
        return 0  # nothing crosses a link

    def queueing_delay(self) -> float | None:
        return None  # nothing crosses a link

    def pace(self, rate: float | None) -> None:
        pass  # nothing crosses a link


def _local_stream_pair(peer: PeerID) -> tuple[_LocalStream, _LocalStream]:
    a_send, b_receive = trio.open_memory_channel[Any](2)
    b_send, a_receive = trio.open_memory_channel[Any](2)
    return _LocalStream(peer, a_send, a_receive), _LocalStream(peer, b_send, b_receive)
