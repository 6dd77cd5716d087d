"""``GridAgreement``: one Moshpit grid per epoch for every peer of a run.

Peers meet only if they compute the same group keys, and a group key depends
on the grid (``MoshpitGrid``: dimensions and cells per axis). Sizing the grid
from each peer's own estimate of the swarm, even rounded to a power of two,
splits the swarm whenever estimates straddle a boundary: 100 and 200 peers
round to 128 and 256, which give 12x12 and 16x16 grids, and those peers never
meet. So the grid is not estimated, it is agreed, by one rule over shared
state:

- A grid *proposal* for an epoch is a signed record under ``{prefix}.grid``
  (owner sub-key): the epoch, the proposer's estimate and the grid that
  ``MoshpitGrid.for_swarm`` gives for it.
- Every peer ranks proposers by ``blake2b(epoch, peer_id)``: a lottery
  nobody can win on purpose, the same for all. The epoch's grid is the grid
  of the proposal, for that epoch, with the lowest rank (``choose``). Any two
  peers that read the same proposals agree, whatever their own estimates.
- Proposals for epoch ``e`` are written early, while epoch ``e - 1`` runs
  (``propose``), and read when epoch ``e``'s matchmaking begins (``agree``):
  a whole epoch for them to reach the responsible nodes, so every reader sees
  the same set. Only peers whose rank falls in the lowest ``proposers / n``
  of the rank space propose (``n``: their estimate of the swarm), so the key
  holds a handful of proposals however large the swarm; with estimates at
  most twice the true size, an epoch without any proposer has probability
  about ``exp(-proposers / 2)`` (2% for 8), and then ``agree`` returns None
  and the caller falls back to its own estimate (the old rule).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dht import DHTValue, RecordDHT, owner_marker
from swarm import ConfigError, PeerID, ProtocolError
from swarm._wire import expect_int

from ._moshpit import MoshpitGrid

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
    proposer, or a non-positive ttl.
    """

    prefix: str
    target_group_size: int
    #: proposals aimed at per epoch
    proposers: float = 8.0
    #: how long a proposal is kept (seconds): at least two epochs
    ttl: float = 600.0

    def __post_init__(self) -> None:
        if self.target_group_size < 2 or self.proposers < 1 or not self.ttl > 0:
            raise ConfigError(
                "GridAgreement: target_group_size must be at least 2, proposers at least 1 "
                "and ttl positive"
            )

    @property
    def key(self) -> str:
        return f"{self.prefix}.grid"

    def should_propose(self, peer_id: PeerID, epoch: int, estimate: int) -> bool:
        """Whether this peer is one of the epoch's few proposers."""
        return rank(epoch, peer_id) < self.proposers / max(1, estimate)

    async def propose(self, dht: RecordDHT, peer_id: PeerID, epoch: int, estimate: int) -> bool:
        """Propose the grid for ``epoch`` from ``estimate`` if this peer is one of
        its proposers (call it while the epoch before runs). Returns whether a
        proposal was stored; raises what the DHT raises (``SwarmError``)."""
        if not self.should_propose(peer_id, epoch, estimate):
            return False
        grid = MoshpitGrid.for_swarm(max(1, estimate), self.target_group_size)
        proposal = GridProposal(peer_id, epoch, grid)
        return await dht.store(
            self.key, proposal.to_value(), dht.now() + self.ttl, subkey=owner_marker(peer_id)
        )

    async def agree(self, dht: RecordDHT, epoch: int) -> MoshpitGrid | None:
        """The agreed grid of ``epoch`` (None if nobody proposed one)."""
        return choose(parse_proposals(await dht.get(self.key)), epoch)
