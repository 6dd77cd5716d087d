"""``ProgressTracker``: this peer's progress record in the DHT, and its reading
of the swarm's progress, as a service of the peer.

The collaborative optimizer only asks it: ``reading`` (the latest
``Reading``, replaced whole), ``refresh`` (publish and read now), ``wake``
(refresh soon rather than at the next interval), ``withdraw`` (leave the
run). ``serve`` runs it on the peer's trio thread: one refresh every
``progress_interval``, or when woken.

It depends on what it needs of a DHT node (``TrackerDHT``), not on the peer.
Layout: every peer writes its record under one key (``progress_key``), which
is what ``swarm status`` reads today. The aggregation tree
(``_progress.ProgressTree``), which scales to thousands of peers, plugs in
here: ``refresh`` would read the root's summary instead of every record; it
is not wired yet because ``swarm status`` and ``expected_peers`` read the
single key's records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from dht import DHTValue, owner_marker
from swarm import ConfigError, PeerID, SwarmError

from ._global_batch import Others, others_progress
from ._progress import PeerProgress, SwarmProgress, estimate, parse_progress, progress_key

log = logging.getLogger(__name__)


class TrackerDHT(Protocol):
    """What the tracker needs from a DHT node (``dht.DHTNode`` has it)."""

    async def store(
        self, key: str, value: Any, expiration_time: float, *, subkey: str | None = None
    ) -> bool: ...

    async def get(self, key: str, *, latest: bool = False) -> DHTValue | None: ...

    def now(self) -> float: ...


@dataclass(frozen=True)
class Reading:
    """One reading of the swarm's progress by the tracker."""

    swarm: SwarmProgress
    #: this peer's epoch and samples in the record published with this reading
    epoch: int
    samples: int
    #: monotonic time of the reading
    time: float
    #: the peers to expect in this epoch's round (this one included): live
    #: peers at the swarm's epoch, and those one behind that are still
    #: publishing (finishing the last step), not a peer that went silent
    expected: int = 1
    #: the other peers' samples toward this peer's epoch, and toward the next
    #: (for a step taken before the next reading), for deciding between
    #: readings whether the swarm has its target batch (``_global_batch``)
    others: Others | None = None
    ahead: Others | None = None


@dataclass(frozen=True)
class TrackerConfig:
    """How often the tracker refreshes and when a peer counts as gone or silent.

    Raises ``ConfigError`` unless ``0 < progress_interval < progress_ttl`` and
    ``fresh_within`` is positive.
    """

    #: how often this peer publishes its record and re-reads the swarm's (seconds)
    progress_interval: float = 1.0
    #: peers silent for this long are presumed gone (and their records expire)
    progress_ttl: float = 30.0
    #: a peer one epoch behind is expected in a round while its record is
    #: younger than this (it is still finishing the last step)
    fresh_within: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.progress_interval < self.progress_ttl:
            raise ConfigError(
                f"progress_interval ({self.progress_interval}s) must be positive and below "
                f"progress_ttl ({self.progress_ttl}s), or live peers look gone"
            )
        if not self.fresh_within > 0:
            raise ConfigError(f"fresh_within ({self.fresh_within}s) must be positive")


class ProgressTracker:
    """Publishes this peer's record (from ``record()``) and reads the swarm's.

    ``reading`` is None until the first refresh. Not thread-safe except
    ``reading``, which is replaced whole: call the rest on the trio thread.
    """

    def __init__(
        self,
        dht: TrackerDHT,
        peer_id: PeerID,
        run_id: str,
        *,
        record: Callable[[], PeerProgress],
        target_batch_size: int,
        config: TrackerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dht = dht
        self.peer_id = peer_id
        self.run_id = run_id
        self.record = record
        self.target_batch_size = target_batch_size
        self.config = config
        self._clock = clock
        self.reading: Reading | None = None
        self._wake: trio.Event | None = None

    async def refresh(self, *, publish: bool = True) -> Reading:
        """Publish this peer's record (unless not ``publish``) and read everyone's;
        returns the new ``reading``. A DHT failure is logged, and the reading
        then counts this peer alone; raises nothing else. Cancellation
        propagates (the reading is then not replaced)."""
        dht, config = self.dht, self.config
        mine = self.record()
        try:
            if publish:
                await dht.store(
                    progress_key(self.run_id),
                    mine.to_value(),
                    dht.now() + config.progress_ttl,
                    subkey=owner_marker(self.peer_id),
                )
            records = parse_progress(await dht.get(progress_key(self.run_id)))
        except SwarmError as e:
            log.warning("progress tracking failed: %s", e)
            records = []
        records = [r for r in records if r.peer_id != mine.peer_id] + [mine]
        now = dht.now()
        swarm = estimate(
            records,
            now=now,
            target_batch_size=self.target_batch_size,
            stale_after=config.progress_ttl,
        )
        expected = expected_peers(
            records,
            now=now,
            epoch=swarm.epoch,
            stale_after=config.progress_ttl,
            fresh_within=config.fresh_within,
        )
        # a live peer publishes every interval, and is expected in rounds while
        # its record is younger than fresh_within: an older record is a peer
        # that stalled or died, whose rate would count samples nobody computed
        others, ahead = (
            others_progress(
                records,
                me=mine.peer_id,
                epoch=epoch,
                now=now,
                stale_after=config.progress_ttl,
                horizon=config.fresh_within,
            )
            for epoch in (mine.epoch, mine.epoch + 1)
        )
        self.reading = Reading(
            swarm, mine.epoch, mine.samples, self._clock(), expected, others, ahead
        )
        return self.reading

    def wake(self) -> None:
        """Refresh now rather than at the next interval (no-op unless serving)."""
        if self._wake is not None:
            self._wake.set()

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh every ``progress_interval``, or when woken, until cancelled."""
        self._wake = trio.Event()
        task_status.started()
        while True:
            with trio.move_on_after(self.config.progress_interval):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.refresh()

    async def withdraw(self) -> None:
        """Leave the run: publish a record whose time is already stale, so
        readers stop counting this peer at once. Raises what the DHT raises
        (``SwarmError``)."""
        dht, ttl = self.dht, self.config.progress_ttl
        value = self.record().to_value() | {"time": dht.now() - 2 * ttl}
        # It must expire after the last live record, or the merge (latest
        # expiration wins) would keep that one.
        await dht.store(
            progress_key(self.run_id), value, dht.now() + 2 * ttl, subkey=owner_marker(self.peer_id)
        )


def expected_peers(
    records: list[PeerProgress],
    *,
    now: float,
    epoch: int,
    stale_after: float,
    fresh_within: float,
) -> int:
    """How many peers (at least 1) an ``epoch`` round should wait for.

    Peers at ``epoch`` or beyond, and peers one epoch behind (still finishing
    the last step, about to join), whose record is younger than
    ``fresh_within`` seconds: a live peer publishes every few seconds whatever
    its training thread does. A peer that went silent (it died, or is stuck) is
    not waited for, although its record lives until ``stale_after`` and still
    counts toward the swarm's size: rounds stop waiting for a dead peer within
    ``fresh_within`` seconds, not after the record's whole lifetime.
    """
    return max(
        1,
        sum(
            1
            for r in records
            if now - r.time <= min(stale_after, fresh_within) and r.epoch >= epoch - 1
        ),
    )
