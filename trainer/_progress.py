"""Progress tracking: how far the swarm has got toward the next global step.

Every peer publishes a signed record (its sub-key names it, so nobody can
write another peer's progress): its epoch, the samples it accumulated in this
epoch, its samples per second, when it reported, its latest loss and
accuracy, and the device and precision it trains with (``device``, which
``swarm status`` shows; records of peers from before it read ``unknown``).
From these the swarm's progress is estimated: for the swarm's current epoch,
how many samples the live peers hold now and when the target batch size will
be reached (DeDLOC, Diskin et al. 2021, section 3.2).
``estimate`` is pure: records and a clock in, ``SwarmProgress`` out.

How it scales: an aggregation tree (``ProgressTree``)
-----------------------------------------------------
One key that every peer writes (``progress_key``, the layout before this
tree) makes every reader fetch every record: at 1,000 peers that is 1,000
signed records (about 300 kB) per peer per refresh, a million for the swarm,
and a reply of one datagram used to hold about 200 of them, so readers
silently under-counted. Three ways were weighed:

- sharded keys, every reader reading every shard: exact, but a reader's
  traffic still grows linearly with the swarm;
- sampling a few shards and scaling up: traffic stays flat, but the error of
  the count is statistical (about 1/sqrt(sample)), and the target batch and
  the Moshpit grid need an exact count, not an unbiased guess;
- aggregation: a tree of partial sums. Exact in a steady swarm and flat
  traffic per peer. Chosen.

The tree has ``depth`` levels of ``fanout`` branches (32 x 32 = 1,024 leaves
by default; a leaf holds about N / 1,024 records, so past several thousand
peers a third level keeps it small). A peer's leaf is a hash of its peer id. It writes its own
record under its leaf's key; the summary of each sub-tree
(``ProgressSummary``: the highest epoch, samples at that epoch extrapolated to
the summary's time, samples reported, rate, peers, peers at that epoch) lives
under its parent's summary key, with the branch digit as sub-key, and the
root's key holds the summaries of the ``fanout`` top sub-trees: the whole
swarm. One refresh of a peer (``ProgressTree.refresh``) reads its leaf and the
``depth`` summary keys on its path (in parallel), recomputes the summaries of
its path bottom-up with its own fresh record in place, writes its record and
(see below) those summaries (in parallel), and takes the root's sum as the
swarm's progress. So a peer reads ``depth + 1`` keys of at most ``fanout``
entries (plus the few peers that share its leaf) and writes at most
``depth + 1`` records per refresh: with a DHT look-up of O(log N) hops each,
its traffic grows with log N, and summaries stay ``fanout`` entries long
however large the swarm.

A summary sub-key is written by any peer of its sub-tree (it names no owner,
so it is unsigned; the merge keeps the latest). To keep the hot keys near the
root from taking N writes per refresh, a peer writes the summary of a
sub-tree that holds ``n`` peers (as it counted them last) with probability
``min(1, writers / n)``: about ``writers`` (3) writes per summary per
refresh, whatever N. A summary older than ``stale_after`` is ignored, like a
record: its sub-tree is gone. A key of a peer's path whose entries add up to
fewer live peers than its parent's summary of it counts was read short (the
read and the writers reached different nodes): it is read again from every
node close to it (``ProgressTree._read_short``). Counts are exact once every
peer has refreshed once since the last change; samples between refreshes are
extrapolated from the rates. Trust: a summary can be forged by any peer of
the run (records cannot); in a private swarm only members can write at all.
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import trio

from dht import DHTValue, RecordDHT, owner_marker
from swarm import ConfigError, PeerID, ProtocolError, Reachability
from swarm._wire import expect_float, expect_int

from ._task import PRECISIONS

#: ``PeerProgress.device`` of a record that does not say (a peer from before the field).
UNKNOWN_DEVICE = "unknown"
#: The longest ``PeerProgress.device`` a record may carry: records are many and
#: small (a DHT reply is one datagram), a label needs only a GPU's name.
MAX_DEVICE_LABEL = 64


def device_label(tensors: Sequence[torch.Tensor]) -> str:
    """The ``PeerProgress.device`` of a peer training ``tensors``: the first
    one's device (with the GPU's name on CUDA) and precision, e.g. ``cpu fp32``
    or ``cuda:0 NVIDIA H100 80GB HBM3 bf16``, cut to ``MAX_DEVICE_LABEL``
    characters; ``unknown`` for no tensors. Reads only metadata and the CUDA
    device's cached properties, so it may run on the trio thread."""
    if not tensors:
        return UNKNOWN_DEVICE
    return _label(tensors[0].device, tensors[0].dtype)


