"""``GridAgreement``: one Moshpit grid per epoch for every peer of a run.

Peers meet only if they compute the same group keys, and a group key depends
on the grid (``MoshpitGrid``: dimensions and cells per axis). Sizing the grid
from each peer's own estimate of the swarm, even rounded to a power of two,
splits the swarm whenever estimates straddle a boundary: 100 and 200 peers
round to 128 and 256, which give 12x12 and 16x16 grids, and those peers never
meet. So the grid is not estimated, it is agreed, by one rule over shared
state:

- A grid *proposal* for epoch ``e`` is a signed record under the epoch's own
  key ``{prefix}.grid.{e}`` (owner sub-key): the epoch and the proposed grid.
  One key per epoch, so a peer's proposal for a later epoch never replaces
  the one that readers of an earlier epoch still need.
- Every peer ranks proposers by ``blake2b(epoch, peer_id)``: a lottery
  nobody can win on purpose, the same for all. The epoch's grid is the grid
  of the proposal, for that epoch, with the lowest rank (``choose``). Any two
  peers that read the same proposals agree, whatever their own estimates.
- Only peers whose rank falls in the lowest ``proposers / n`` of the rank
  space propose (``n``: their estimate of the swarm), so the key holds a
  handful of proposals however large the swarm; with estimates at most twice
  the true size, an epoch without any proposer has probability about
  ``exp(-proposers / 2)`` (2% for 8), and then the fallback below decides.
- A proposal keeps the grid in use unless the proposer's estimate left the
  range it serves (``proposal``: capacity between half and twice the
  estimate): then proposals of peers whose estimates differ up to 2x are
  mostly the same grid, so even two peers that read different subsets of the
  proposals usually agree, and the Moshpit coordinates are not reset every
  epoch by a grid that flips between neighbouring sizes.

When proposals are written and read (``GridSchedule``, one per peer): as the
matchmaking of epoch ``e`` begins, a peer proposes for ``e + ahead`` (2 by
default) and reads epoch ``e + 1``'s proposals, both in the background. So a
proposal has had a whole epoch (the rest of the epoch it was written in, its
averaging round, and the compute phase of the next) to reach the responsible
nodes before anyone reads it, and the grid of each round is known before the
round begins: no round waits for the DHT. Where an epoch has no proposal, or
its read had not finished when its round began, the grid is the previous
epoch's (which every peer of that round shared); where a peer knows neither
(a newcomer, a peer that caught up) it reads the epoch's proposals within a
bound, and else takes the 1-D grid, the same for everyone.

The cold start (``GridSchedule.cold_start``): epochs below ``ahead`` have
nobody to propose for them ``ahead`` epochs early, and the 1-D grid would put
every peer of a new run on one matchmaking key (256 peers: ~10k open
connections and minutes per round). So a peer that starts a run (its epoch
is 0) proposes for those epochs at once, as it joins, sized from what it
knows without waiting (its DHT routing table's size estimate), unless the
grid agreed there already fits its estimate (as ``proposal`` keeps a grid):
a peer that joins late must not change a grid that others may have read,
unless that grid was sized for a swarm less than half as large (by the run's
first peer, alone: a 1-D grid). The peers of a new run start within a
compute phase of each other, and the epoch's grid is read as its first round
begins, so the proposals are in by then; the lowest rank wins as for every
epoch, so peers whose estimates differ still agree.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from dht import DHTValue, RecordDHT, owner_marker
from swarm import ConfigError, PeerID, ProtocolError, SwarmError
from swarm._wire import expect_int

from ._moshpit import MoshpitGrid

log = logging.getLogger(__name__)

_RANK_PERSON = b"swarm.grid.rank"


@dataclass(frozen=True)
class GridProposal:
    """One peer's proposal of the grid for ``epoch``."""

    proposer: PeerID
    epoch: int
    grid: MoshpitGrid

    def to_value(self) -> list[int]:
        return [self.epoch, self.grid.dimensions, self.grid.size]

    @classmethod
    def from_value(cls, proposer: PeerID, value: Any) -> GridProposal:
        """Decode a proposal; raises ``ProtocolError`` if malformed."""
        if not isinstance(value, list) or len(value) != 3:
            raise ProtocolError("a grid proposal is [epoch, dimensions, size]")
        epoch = expect_int(value[0], "epoch", lo=0, hi=2**62)
        try:
            grid = MoshpitGrid(expect_int(value[1], "dimensions"), expect_int(value[2], "size"))
        except ConfigError as e:
            raise ProtocolError(f"grid proposal: {e}") from e
        return cls(proposer, epoch, grid)


