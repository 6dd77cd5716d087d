"""``ProgressTracker``: this peer's progress record in the DHT, and its reading
of the swarm's progress, as a service of the peer.

The collaborative optimizer only asks it: ``reading`` (the latest
``Reading``, replaced whole), ``refresh`` (publish and read now), ``wake``
(refresh soon rather than at the next interval), ``withdraw`` (leave the
run). ``serve`` runs it on the peer's trio thread: one refresh every
``progress_interval``, or when woken.

It depends on what it needs of a DHT node (``dht.RecordDHT``), not on the peer.

Layout, and why (issue 19). Two records per peer, for two kinds of reader:

- The *directory*, the single key ``progress_key`` that every peer used to
  write: records by name, which ``swarm status`` lists and ``expected_peers``
  (how many peers a 1-D round waits for) counts. A peer writes it while its
  rank (a hash of its peer id, uniform in [0, 1)) is below ``2 *
  directory_size / N``: in a swarm up to twice ``directory_size`` that is
  every peer, so the directory is the whole swarm, as before the tree;
  beyond, a uniform sample of about ``2 * directory_size`` peers, so the key
  stays small however large the swarm.
- The aggregation tree (``_progress.ProgressTree``) for the totals (epoch,
  samples toward the target, samples per second, live peers) of a larger
  swarm: each refresh writes this peer's record to its leaf and reads the
  root's partial sums, ``depth + 1`` keys of at most ``fanout`` entries, so a
  reader's traffic grows with log N (the DHT hops), not with N, and counts
  are exact once every peer has refreshed since the last change (no sampling
  error, unlike scaling up a sample).

Which a peer uses follows its count N (the most it counted within
``progress_ttl``, so that a tree still filling up in a cold start does not
send it back to the directory; before its first refresh, what the tree's root
counts), with a margin of 2x on each side so that peers whose counts differ
still read a complete source: up to ``directory_size`` it reads the directory
(exact: everyone writes it up to twice that) and nothing else, as cheap as
before the tree (a tree refresh costs about three times the datagrams); above
``directory_size / 2`` (and in its first refresh) it also writes the tree, and
above ``directory_size`` it reads the totals from the tree (everyone writes it
from half that) and ``expected`` is the tree's count of peers at the swarm's
epoch (a swarm that large averages on a grid of more than one axis, whose
rounds do not wait for a count). If the tree cannot be read, the directory's
records are the reading, and the log says so.

An observer that writes nothing (``swarm status``) knows no N beforehand:
``observe_progress`` reads both and takes the totals from the tree when the
tree counts more live peers than the directory lists (the directory then
holds a sample).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from averaging import Expected
from dht import DHTValue, RecordDHT, owner_marker
from swarm import ConfigError, PeerID, SwarmError

from ._global_batch import Others, others_progress
from ._progress import (
    PeerProgress,
    ProgressSummary,
    ProgressTree,
    SwarmProgress,
    estimate,
    parse_progress,
    progress_key,
)

log = logging.getLogger(__name__)


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
    #: which peers those are, when the reading lists every live peer (the
    #: directory, not the tree's totals); None: only their count is known
    awaited: frozenset[PeerID] | None = None
    #: the other peers' samples toward this peer's epoch, and toward the next
    #: (for a step taken before the next reading), for deciding between
    #: readings whether the swarm has its target batch (``_global_batch``)
    others: Others | None = None
    ahead: Others | None = None
    #: the peers to expect in the round of the epoch after ``epoch``, where
    #: the reading lists every live peer: those at ``epoch - 1`` or beyond. A
    #: record lags its peer by up to a step (it is published after the step)
    #: and this reading is a step older than that round, so a peer one epoch
    #: behind in it may be at ``epoch`` already; a group that closed without
    #: such a peer left it to wait out the matchmaking bound alone. A step
    #: this peer takes before its next reading goes by them (``round_of``),
    #: not by a read of its own in the step's way.
    awaited_next: frozenset[PeerID] | None = None

    @property
    def waits_for(self) -> Expected:
        """What this epoch's round waits for: the awaited peers where they are
        known, else their count (``Averager.find_group``'s ``expected_peers``)."""
        return self.awaited if self.awaited else self.expected

    def round_of(self, epoch: int) -> Expected | None:
        """What the round of this peer's ``epoch`` waits for, if this reading
        can say: ``waits_for`` for the reading's own epoch; for the next one
        (a step taken before the next reading) ``awaited_next`` when it holds
        another peer than this one; else None, for a fresh read to tell (the
        totals of a tree name nobody, and other peers that were all behind
        this one may have caught up since)."""
        if epoch == self.epoch:
            return self.waits_for
        awaited = self.awaited_next
        if epoch == self.epoch + 1 and awaited is not None and len(awaited) > 1:
            return awaited
        return None

    @property
    def passed_by(self) -> bool:
        """Whether every other live peer has stepped past this peer's epoch:
        the reading lists them all (``others``: the directory, not the tree's
        totals), none is at ``epoch`` or finishing the step before it, and
        the swarm is beyond it. No group can form for ``epoch`` any more; a
        record lags its peer, so a peer still in such a group shows at
        ``epoch`` or before, never past it."""
        return self.others is not None and not self.others.peers and self.swarm.epoch > self.epoch


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
    #: peers listed by name under ``progress_key`` (``swarm status``,
    #: ``expected_peers``): every peer of a swarm up to this size, a sample of
    #: about this many beyond (see the module docstring)
    directory_size: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.progress_interval < self.progress_ttl:
            raise ConfigError(
                f"progress_interval ({self.progress_interval}s) must be positive and below "
                f"progress_ttl ({self.progress_ttl}s), or live peers look gone"
            )
        if not self.fresh_within > 0:
            raise ConfigError(f"fresh_within ({self.fresh_within}s) must be positive")
        if self.directory_size < 1:
            raise ConfigError(f"directory_size ({self.directory_size}) must be at least 1")


class ProgressTracker:
    """Publishes this peer's record (from ``record()``) and reads the swarm's.

    ``reading`` is None until the first refresh. Not thread-safe except
    ``reading``, which is replaced whole: call the rest on the trio thread.
    """

    def __init__(
        self,
        dht: RecordDHT,
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
        #: set when ``reading`` is replaced (``next_reading``), then renewed
        self._read = trio.Event()
        self._wake: trio.Event | None = None
        #: the swarm's totals (see the module docstring)
        self.tree = ProgressTree(run_id)
        #: which summaries this peer writes (``ProgressTree.refresh``)
        self._rng = random.Random(bytes(peer_id))
        #: this peer's place in the directory's sample, uniform in [0, 1)
        digest = hashlib.blake2b(bytes(peer_id), digest_size=8, person=b"swarm.progress.d")
        self._rank = int.from_bytes(digest.digest(), "big") / 2**64
        #: the other peers' records of the directory, as last read (``_remember``)
        self._records: dict[PeerID, PeerProgress] = {}
        #: the most live peers counted within ``progress_ttl``, and when (``_count``)
        self._peak = (1, -math.inf)
        #: whether this peer has written the tree (``withdraw`` then leaves it)
        self._wrote_tree = False

    async def refresh(self, *, publish: bool = True) -> Reading:
        """Publish this peer's record (unless not ``publish``) and read the
        swarm's progress (see the module docstring); returns the new
        ``reading``. A DHT failure is logged, and the reading then counts what
        was read (this peer alone if nothing); raises nothing else.
        Cancellation propagates (the reading is then not replaced)."""
        dht, config = self.dht, self.config
        mine = self.record()
        now = dht.now()
        ttl = config.progress_ttl
        summary: ProgressSummary | None = None
        records: list[PeerProgress] = []
        if self.reading is None and publish:
            await self._size_up(now)
        # see the module docstring: the directory is exact up to 2 * directory_size
        small = self._peers <= config.directory_size
        # a first refresh writes the tree too: in a cold start of a large swarm
        # it then fills a refresh sooner (everyone counts only itself so far)
        tree = self._peers > config.directory_size / 2 or self.reading is None
        listed = self._rank < 2 * config.directory_size / self._peers

        async def totals() -> None:
            nonlocal summary
            try:
                if publish and tree:
                    self._wrote_tree = True
                    summary = await self.tree.refresh(
                        dht, mine, now=now, ttl=ttl, stale_after=ttl, rng=self._rng
                    )
                elif not small:
                    summary = await self.tree.read(dht, now=now, stale_after=ttl)
            except* SwarmError as failed:  # the tree reads and writes in parallel
                log.warning("progress tracking (tree) failed: %s", failed.exceptions[0])

        async def directory(*, read: bool) -> None:
            nonlocal records
            try:
                if publish and listed:
                    await dht.store(
                        progress_key(self.run_id),
                        mine.to_value(),
                        now + ttl,
                        subkey=owner_marker(self.peer_id),
                        replicas=self.tree.replicas,
                    )
                if read:
                    records = parse_progress(await dht.get(progress_key(self.run_id)))
            except SwarmError as e:
                log.warning("progress tracking failed: %s", e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(totals)
            nursery.start_soon(partial(directory, read=small))
        if small:
            summary = None  # the directory is whole: exact, and holds the names
        elif summary is None:
            log.warning("progress tracking: the tree could not be read; counting a sample")
            await directory(read=True)
        now = dht.now()
        records = [*self._remember(records, mine.peer_id, now, read=summary is None), mine]
        if summary is not None and not publish:
            # a read-only refresh counts this peer too (it is not in the tree)
            own = ProgressSummary.of_records([mine], now=now, stale_after=ttl)
            summary = ProgressSummary.combine(
                [summary] + ([own] if own else []), now=now, stale_after=ttl
            )
        others: Others | None = None
        ahead: Others | None = None
        awaited: frozenset[PeerID] | None = None
        awaited_next: frozenset[PeerID] | None = None
        if summary is not None:
            swarm = summary.progress(self.target_batch_size, now)
            # the directory holds a sample only: the optimizer then goes by the
            # totals (``Reading.others`` None)
            expected = max(1, swarm.num_peers_at_epoch)
        else:
            swarm = estimate(
                records, now=now, target_batch_size=self.target_batch_size, stale_after=ttl
            )
            awaited = awaited_peers(
                records,
                now=now,
                epoch=swarm.epoch,
                stale_after=ttl,
                fresh_within=config.fresh_within,
            )
            expected = max(1, len(awaited))
            awaited_next = awaited_peers(
                records,
                now=now,
                epoch=mine.epoch,
                stale_after=ttl,
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
                    stale_after=ttl,
                    horizon=config.fresh_within,
                )
                for epoch in (mine.epoch, mine.epoch + 1)
            )
        self._count(swarm.num_peers, now)
        self.reading = Reading(
            swarm,
            mine.epoch,
            mine.samples,
            self._clock(),
            expected,
            awaited,
            others,
            ahead,
            awaited_next,
        )
        self._read.set()
        self._read = trio.Event()
        return self.reading

    def _remember(
        self, records: list[PeerProgress], me: PeerID, now: float, *, read: bool
    ) -> list[PeerProgress]:
        """The other peers' records of the directory: those just read
        (``read``: it was read), and of the last ones those that this read
        missed and that are not stale yet.

        A peer leaves the count when its record goes stale or it withdraws
        (a stale record replaces its last), not when one read misses it: a
        read that reached no node holding the directory (a NATed peer whose
        one contact timed out under load; the DHT drops a contact that did
        not answer) returns nothing, and read as "nobody else is training"
        it once sent a peer stepping alone for seven epochs, out of its group."""
        fresh = {r.peer_id: r for r in records if r.peer_id != me}
        if read:
            for peer_id, record in self._records.items():
                if peer_id not in fresh and now - record.time <= self.config.progress_ttl:
                    fresh[peer_id] = record
            self._records = fresh
        return list(fresh.values())

    @property
    def _peers(self) -> int:
        """The live peers the layout goes by (see the module docstring)."""
        return self._peak[0]

    async def _size_up(self, now: float) -> None:
        """Before a first refresh, count the swarm from the tree's root (one
        key of at most ``fanout`` summaries): a peer joining a large swarm,
        or a late one in a cold start, then neither reads the whole directory
        nor lists itself there as if the swarm were this peer alone. A DHT
        failure is logged; the refresh then goes as if the swarm were new."""
        try:
            summary = await self.tree.read(self.dht, now=now, stale_after=self.config.progress_ttl)
        except SwarmError as e:
            log.warning("progress tracking: the tree's root could not be read: %s", e)
            return
        if summary is not None:
            self._count(summary.peers + 1, now)  # and this peer, not in the tree yet

    def _count(self, peers: int, now: float) -> None:
        """Remember a reading's count of live peers: the layout goes by the
        most counted within ``progress_ttl``. A lower count within that time is
        rather a tree still filling than peers gone (whose records live that
        long anyway): in a cold start every peer reads the directory first,
        then the tree while its summaries still cover few peers (they cover
        everyone after ``depth + 1`` refreshes), and going by that count sent
        it back to reading the whole directory and to not writing the tree,
        every other refresh."""
        peers = max(1, peers)
        if peers >= self._peak[0] or now - self._peak[1] > self.config.progress_ttl:
            self._peak = (peers, now)

    async def next_reading(self) -> Reading:
        """Wait for the next reading (``refresh``, by whichever task), and
        return it."""
        await self._read.wait()
        assert self.reading is not None
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
        """Leave the run: replace this peer's record (in the directory, and in
        the tree if it writes there) with one whose time is already stale, so readers stop
        counting this peer at once. Raises what the DHT raises (``SwarmError``)."""
        dht, ttl = self.dht, self.config.progress_ttl
        mine = self.record()
        value = mine.to_value() | {"time": dht.now() - 2 * ttl}
        # It must expire after the last live record, or the merge (latest
        # expiration wins) would keep that one.
        await dht.store(
            progress_key(self.run_id), value, dht.now() + 2 * ttl, subkey=owner_marker(self.peer_id)
        )
        if not self._wrote_tree:
            return  # see ``refresh``
        try:
            await self.tree.withdraw(dht, mine, now=dht.now(), ttl=ttl, stale_after=ttl)
        except* SwarmError as failed:  # the tree writes in parallel
            raise failed.exceptions[0] from None


def awaited_peers(
    records: list[PeerProgress],
    *,
    now: float,
    epoch: int,
    stale_after: float,
    fresh_within: float,
) -> frozenset[PeerID]:
    """The peers an ``epoch`` round should wait for.

    Peers at ``epoch`` or beyond, and peers one epoch behind (still finishing
    the last step, about to join), whose record is younger than
    ``fresh_within`` seconds: a live peer publishes every few seconds whatever
    its training thread does. A peer that went silent (it died, or is stuck) is
    not waited for, although its record lives until ``stale_after`` and still
    counts toward the swarm's size: rounds stop waiting for a dead peer within
    ``fresh_within`` seconds, not after the record's whole lifetime. A peer
    further behind is not waited for either (it downloads the state first),
    and when it joins the round after all, it does not take an awaited
    peer's place (``averaging.Expected``).
    """
    fresh = min(stale_after, fresh_within)
    return frozenset(r.peer_id for r in records if now - r.time <= fresh and r.epoch >= epoch - 1)


def expected_peers(
    records: list[PeerProgress],
    *,
    now: float,
    epoch: int,
    stale_after: float,
    fresh_within: float,
) -> int:
    """How many peers (at least 1) an ``epoch`` round should wait for: the
    ``awaited_peers``."""
    awaited = awaited_peers(
        records, now=now, epoch=epoch, stale_after=stale_after, fresh_within=fresh_within
    )
    return max(1, len(awaited))


@dataclass(frozen=True)
class Observation:
    """The swarm's progress as an observer reads it (``observe_progress``)."""

    swarm: SwarmProgress
    #: the live records of the directory, by peer id: every live peer, or a
    #: sample of them when ``sampled``
    listed: list[PeerProgress]
    #: the directory holds a sample: ``swarm``'s totals are the tree's
    sampled: bool


async def observe_progress(
    dht: RecordDHT, run_id: str, *, stale_after: float, tree: ProgressTree | None = None
) -> Observation:
    """Read a run's progress without taking part: the directory's live records
    (``stale_after`` seconds), and the totals from the progress ``tree``
    (default ``ProgressTree(run_id)``, the trackers' layout) when it counts more
    live peers than the directory lists, as it does once the swarm outgrows
    the directory. Both reads run in parallel; raises what the DHT raises
    (``SwarmError``); cancellation propagates."""
    tree = tree or ProgressTree(run_id)
    found: list[DHTValue | None] = [None]
    summary: ProgressSummary | None = None

    async def directory() -> None:
        found[0] = await dht.get(progress_key(run_id), latest=True)

    async def totals() -> None:
        nonlocal summary
        summary = await tree.read(dht, now=dht.now(), stale_after=stale_after)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(directory)
        nursery.start_soon(totals)
    now = dht.now()
    listed = sorted(
        (r for r in parse_progress(found[0]) if now - r.time <= stale_after),
        key=lambda r: str(r.peer_id),
    )
    if summary is not None and summary.peers > len(listed):
        return Observation(summary.progress(1, now), listed, sampled=True)
    swarm = estimate(listed, now=now, target_batch_size=1, stale_after=stale_after)
    return Observation(swarm, listed, sampled=False)
