"""``Averager``: average a set of tensors with whoever is alive, in Moshpit groups.

One ``step()`` is one Moshpit round (Ryabinin et al. 2021, Algorithm 1): find
this round's group key on the grid, form a group there (``_matchmaking``),
run the butterfly all-reduce with it (``_allreduce``), and move to the cell the
group assigned for the next round (``_moshpit``). The averaged values are
written into the averager's tensors in place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import trio

from swarm import ConfigError, PeerID, SwarmError

from ._allreduce import AllReduceConfig, AllReduceResult, all_reduce, serve_allreduce
from ._codecs import NONE, Codec
from ._faults import FaultPlan
from ._group import Group, GroupMember, MemberMode
from ._link_meter import LinkMeter
from ._matchmaking import Expected, Matchmaker, MatchmakingConfig
from ._moshpit import MoshpitGrid, MoshpitState
from ._scheduled import ScheduledRound
from ._staging import ChunkedStaging

log = logging.getLogger(__name__)

#: The share of a declared upload rate that ``AveragerConfig.with_upload_rate``
#: paces at. The pacing rate counts IP packets, while a link also carries each
#: frame's own header (Ethernet's 14-38 bytes per 1,500, PPPoE or DOCSIS more),
#: and a provider's shaper rounds in its own favour: paced at the full rate,
#: the flows still outrun the link and queue at it, which pacing is there to
#: avoid. On 4 peers x 100 Mbit/s (tbf), 97-98.5 Mbit/s paced best.
UPLOAD_PACING_SHARE = 0.97


class StepInProgressError(SwarmError, RuntimeError):
    """``step()`` was called while another ``step()`` of the same averager runs."""


@dataclass(frozen=True)
class AveragerConfig:
    """Everything about how an averager averages, validated on construction."""

    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    codec: Codec = NONE
    #: this peer's declared share of the reducing work, relative to the
    #: others'. None (the default): parts follow the upload rates the members
    #: measured in their earlier rounds (``_link_meter``), equal shares until
    #: every member of a group has measured. A number overrides the
    #: measurement: this peer then publishes none, and its groups cut parts by
    #: declared shares (1.0 for members that declared nothing). To declare
    #: a rate in bytes per second instead, which mixes with the others'
    #: measurements, use ``upload_rate``.
    bandwidth: float | None = None
    #: this peer's upload in bytes per second, if the user knows it
    #: (``swarm train --upload-rate``; set with ``with_upload_rate``, which
    #: paces the all-reduce to it as well): published in place of the
    #: measured upload, in the same unit, so parts follow it in groups where
    #: the others publish measurements. The download is still measured. A
    #: local setting: members may differ, or declare nothing.
    upload_rate: float | None = None
    #: NODE (default), AUX (reduces, weight 0); CLIENT follows the peer's client_mode
    mode: MemberMode = MemberMode.NODE
    #: peers the grid is sized for when no grid is given (MoshpitGrid.for_swarm)
    expected_peers: int = 256

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not (
            math.isfinite(self.bandwidth) and self.bandwidth > 0
        ):
            raise ConfigError(f"bandwidth={self.bandwidth} must be a positive number or None")
        if self.upload_rate is not None and not (
            math.isfinite(self.upload_rate) and self.upload_rate > 0
        ):
            raise ConfigError(
                f"upload_rate={self.upload_rate} must be a positive number of bytes per second"
                " or None"
            )
        if self.upload_rate is not None and self.bandwidth is not None:
            raise ConfigError(
                "declare bandwidth (a share relative to the others') or upload_rate (bytes per"
                " second), not both: a declared bandwidth publishes no rates at all"
            )
        if self.expected_peers < 1:
            raise ConfigError("expected_peers must be at least 1")

    def with_upload_rate(self, bytes_per_second: float) -> AveragerConfig:
        """This config for a peer whose upload is ``bytes_per_second``: it
        publishes that rate (``upload_rate``) and paces its all-reduce streams
        to ``UPLOAD_PACING_SHARE`` of it (``AllReduceConfig.upload_pacing``).
        Raises ``ConfigError`` for a rate that is not positive and finite."""
        declared = replace(self, upload_rate=bytes_per_second)  # validates the rate
        pacing = UPLOAD_PACING_SHARE * bytes_per_second
        return replace(declared, allreduce=replace(self.allreduce, upload_pacing=pacing))

    @property
    def step_bound(self) -> float:
        """The longest one ``step()`` takes: matchmaking, then the all-reduce."""
        return self.matchmaking.bound + self.allreduce.round_timeout


def chunked_contributors(results: Sequence[StepResult]) -> frozenset[PeerID]:
    """The peers whose data is in every element of a chunked average
    (``Averager.average_in_chunks``): in every chunk's result."""
    if not results:
        return frozenset()
    return frozenset.intersection(*(r.contributors for r in results))


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did. ``group`` is None when no group formed in time."""

    round: int
    key: str
    group: Group | None
    allreduce: AllReduceResult | None = None
    reason: str = ""

    @property
    def group_id(self) -> bytes | None:
        return None if self.group is None else self.group.group_id

    @property
    def members(self) -> tuple[PeerID, ...]:
        return () if self.group is None else tuple(m.peer_id for m in self.group.members)

    @property
    def contributors(self) -> frozenset[PeerID]:
        """Members whose data reached every element of our result."""
        if self.group is None or self.allreduce is None:
            return frozenset()
        indices = frozenset.intersection(
            *(
                self.allreduce.part_contributors(p)
                for p in range(len(self.allreduce.part_bounds))
                if self.allreduce.part_bounds[p][1] > self.allreduce.part_bounds[p][0]
            )
        )
        return frozenset(self.group.members[i].peer_id for i in indices)


class Averager:
    """Averages ``tensors`` (in place) with the peers that use the same ``prefix``.

    ``peer`` is a running ``swarm.AsyncPeer`` (or a sync ``swarm.Peer``: then call
    ``step_sync``). Every peer that averages together must use the same prefix,
    grid, tensor shapes and all-reduce config. ``initial_coordinates`` places
    this peer on the grid (by default a hash of its peer id decides).
    """

    def __init__(
        self,
        peer: Any,
        tensors: Sequence[torch.Tensor],
        *,
        prefix: str,
        target_group_size: int | None = None,
        min_group_size: int | None = None,
        config: AveragerConfig | None = None,
        grid: MoshpitGrid | None = None,
        initial_coordinates: tuple[int, ...] | None = None,
        fault_plan: FaultPlan | None = None,
    ) -> None:
        self._sync_peer = peer if hasattr(peer, "async_peer") else None
        self.peer = peer.async_peer if self._sync_peer is not None else peer
        config = config or AveragerConfig()
        if target_group_size is not None or min_group_size is not None:
            mm = config.matchmaking
            config = replace(
                config,
                matchmaking=MatchmakingConfig(
                    target_group_size=target_group_size or mm.target_group_size,
                    min_group_size=min_group_size or mm.min_group_size,
                    matchmaking_time=mm.matchmaking_time,
                    request_timeout=mm.request_timeout,
                    poll_interval=mm.poll_interval,
                ),
            )
        if not prefix or len(prefix) > 64 or any(c.isspace() for c in prefix):
            raise ConfigError(f"prefix {prefix!r} must be 1-64 characters without spaces")
        self.config = config
        self.prefix = prefix
        self.tensors = list(tensors)
        if not self.tensors:
            raise ConfigError("an averager needs at least one tensor")
        self.grid = grid or MoshpitGrid.for_swarm(
            config.expected_peers, config.matchmaking.target_group_size
        )
        coordinates = initial_coordinates or self.grid.initial_coordinates(self.peer.peer_id)
        self.state = MoshpitState(0, tuple(coordinates))
        self.grid.group_key(prefix, 0, self.state.coordinates)  # validates the coordinates
        self.fault_plan = fault_plan
        #: this peer's upload and download rates, measured from its rounds
        self.link_meter = LinkMeter(trio.current_time)
        self._matchmaker = Matchmaker(self.peer, prefix, config.matchmaking)
        self.peer.connections.set_handler(self._matchmaker.stream_name, self._matchmaker.handle)
        serve_allreduce(self.peer.connections)
        self._busy = False
        #: a scheduled round not yet triggered or cancelled (it holds the averager)
        self._pending: ScheduledRound | None = None

    def set_grid(self, grid: MoshpitGrid) -> None:
        """Use ``grid`` from the next round on (e.g. the swarm grew past a group).

        This peer takes its initial cell on the new grid; the round is kept.
        """
        if grid == self.grid:
            return
        self.grid = grid
        self.state = MoshpitState(self.state.round, grid.initial_coordinates(self.peer.peer_id))

    def set_matchmaking_time(self, seconds: float) -> None:
        """Use a matchmaking window of ``seconds`` from the next round on (e.g.
        adapted to measured rounds); the other matchmaking settings are kept.
        Raises ``ConfigError`` for a window the matchmaking config refuses
        (not positive, or shorter than its poll interval)."""
        matchmaking = replace(self.config.matchmaking, matchmaking_time=seconds)
        if matchmaking == self.config.matchmaking:
            return
        self.config = replace(self.config, matchmaking=matchmaking)
        self._matchmaker.config = matchmaking

    @property
    def mode(self) -> MemberMode:
        """CLIENT while the peer is one, unless others reach it through a relay
        (``AsyncPeer.relay_route``) or through connections punched through
        NATs (``swarm._punch``: those peers can, when its relay has gone);
        else the configured mode. The lossy data
        plane sends datagrams straight to a reducer's address, which a relay
        does not carry: there a relayed peer stays a client."""
        relayed = self.peer.relay_route is not None or bool(
            self.peer.connections.punched_peers()
        )
        if self.peer.client_mode and not (relayed and not self.config.allreduce.lossy):
            return MemberMode.CLIENT
        return self.config.mode

    def _member(self) -> GroupMember:
        """This peer as a group member: its declared share, or (by default)
        the rates its link was measured to move, the upload replaced by the
        declared one if any; announced through its relay when it has one."""
        host, port = self.peer.endpoint
        if self.mode is MemberMode.CLIENT:
            return GroupMember(self.peer.peer_id, host, port, 0.0, self.mode)
        relay = self.peer.relay_route
        if self.config.bandwidth is not None:
            return GroupMember(
                self.peer.peer_id, host, port, self.config.bandwidth, self.mode, relay=relay
            )
        meter = self.link_meter
        upload = meter.upload if self.config.upload_rate is None else self.config.upload_rate
        return GroupMember(
            self.peer.peer_id, host, port, 1.0, self.mode, upload, meter.download, relay
        )

    async def step(
        self,
        weight: float = 1.0,
        *,
        timeout: float | None = None,
        round: int | None = None,
        expected_peers: Expected | None = None,
    ) -> StepResult:
        """Run one averaging round; returns what happened.

        ``weight`` is this peer's weight in the mean (e.g. its sample count).
        ``round`` sets the Moshpit round (peers that average together must be in
        the same round, e.g. the training epoch); by default the averager counts
        its own rounds. Returns within ``timeout`` (default
        ``config.step_bound``) with ``group=None`` when no group formed: the
        tensors then keep their local values. Raises ``StepInProgressError`` if
        another step of this averager is running. On cancellation the tensors
        hold whole chunks, each either averaged or local. ``expected_peers``
        (how many, or which, this one included) lets a group close as soon as
        they all joined (``Matchmaker.find_group``).

        ``step`` is ``find_group`` then ``average``; callers that can do useful
        work meanwhile (a trainer finishing its batch) call the two apart, or
        ``schedule`` the round and trigger (or cancel) it later.
        """
        bound = self.config.step_bound if timeout is None else timeout
        group: Group | None = None
        with trio.move_on_after(bound):
            group = await self.find_group(round=round, expected_peers=expected_peers)
            if group is None:
                return self._missed(None, "no group formed in time")
            return await self.average(group, weight)
        reason = "timed out during the all-reduce" if group else "timed out in matchmaking"
        return self._missed(group, reason)

    async def find_group(
        self,
        *,
        round: int | None = None,
        expected_peers: Expected | None = None,
        resync: bool | None = None,
    ) -> Group | None:
        """Matchmaking only: the group of this round, or None if none formed.

        Returns within ``config.matchmaking.bound``. Follow it with ``average``
        (or ``skip``) for the same round. ``resync``: this peer's decision
        that the group re-synchronises after the round, which the group
        adopts if this peer leads it (``Group.resync``).
        """
        with self._busy_guard():
            return await self._match(round, expected_peers, resync)

    async def _match(
        self, round: int | None, expected_peers: Expected | None, resync: bool | None = None
    ) -> Group | None:
        if round is not None:
            self.state = MoshpitState(round, self.state.coordinates)
        key = self.state.key(self.grid, self.prefix)
        expected = expected_peers if self.grid.dimensions == 1 else None
        group = await self._matchmaker.find_group(
            key, self._member(), expected=expected, resync=resync
        )
        if group is None:
            log.info("round %d: no group under %s", self.state.round, key)
        return group

    async def schedule(
        self,
        nursery: trio.Nursery,
        *,
        round: int | None = None,
        expected_peers: Expected | None = None,
    ) -> ScheduledRound:
        """Begin this round's matchmaking now, in ``nursery``; trigger it later.

        Returns once this peer looks for a group (the matchmaking runs on as a
        task of ``nursery`` and ends within ``config.matchmaking.bound``). The
        ``ScheduledRound`` is then triggered with a weight (0: join without
        contributing) or cancelled (group-mates are told at once); see
        ``_scheduled``. ``round`` and ``expected_peers`` are as in ``step``.
        Until it is triggered or cancelled, other steps of this averager raise
        ``StepInProgressError`` (as does this one while another step runs).
        """
        if self._busy or self._pending is not None:
            raise StepInProgressError(f"averager {self.prefix!r} is already running a step")
        scheduled = ScheduledRound(
            self, self.state.round if round is None else round, expected_peers
        )
        self._pending = scheduled
        try:
            await nursery.start(scheduled._find)
        except BaseException:
            self._pending = None
            raise
        return scheduled

    def _release(self, scheduled: ScheduledRound) -> None:
        """``scheduled`` no longer holds this averager (triggered or cancelled)."""
        if self._pending is scheduled:
            self._pending = None

    async def average(
        self,
        group: Group,
        weight: float = 1.0,
        *,
        tensors: Sequence[torch.Tensor] | None = None,
        riding: Sequence[torch.Tensor] = (),
    ) -> StepResult:
        """All-reduce the tensors with ``group`` (from ``find_group``), in place,
        and move to the next round's grid cell. Returns within the all-reduce's
        round deadline.

        ``tensors`` replaces the averager's own for this round (as many
        values; ``ConfigError`` if not): e.g. scratch zeros of a peer that
        joins with weight 0 while its own tensors are in use. The group sees
        no difference. ``riding``: more tensors averaged in the same
        all-reduce, after those (e.g. parameters re-synchronised with a
        lossy run's gradients, ``trainer._drift``); every member must pass
        as many values.
        """
        if tensors is None:
            tensors = self.tensors
        else:
            size, ours = sum(t.numel() for t in tensors), sum(t.numel() for t in self.tensors)
            if size != ours:
                raise ConfigError(f"tensors hold {size} values, the averager's {ours}")
        return await self._all_reduce(group, group, [*tensors, *riding], weight, last=True)

    async def average_with(
        self,
        group: Group,
        tensors: Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        tag: bytes,
        last: bool = False,
        codec: Codec | None = None,
    ) -> StepResult:
        """All-reduce other ``tensors`` with ``group`` (from ``find_group``), in place.

        One more all-reduce of an already formed group in the same round, as
        the sub-round ``tag`` (``Group.sub_round``): its streams never mix
        with those of another tag or of ``average``, and a member calling with
        a different tag counts as failed. Every member must pass the same tag
        and the same tensor sizes. The averager's own tensors are untouched.
        With ``last`` the averager then moves to the next round's grid cell,
        as ``average`` does; several sub-rounds may run before the last.
        ``codec`` replaces the configured codec for this all-reduce (every
        member must pass the same). Returns within the all-reduce's round
        deadline; on cancellation the tensors hold whole chunks, each
        averaged or local.
        """
        return await self._all_reduce(
            group, group.sub_round(tag), tensors, weight, last=last, codec=codec
        )

    async def average_in_chunks(
        self,
        group: Group,
        staging: ChunkedStaging,
        weight: float = 1.0,
        *,
        write_lock: threading.Lock | None = None,
    ) -> list[StepResult]:
        """All-reduce ``staging``'s tensors with ``group`` one chunk at a time,
        in place, and move to the next round's grid cell.

        Each chunk is staged to the host, averaged as a sub-round of this
        round (``average_with``, tag ``chunk`` + its index) and copied back
        before the next is staged, so host memory holds one chunk of the
        state, never all of it. The copies run in a worker thread, never on
        the trio thread; the copy back holds ``write_lock`` (e.g. the state
        lock that donors take). Every member must pass the same chunking
        (same shapes, same ``chunk_elements``). Returns one result per chunk;
        the peers whose data is in every element are the intersection of
        their contributors (``chunked_contributors``). On cancellation, the
        chunks copied back so far are averaged, the others local (each chunk
        whole), and this round is not ended (``skip`` it).
        """
        lock = write_lock if write_lock is not None else contextlib.nullcontext()

        def write_back(chunk: int) -> None:
            with lock:
                staging.from_host(chunk)

        results = []
        last = len(staging) - 1
        for chunk in range(len(staging)):
            host = await trio.to_thread.run_sync(staging.to_host, chunk)
            tag = b"chunk" + chunk.to_bytes(4, "little")
            results.append(
                await self.average_with(group, host, weight, tag=tag, last=chunk == last)
            )
            await trio.to_thread.run_sync(write_back, chunk)
        return results

    async def _all_reduce(
        self,
        group: Group,
        round_group: Group,
        tensors: Sequence[torch.Tensor],
        weight: float,
        *,
        last: bool,
        codec: Codec | None = None,
    ) -> StepResult:
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"weight must be a finite number >= 0, got {weight}")
        with self._busy_guard():
            state = self.state
            key = state.key(self.grid, self.prefix)
            result = await all_reduce(
                self.peer.connections,
                round_group,
                tensors,
                weight=weight,
                codec=self.config.codec if codec is None else codec,
                config=self.config.allreduce,
                fault_plan=self.fault_plan,
                meter=self.link_meter,
            )
            if last:
                members = [bytes(m.peer_id) for m in group.members]
                self.state = state.after_group(
                    self.grid, group.group_id, members, group.local_index
                )
            # the formed group; the sub-round's own id is in result.group_id
            return StepResult(state.round, key, group, result)

    def skip(self, reason: str) -> StepResult:
        """End this round without averaging (no group, or gave up): keep local values."""
        return self._missed(None, reason)

    def _missed(self, group: Group | None, reason: str) -> StepResult:
        state = self.state
        self.state = state.after_missed_round()
        log.info("round %d: %s; keeping local values", state.round, reason)
        return StepResult(state.round, state.key(self.grid, self.prefix), group, reason=reason)

    @contextlib.contextmanager
    def _busy_guard(self) -> Iterator[None]:
        if self._busy or self._pending is not None:
            raise StepInProgressError(f"averager {self.prefix!r} is already running a step")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def step_sync(
        self, weight: float = 1.0, *, timeout: float | None = None, round: int | None = None
    ) -> StepResult:
        """``step`` for synchronous code, through the sync ``swarm.Peer``'s runtime."""
        if self._sync_peer is None:
            raise ConfigError("step_sync needs an averager made with a sync swarm.Peer")

        async def run() -> StepResult:
            return await self.step(weight, timeout=timeout, round=round)

        result: StepResult = self._sync_peer.run(run)
        return result