def rank(epoch: int, peer_id: bytes) -> float:
    """A peer's place in the epoch's lottery, uniform in [0, 1)."""
    digest = hashlib.blake2b(
        struct.pack(">Q", epoch) + bytes(peer_id), digest_size=8, person=_RANK_PERSON
    ).digest()
    return int.from_bytes(digest, "big") / 2**64


def choose(proposals: Iterable[GridProposal], epoch: int) -> MoshpitGrid | None:
    """The agreed grid of ``epoch``: that of the lowest-ranked proposal for it
    (ties, which need a hash collision, go to the lower peer id), or None."""
    candidates = [p for p in proposals if p.epoch == epoch]
    if not candidates:
        return None
    best = min(candidates, key=lambda p: (rank(epoch, p.proposer), bytes(p.proposer)))
    return best.grid


def parse_proposals(found: DHTValue | None) -> list[GridProposal]:
    """The valid proposals under a grid key (malformed ones are skipped)."""
    if found is None or not isinstance(found.value, Mapping):
        return []
    proposals = []
    for subkey, entry in found.value.items():
        if not isinstance(subkey, str) or not subkey.startswith("[owner:"):
            continue
        try:
            proposer = PeerID.from_hex(subkey[len("[owner:") : -1])
            proposals.append(GridProposal.from_value(proposer, entry.value))
        except (ProtocolError, ValueError):
            continue
    return proposals


@dataclass(frozen=True)
class GridAgreement:
    """Agree on each epoch's grid through the DHT (see the module docstring).

    Raises ``ConfigError`` for a target group size below 2, fewer than 1
    proposer, a non-positive ttl, or ``ahead`` below 2.
    """

    prefix: str
    target_group_size: int
    #: proposals aimed at per epoch
    proposers: float = 8.0
    #: how long a proposal is kept (seconds): at least ``ahead`` epochs
    ttl: float = 600.0
    #: a proposal made as epoch ``e``'s matchmaking begins is for ``e + ahead``
    ahead: int = 2

    def __post_init__(self) -> None:
        if self.target_group_size < 2 or self.proposers < 1 or not self.ttl > 0:
            raise ConfigError(
                "GridAgreement: target_group_size must be at least 2, proposers at least 1 "
                "and ttl positive"
            )
        if self.ahead < 2:
            raise ConfigError(
                f"GridAgreement: ahead ({self.ahead}) must be at least 2: the grid of the next "
                "epoch is read as this one's matchmaking begins, so its proposals must be "
                "older than that"
            )

    def key(self, epoch: int) -> str:
        """The key holding the proposals for ``epoch``."""
        return f"{self.prefix}.grid.{epoch}"

    @property
    def default(self) -> MoshpitGrid:
        """The grid when nothing is known: one axis, so every key is the same."""
        return MoshpitGrid(1, self.target_group_size)

    def should_propose(self, peer_id: PeerID, epoch: int, estimate: int) -> bool:
        """Whether this peer is one of the epoch's few proposers."""
        return rank(epoch, peer_id) < self.proposers / max(1, estimate)

    def proposal(self, estimate: int, current: MoshpitGrid | None) -> MoshpitGrid:
        """The grid to propose for a swarm of about ``estimate`` peers while
        ``current`` is in use: ``current`` while its capacity is between half
        and twice the estimate, else the grid sized for the estimate."""
        estimate = max(1, estimate)
        if current is not None and estimate / 2 <= current.capacity <= 2 * estimate:
            return current
        return MoshpitGrid.for_swarm(estimate, self.target_group_size)

    async def propose(
        self,
        dht: RecordDHT,
        peer_id: PeerID,
        epoch: int,
        estimate: int,
        current: MoshpitGrid | None = None,
    ) -> bool:
        """Propose the grid for ``epoch`` (``proposal(estimate, current)``) if this
        peer is one of its proposers (call it ``ahead`` epochs early). Returns
        whether a proposal was stored; raises what the DHT raises (``SwarmError``)."""
        if not self.should_propose(peer_id, epoch, estimate):
            return False
        proposal = GridProposal(peer_id, epoch, self.proposal(estimate, current))
        return await dht.store(
            self.key(epoch), proposal.to_value(), dht.now() + self.ttl, subkey=owner_marker(peer_id)
        )

    async def agree(self, dht: RecordDHT, epoch: int) -> MoshpitGrid | None:
        """The agreed grid of ``epoch`` (None if nobody proposed one). Raises what
        the DHT raises (``SwarmError``)."""
        return choose(parse_proposals(await dht.get(self.key(epoch))), epoch)