@functools.lru_cache(maxsize=8)
def _label(device: torch.device, dtype: torch.dtype) -> str:
    precision = next(
        (name for name, d in PRECISIONS.items() if d == dtype), str(dtype).removeprefix("torch.")
    )
    where = str(device)
    if device.type == "cuda":
        where += " " + torch.cuda.get_device_name(device)
    precision = " " + precision
    return where[: MAX_DEVICE_LABEL - len(precision)] + precision


#: Values of a record's ``reachability`` (``swarm.Reachability``); older
#: records have none, newer peers may send others: both read as None.
_REACHABILITY = frozenset(r.value for r in Reachability)


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


@dataclass(frozen=True)
class PeerProgress:
    """One peer's progress record."""

    peer_id: PeerID
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    loss: float | None = None
    accuracy: float | None = None
    client: bool = False
    #: where and in what precision the peer trains (``device_label``)
    device: str = UNKNOWN_DEVICE
    #: ``swarm.Reachability`` value: whether others can dial this peer
    reachability: str | None = None
    #: the peer stopped adding to ``epoch`` (it is averaging it): ``samples``
    #: is final, and it starts the next epoch at ``samples_per_second`` soon
    stopped: bool = False
    #: its latest micro-batch (samples; 0: none yet): a peer still adding to
    #: an epoch adds at least one more (``_global_batch``)
    batch: int = 0
    #: peers it holds connections with that were punched through NATs
    #: (``swarm._punch``); records of older peers have none: 0
    punched: int = 0

    @staticmethod
    def device_of(tensors: Sequence[torch.Tensor]) -> str:
        """``device_label(tensors)``: the ``device`` of a peer training ``tensors``."""
        return device_label(tensors)

    def to_value(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "samples": self.samples,
            "samples_per_second": self.samples_per_second,
            "time": self.time,
            "loss": self.loss,
            "accuracy": self.accuracy,
            "client": self.client,
            "device": self.device,
            "reachability": self.reachability,
            "stopped": self.stopped,
            "batch": self.batch,
            "punched": self.punched,
        }

    @classmethod
    def from_value(cls, peer_id: PeerID, value: Any) -> PeerProgress:
        """Decode a record from the DHT; raises ``ProtocolError`` if malformed."""
        if not isinstance(value, dict):
            raise ProtocolError("a progress record is a map")

        def optional(name: str) -> float | None:
            item = value.get(name)
            if item is None:
                return None
            return expect_float(item, name)

        device = value.get("device", UNKNOWN_DEVICE)
        if not (isinstance(device, str) and 0 < len(device) <= MAX_DEVICE_LABEL):
            raise ProtocolError(
                f"device must be a string of 1-{MAX_DEVICE_LABEL} characters, got {device!r:.80}"
            )
        sps = expect_float(value.get("samples_per_second"), "samples_per_second")
        if sps < 0:
            raise ProtocolError("samples_per_second must be >= 0")
        return cls(
            peer_id,
            expect_int(value.get("epoch"), "epoch", lo=0, hi=2**62),
            expect_int(value.get("samples"), "samples", lo=0, hi=2**62),
            sps,
            expect_float(value.get("time"), "time"),
            optional("loss"),
            optional("accuracy"),
            bool(value.get("client", False)),
            device,
            reachability if (reachability := value.get("reachability")) in _REACHABILITY else None,
            value.get("stopped", False) is True,
            # absent from the records of peers older than the field
            expect_int(value.get("batch", 0), "batch", lo=0, hi=2**31),
            expect_int(value.get("punched", 0), "punched", lo=0, hi=2**16),
        )


