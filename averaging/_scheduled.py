"""``ScheduledRound``: a round whose group is found ahead of time, then triggered.

A peer that knows it will average soon (a trainer a second away from the
target batch) begins matchmaking early with ``Averager.schedule``, and when
its data is ready it does one of three things with the group it found:

- ``trigger(weight)``: all-reduce its tensors with the group, as ``step`` would;
- ``trigger(0.0)``: join with weight 0. Its data counts for nothing (it is not
  among the contributors) but it receives the group's average and reduces its
  part for the others, so the group loses nothing (hivemind's "tag along
  with zero weight", e.g. a peer that fell behind and must download the state);
- ``cancel()``: leave. While matchmaking still runs, its followers are sent
  elsewhere and its leader drops it, as for any peer that stops looking. Once
  the group has formed, it tells its group-mates it withdrew
  (``withdraw_from_round``): their reducers exclude it at once and its part
  is refused at once, so nobody waits out ``sender_timeout`` for it.

One scheduled round per averager at a time: while it is pending (not yet
triggered or cancelled, or its all-reduce running), ``step``, ``find_group``
and another ``schedule`` raise ``StepInProgressError``.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import trio

from swarm import ConfigError, SwarmError

from ._allreduce import withdraw_from_round
from ._group import Group
from ._matchmaking import Expected

if TYPE_CHECKING:
    from ._averager import Averager, StepResult

log = logging.getLogger(__name__)


class RoundClosedError(SwarmError, RuntimeError):
    """A scheduled round was triggered or cancelled after it was already
    triggered or cancelled."""


class _Stage(enum.Enum):
    MATCHING = "matching"  # looking for a group (or found one): may be triggered
    TRIGGERED = "triggered"
    CANCELLED = "cancelled"


class ScheduledRound:
    """One averaging round of an ``Averager`` whose matchmaking runs ahead.

    Made by ``Averager.schedule``; not constructed directly. ``round`` is the
    Moshpit round it averages in. Methods run on the trio thread of the
    averager's peer.
    """

    def __init__(self, averager: Averager, round: int, expected_peers: Expected | None) -> None:
        self._averager = averager
        self.round = round
        self._expected = expected_peers
        self._stage = _Stage.MATCHING
        self._group: Group | None = None
        self._found = trio.Event()
        self._scope = trio.CancelScope()

    async def _find(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The matchmaking task (in the nursery given to ``schedule``)."""
        try:
            with self._scope:
                task_status.started()
                self._group = await self._averager._match(self.round, self._expected)
        except SwarmError as e:  # this round's boundary: no group, as for a timeout
            log.info("round %d: matchmaking failed: %s", self.round, e)
        finally:
            self._found.set()

    @property
    def group(self) -> Group | None:
        """The group found so far (None while matchmaking runs, or if none formed)."""
        return self._group

    @property
    def matched(self) -> bool:
        """Whether matchmaking is over (with a group or without)."""
        return self._found.is_set()

    async def wait_group(self) -> Group | None:
        """Wait for matchmaking to end (within ``MatchmakingConfig.bound``); the
        group, or None if none formed (or the round was cancelled)."""
        await self._found.wait()
        return self._group

    async def trigger(
        self, weight: float = 1.0, *, tensors: Sequence[torch.Tensor] | None = None
    ) -> StepResult:
        """Average with the group found: waits for matchmaking to end, then
        runs the all-reduce. Returns what happened, as ``Averager.step`` does
        (``group=None``, tensors unchanged, if no group formed).

        ``weight`` is this peer's weight in the mean; 0 joins without
        contributing (the tensors still receive the average). ``tensors``
        (default: the averager's own) are averaged in place; they must hold
        as many values as the averager's, e.g. scratch zeros for a peer that
        joins with weight 0 while its own tensors are in use. Raises
        ``ConfigError`` for a bad weight or size (the round stays pending),
        ``RoundClosedError`` if the round was triggered or cancelled already.
        On cancellation, the tensors hold whole chunks, each averaged or local.
        """
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"weight must be a finite number >= 0, got {weight}")
        averager = self._averager
        if tensors is not None:
            size = sum(t.numel() for t in tensors)
            ours = sum(t.numel() for t in averager.tensors)
            if size != ours:
                raise ConfigError(f"tensors hold {size} values, the averager's {ours}")
            tensors = list(tensors)
        self._close(_Stage.TRIGGERED)
        try:
            group = await self.wait_group()
        except BaseException:
            self._scope.cancel()  # cancelled while waiting: stop looking too
            averager._release(self)
            raise
        averager._release(self)
        if group is None:
            return averager._missed(None, "no group formed in time")
        return await averager.average(group, weight, tensors=tensors)

    async def cancel(self) -> bool:
        """Leave this round without averaging; the tensors keep their values.

        Stops matchmaking if it still runs. If a group had formed, tells its
        members that this peer withdrew (bounded by the matchmaking config's
        ``request_timeout``), so that none of them waits for it. True if the
        round was cancelled, False if it had been triggered (then it runs on)
        or cancelled already. On cancellation of the caller, members not told
        yet wait for this peer as for a failed member.
        """
        if self._stage is not _Stage.MATCHING:
            return False
        self._close(_Stage.CANCELLED)
        averager = self._averager
        try:
            self._scope.cancel()
            group = await self.wait_group()
            if group is not None:
                await withdraw_from_round(
                    averager.peer.connections,
                    group,
                    timeout=averager.config.matchmaking.request_timeout,
                )
        finally:
            averager._release(self)
        averager._missed(group, "cancelled")
        return True

    def _close(self, stage: _Stage) -> None:
        if self._stage is not _Stage.MATCHING:
            raise RoundClosedError(f"this scheduled round was {self._stage.value} already")
        self._stage = stage