class GridSchedule:
    """One peer's agreed grids, epoch by epoch, read an epoch ahead (see the
    module docstring). Use it from one trio thread."""

    #: epochs of grids remembered (the current one, the next, a few before)
    KEEP = 8

    def __init__(self, agreement: GridAgreement, peer_id: PeerID) -> None:
        self.agreement = agreement
        self.peer_id = peer_id
        self._grids: dict[int, MoshpitGrid] = {}
        #: resolved epochs that no proposal decided (the fallback did)
        self.fallbacks: set[int] = set()

    def known(self, epoch: int) -> MoshpitGrid | None:
        """The grid already resolved for ``epoch`` (None if not yet)."""
        return self._grids.get(epoch)

    def _fallback(self, epoch: int) -> MoshpitGrid:
        return self._grids.get(epoch - 1, self.agreement.default)

    def _remember(self, epoch: int, grid: MoshpitGrid, *, fallback: bool) -> None:
        self._grids[epoch] = grid
        if fallback:
            self.fallbacks.add(epoch)
        for old in [e for e in self._grids if e < epoch - self.KEEP]:
            del self._grids[old]
        self.fallbacks = {e for e in self.fallbacks if e >= epoch - self.KEEP}

    async def resolve(self, dht: RecordDHT, epoch: int) -> MoshpitGrid:
        """Read ``epoch``'s proposals and fix its grid: the agreed one, else the
        previous epoch's (else the default). A grid once fixed is kept. Raises what the DHT raises
        (``SwarmError``); then nothing is fixed. Cancellation: likewise."""
        agreed = await self.agreement.agree(dht, epoch)
        known = self._grids.get(epoch)
        if known is not None:
            return known  # fixed meanwhile (a round may have used it): never changed
        grid = agreed if agreed is not None else self._fallback(epoch)
        self._remember(epoch, grid, fallback=agreed is None)
        return grid

    async def grid(self, dht: RecordDHT, epoch: int, *, timeout: float) -> MoshpitGrid:
        """The grid of ``epoch``'s round, fixed from then on: the one resolved
        ahead of time; else, if the epoch before is known (the read ahead was
        late), that one at once, for a round must not wait for the DHT (the
        proposals mostly keep the grid, so this mostly agrees); else (nothing
        known: a newcomer, a peer that caught up) ``resolve``d now within
        ``timeout`` seconds, else the default. Never raises ``SwarmError``;
        cancellation propagates."""
        known = self._grids.get(epoch)
        if known is not None:
            return known
        if epoch - 1 in self._grids:
            log.debug("epoch %d: its grid was not read in time; keeping the last one", epoch)
            grid = self._fallback(epoch)
            self._remember(epoch, grid, fallback=True)
            return grid
        with trio.move_on_after(timeout):
            try:
                return await self.resolve(dht, epoch)
            except SwarmError as e:
                log.debug("epoch %d: could not read the grid proposals: %s", epoch, e)
        grid = self._fallback(epoch)
        self._remember(epoch, grid, fallback=True)
        return grid

    async def cold_start(self, dht: RecordDHT, epoch: int, estimate: int) -> int:
        """As this peer joins at ``epoch`` (see the module docstring): if the run
        is new (``epoch`` 0), propose for each epoch before ``ahead`` whose
        agreed grid, if any, does not fit ``estimate``, if this peer is one of
        its proposers. Returns the proposals stored; raises what the DHT raises
        (``SwarmError``)."""
        if epoch != 0:
            return 0
        stored = 0
        for early in range(self.agreement.ahead):
            if not self.agreement.should_propose(self.peer_id, early, estimate):
                continue
            agreed = choose(parse_proposals(await dht.get(self.agreement.key(early))), early)
            if agreed is not None and self.agreement.proposal(estimate, agreed) == agreed:
                continue  # decided for the peers that read it, and it fits
            stored += await self.agreement.propose(dht, self.peer_id, early, estimate)
        return stored

    async def prepare(self, dht: RecordDHT, epoch: int, estimate: int) -> None:
        """As ``epoch``'s matchmaking begins (in the background): propose for
        ``epoch + ahead`` if this peer is a proposer, from ``estimate`` and the
        newest grid known, and resolve ``epoch + 1``'s grid unless known.
        Failures are logged, not raised; cancellation propagates (then the
        next epoch's grid is resolved when its round begins)."""
        newest = self._grids[max(self._grids)] if self._grids else None
        later = epoch + self.agreement.ahead

        async def propose() -> None:
            try:
                await self.agreement.propose(dht, self.peer_id, later, estimate, newest)
            except SwarmError as e:
                log.debug("epoch %d: could not propose a grid: %s", later, e)

        async def read() -> None:
            try:
                await self.resolve(dht, epoch + 1)
            except SwarmError as e:
                log.debug("epoch %d: could not read the grid proposals: %s", epoch + 1, e)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(propose)
            if epoch + 1 not in self._grids:
                nursery.start_soon(read)