def parse_progress(found: DHTValue | None) -> list[PeerProgress]:
    """The valid records under a progress key (malformed ones are skipped)."""
    if found is None or not isinstance(found.value, Mapping):
        return []
    records = []
    for subkey, entry in found.value.items():
        if not isinstance(subkey, str) or not subkey.startswith("[owner:"):
            continue
        try:
            peer_id = PeerID.from_hex(subkey[len("[owner:") : -1])
            records.append(PeerProgress.from_value(peer_id, entry.value))
        except (ProtocolError, ValueError):
            continue
    return records


@dataclass(frozen=True)
class SwarmProgress:
    """The swarm as one peer sees it."""

    #: the most advanced epoch any live peer reports
    epoch: int
    #: samples accumulated toward ``epoch``'s global step, extrapolated to now
    samples: int
    target_batch_size: int
    #: samples per second of the peers at ``epoch``
    samples_per_second: float
    #: live peers (any epoch), and those at ``epoch``
    num_peers: int
    num_peers_at_epoch: int
    #: estimated seconds until ``samples`` reaches the target (0 if it has)
    eta: float
    #: samples the peers at ``epoch`` reported, without extrapolation
    reported: int = 0

    @property
    def ready(self) -> bool:
        """True once the peers *reported* the target: extrapolated samples may be
        samples nobody computed (a peer waiting on the network computes none)."""
        return self.reported >= self.target_batch_size


def estimate(
    records: list[PeerProgress],
    *,
    now: float,
    target_batch_size: int,
    stale_after: float,
) -> SwarmProgress:
    """Estimate the swarm's progress from the peers' records.

    Records older than ``stale_after`` seconds are from peers presumed gone.
    Samples of peers at the swarm's epoch are extrapolated with their rate
    since they reported, so a peer need not publish after every batch.
    """
    live = [r for r in records if now - r.time <= stale_after]
    if not live:
        return SwarmProgress(0, 0, target_batch_size, 0.0, 0, 0, math.inf, 0)
    epoch = max(r.epoch for r in live)
    current = [r for r in live if r.epoch == epoch]
    reported = sum(r.samples for r in current)
    samples = sum(r.samples + r.samples_per_second * max(0.0, now - r.time) for r in current)
    rate = sum(r.samples_per_second for r in current)
    missing = max(0.0, target_batch_size - samples)
    eta = 0.0 if missing == 0 else (missing / rate if rate > 0 else math.inf)
    return SwarmProgress(
        epoch=epoch,
        samples=int(samples),
        target_batch_size=target_batch_size,
        samples_per_second=rate,
        num_peers=len(live),
        num_peers_at_epoch=len(current),
        eta=eta,
        reported=reported,
    )


class RateMeter:
    """Samples per second: exponential moving averages of the samples and of
    the seconds of each batch, one over the other.

    Averaging each batch's own rate instead overstated it whenever batch
    times vary (a mean of rates is not the rate of the means: batches of 1 ms
    and 10 ms averaged 17,600 samples/s of 32 where 5,800 were computed), and
    the others, who extrapolate this peer at that rate, stopped short.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.rate = 0.0
        self._last: float | None = None
        self._samples = 0.0
        self._seconds = 0.0

    def update(self, now: float, samples: int) -> float:
        if self._last is not None and now > self._last:
            seconds = now - self._last
            if self._seconds == 0:
                self._samples, self._seconds = float(samples), seconds
            else:
                self._samples += self.alpha * (samples - self._samples)
                self._seconds += self.alpha * (seconds - self._seconds)
            self.rate = self._samples / self._seconds
        self._last = now
        return self.rate

    def pause(self) -> None:
        """Forget the last time: waiting (averaging) is not compute."""
        self._last = None

    def resume(self, now: float) -> None:
        """Count from ``now`` again: what comes before the next batch (the
        inner step, the loop's evaluation, loading data) is this peer's time
        per sample as the others see it, not waiting."""
        self._last = now


# -- the aggregation tree (see the module docstring) ------------------------------------

_LEAF_PERSON = b"swarm.progress.l"
#: How many of the nodes closest to a progress key hold each write of it
#: (``ProgressTree.replicas``, and the directory's records).
PROGRESS_REPLICAS = 8
#: How much later than a live version a withdrawal expires (seconds): enough to
#: win the merge, little enough that a write after it wins again.
_LATER = 1e-3


@dataclass(frozen=True)
class ProgressSummary:
    """The progress of the live peers of one sub-tree, as of ``time``."""

    #: the highest epoch a live peer of the sub-tree reports
    epoch: int
    #: samples of its peers at ``epoch``, extrapolated to ``time``
    samples: float
    #: samples those peers reported (not extrapolated)
    reported: int
    #: their samples per second
    samples_per_second: float
    #: live peers (any epoch), and those at ``epoch``
    peers: int
    peers_at_epoch: int
    time: float

    def to_value(self) -> list[Any]:
        return [
            self.epoch,
            self.samples,
            self.reported,
            self.samples_per_second,
            self.peers,
            self.peers_at_epoch,
            self.time,
        ]

    @classmethod
    def from_value(cls, value: Any) -> ProgressSummary:
        """Decode a summary from the DHT; raises ``ProtocolError`` if malformed."""
        if not isinstance(value, list) or len(value) != 7:
            raise ProtocolError("a progress summary is a list of 7 numbers")
        epoch, samples, reported, rate, peers, at_epoch, when = value
        summary = cls(
            expect_int(epoch, "epoch", lo=0, hi=2**62),
            expect_float(samples, "samples"),
            expect_int(reported, "reported", lo=0, hi=2**62),
            expect_float(rate, "samples_per_second"),
            expect_int(peers, "peers", lo=1, hi=2**40),
            expect_int(at_epoch, "peers_at_epoch", lo=1, hi=2**40),
            expect_float(when, "time"),
        )
        if summary.samples < 0 or summary.samples_per_second < 0:
            raise ProtocolError("samples and samples_per_second must be >= 0")
        if summary.peers_at_epoch > summary.peers:
            raise ProtocolError("peers_at_epoch exceeds peers")
        return summary

    @classmethod
    def of_records(
        cls, records: Iterable[PeerProgress], *, now: float, stale_after: float
    ) -> ProgressSummary | None:
        """The summary of peers' records at ``now`` (None if none is live)."""
        summaries = [
            cls(r.epoch, float(r.samples), r.samples, r.samples_per_second, 1, 1, r.time)
            for r in records
        ]
        return cls.combine(summaries, now=now, stale_after=stale_after)

    @classmethod
    def combine(
        cls, summaries: Iterable[ProgressSummary], *, now: float, stale_after: float
    ) -> ProgressSummary | None:
        """The summary of disjoint sub-trees at ``now``: those older than
        ``stale_after`` are left out; samples are extrapolated with the rates."""
        live = [s for s in summaries if now - s.time <= stale_after]
        if not live:
            return None
        epoch = max(s.epoch for s in live)
        current = [s for s in live if s.epoch == epoch]
        return cls(
            epoch=epoch,
            samples=sum(s.samples + s.samples_per_second * max(0.0, now - s.time) for s in current),
            reported=sum(s.reported for s in current),
            samples_per_second=sum(s.samples_per_second for s in current),
            peers=sum(s.peers for s in live),
            peers_at_epoch=sum(s.peers_at_epoch for s in current),
            time=now,
        )

    def progress(self, target_batch_size: int, now: float) -> SwarmProgress:
        """The swarm's progress if this summary covers the whole swarm."""
        samples = self.samples + self.samples_per_second * max(0.0, now - self.time)
        missing = max(0.0, target_batch_size - samples)
        rate = self.samples_per_second
        eta = 0.0 if missing == 0 else (missing / rate if rate > 0 else math.inf)
        return SwarmProgress(
            epoch=self.epoch,
            samples=int(samples),
            target_batch_size=target_batch_size,
            samples_per_second=rate,
            num_peers=self.peers,
            num_peers_at_epoch=self.peers_at_epoch,
            eta=eta,
            reported=self.reported,
        )


@dataclass(frozen=True)
class ProgressTree:
    """The layout of a run's progress tree and one peer's refresh of it.

    Keys: a leaf ``{run_id}.progress.L.{d1}...{dD}`` holds the records of its
    peers (owner sub-keys); the summary key of a path ``{run_id}.progress.S``
    plus ``.{d}`` per level holds the summaries of its ``fanout`` children
    (sub-key: the child's digit). Raises ``ConfigError`` for a fanout below 2,
    a depth outside 1..8, or fewer than 1 writer.
    """

    run_id: str
    fanout: int = 32
    depth: int = 2
    #: summary writes aimed at per sub-tree and refresh (see the module docstring)
    writers: float = 3.0
    #: the nodes closest to a key that each write goes to (``DHTNode.store``):
    #: records and summaries are rewritten every refresh and readers read the
    #: 3 closest, so a few copies do; the DHT's k (20) were most of the
    #: datagrams of a converged refresh in ``benchmarks/scale.py``
    replicas: int = PROGRESS_REPLICAS

    def __post_init__(self) -> None:
        if self.fanout < 2 or not 1 <= self.depth <= 8 or self.writers < 1 or self.replicas < 1:
            raise ConfigError(
                "ProgressTree: fanout must be at least 2, depth between 1 and 8, "
                "writers and replicas at least 1"
            )

    def leaf(self, peer_id: PeerID) -> tuple[int, ...]:
        """The digits of ``peer_id``'s leaf: uniform, and fixed for the peer."""
        digest = hashlib.blake2b(bytes(peer_id), digest_size=16, person=_LEAF_PERSON).digest()
        value = int.from_bytes(digest, "big")
        digits = []
        for _ in range(self.depth):
            value, digit = divmod(value, self.fanout)
            digits.append(digit)
        return tuple(digits)

    def leaf_key(self, leaf: Sequence[int]) -> str:
        return f"{self.run_id}.progress.L." + ".".join(str(d) for d in leaf)

    def summary_key(self, path: Sequence[int]) -> str:
        """The key holding the summaries of the children of the sub-tree at ``path``
        (``()``: the root, whose children together are the whole swarm)."""
        return f"{self.run_id}.progress.S" + "".join(f".{d}" for d in path)

    async def refresh(
        self,
        dht: RecordDHT,
        mine: PeerProgress,
        *,
        now: float,
        ttl: float,
        stale_after: float,
        rng: random.Random,
    ) -> ProgressSummary:
        """Publish ``mine`` and return the whole swarm's summary (see the module
        docstring). Reads and writes each run in parallel; raises what the DHT
        raises (``SwarmError``); on cancellation, writes may be half done,
        which the next refresh repairs."""
        summary = await self._update(
            dht, mine, now=now, ttl=ttl, stale_after=stale_after, rng=rng, leaving=False
        )
        assert summary is not None  # ``mine`` is live at ``now``
        return summary

    async def withdraw(
        self, dht: RecordDHT, mine: PeerProgress, *, now: float, ttl: float, stale_after: float
    ) -> None:
        """Leave the tree: replace this peer's record, and the summaries on its
        path, with versions without it, so readers stop counting it at once.
        A sub-tree left empty gets a summary that is already stale. Each
        replacement expires just after the versions written before ``now``
        (the merge keeps the latest expiration), so a later write wins."""
        await self._update(
            dht,
            mine,
            now=now,
            ttl=ttl,
            stale_after=stale_after,
            rng=random.Random(0),
            leaving=True,
        )

    async def _update(
        self,
        dht: RecordDHT,
        mine: PeerProgress,
        *,
        now: float,
        ttl: float,
        stale_after: float,
        rng: random.Random,
        leaving: bool,
    ) -> ProgressSummary | None:
        leaf = self.leaf(mine.peer_id)
        keys = [self.leaf_key(leaf)]
        keys += [self.summary_key(leaf[:level]) for level in range(self.depth)]
        found: list[DHTValue | None] = [None] * len(keys)

        async def read(index: int) -> None:
            found[index] = await dht.get(keys[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(keys)):
                nursery.start_soon(read, index)
        if not leaving:
            async with trio.open_nursery() as nursery:
                for index in self._read_short(found, mine, now=now, stale_after=stale_after):
                    nursery.start_soon(
                        functools.partial(self._read_latest, dht, keys, found, index)
                    )

        # a replacement must beat whatever was written before now
        expiration = now + ttl + (_LATER if leaving else 0.0)
        gone = now - 2 * stale_after
        records = [r for r in parse_progress(found[0]) if r.peer_id != mine.peer_id]
        own = mine.to_value() | ({"time": gone} if leaving else {})
        writes: list[tuple[str, Any, str]] = [(keys[0], own, owner_marker(mine.peer_id))]
        if not leaving:
            records.append(mine)
        summary = ProgressSummary.of_records(records, now=now, stale_after=stale_after)
        for level in reversed(range(self.depth)):
            children = _parse_summaries(found[level + 1], self.fanout)
            previous = children.pop(leaf[level], None)
            if summary is not None:
                children[leaf[level]] = summary
            if leaving or previous is None or rng.random() < self.writers / previous.peers:
                written = summary or ProgressSummary(0, 0.0, 0, 0.0, 1, 1, gone)
                writes.append((keys[level + 1], written.to_value(), str(leaf[level])))
            summary = ProgressSummary.combine(children.values(), now=now, stale_after=stale_after)

        async def write(key: str, value: Any, subkey: str) -> None:
            await dht.store(key, value, expiration, subkey=subkey, replicas=self.replicas)

        async with trio.open_nursery() as nursery:
            for key, value, subkey in writes:
                nursery.start_soon(write, key, value, subkey)
        return summary

    def _read_short(
        self,
        found: Sequence[DHTValue | None],
        mine: PeerProgress,
        *,
        now: float,
        stale_after: float,
    ) -> list[int]:
        """Which keys of ``mine``'s path (their indices in ``found``, as
        ``_update`` reads them) were read short: their entries add up to fewer
        live peers than the parent's summary of their sub-tree counts.

        A read asks the few nodes closest to a key that its own look-up
        finds, and a writer stores to those that its look-up finds. Where the
        two differ (routing tables differ, the more so under load), a reader
        can keep reading old versions of its own sub-tree's key: it counts
        fewer peers there than there are, and now and then writes that count
        up the tree (``benchmarks/scale.py`` at 1,024 peers: one peer missed
        8, then 10, 13 and 16 of its sub-tree's leaves in steps 6 to 9, which
        every other peer counted). Such a key is read again with ``latest``,
        from every node close to it. Peers that left also make a sub-tree
        shrink until its parent is written again; the re-read then costs one
        ``latest`` read and changes nothing."""
        records = [r for r in parse_progress(found[0]) if r.peer_id != mine.peer_id] + [mine]
        summary = ProgressSummary.of_records(records, now=now, stale_after=stale_after)
        leaf, below, short = self.leaf(mine.peer_id), 0, []
        for level in reversed(range(self.depth)):
            children = _parse_summaries(found[level + 1], self.fanout)
            previous = children.pop(leaf[level], None)
            if (
                previous is not None
                and summary is not None
                and now - previous.time <= stale_after
                and summary.peers < previous.peers
            ):
                short.append(below)
            if summary is not None:
                children[leaf[level]] = summary
            summary = ProgressSummary.combine(children.values(), now=now, stale_after=stale_after)
            below = level + 1
        return short

    @staticmethod
    async def _read_latest(
        dht: RecordDHT, keys: Sequence[str], found: list[DHTValue | None], index: int
    ) -> None:
        """Read ``keys[index]`` again from every one of the nodes closest to it."""
        found[index] = await dht.get(keys[index], latest=True)

    async def read(
        self, dht: RecordDHT, *, now: float, stale_after: float
    ) -> ProgressSummary | None:
        """The whole swarm's summary from the root alone (for observers)."""
        children = _parse_summaries(await dht.get(self.summary_key(()), latest=True), self.fanout)
        return ProgressSummary.combine(children.values(), now=now, stale_after=stale_after)


def _parse_summaries(found: DHTValue | None, fanout: int) -> dict[int, ProgressSummary]:
    """The valid child summaries under a summary key, by digit (others skipped)."""
    if found is None or not isinstance(found.value, Mapping):
        return {}
    children = {}
    for subkey, entry in found.value.items():
        if not isinstance(subkey, str) or not subkey.isdigit() or int(subkey) >= fanout:
            continue
        try:
            children[int(subkey)] = ProgressSummary.from_value(entry.value)
        except ProtocolError:
            continue
    return children
