"""The Moshpit All-Reduce grid: which peers average together in which round.

Pure code, no network. Moshpit All-Reduce (Ryabinin et al., "Moshpit SGD",
NeurIPS 2021, Section 3.1 and Algorithm 1) places every peer on a virtual grid
of ``dimensions`` axes with ``size`` cells each (the paper's d and M). In round
t a peer averages with the peers that share its coordinates on every axis but
axis ``t mod d``; the DHT key of that group is built from the shared
coordinates and the round (Algorithm 1 stores the peer under
``[C_i^{t-1}, t]``). After the round each member takes a distinct coordinate
on that axis from its position in the group (Algorithm 1: ``c_i^t``, the index
of peer i in its group, becomes the newest chunk of its key), so group-mates
are scattered into different groups in the next round. With a full grid
(N = M^d peers, one per cell) and no failures every peer holds the exact
global mean after d rounds (Section 3.1, "Moshpit All-Reduce"). With fewer
peers or with failures it is not exact, but the spread still shrinks
geometrically: 900 peers on a 32x32 grid lose a factor of about 200 per
round after the first (``benchmarks/moshpit.py``).

A peer's whole state is ``MoshpitState``: the round and its coordinates.

Where a member lands after its group has averaged is decided by two things
that every member knows, so all members compute the same assignment without
talking (see ``MoshpitGrid.next_coordinates_of_group``):

- the *set* of coordinates the group fills is an arc of consecutive cells on
  the averaged axis, starting at an offset derived from the group key. The
  groups that meet again next round are those that differ only on the axis
  that next round leaves out; their offsets are that coordinate times a
  multiplier coprime with M (near M/phi^2) plus a shift hashed from the round
  and the remaining coordinates. So their arcs start at M distinct cells and
  cover the axis evenly, and because the multiplier is far from 1 the cells a
  group leaves empty in one round do not line up with those of the next. In
  the paper's 32x32 experiment (``benchmarks/moshpit.py``) this needs fewer
  rounds than offsets hashed from the group id (N=512: 5.9 rounds instead of
  6.3; N=900: 4.5 instead of 4.9, without failures), and offsets
  ``c + shift`` (multiplier 1) are far worse: N=512 then needs about 17.
  If the matchmaking splits the peers of one key into several groups, those
  groups fill the same arc, so next round's groups get two members from that
  key instead of one: the mean is unaffected, only the mixing is slower.
- *which* member takes which cell of the arc is its rank when the members
  are ordered by a hash of (group id, peer id), so no peer picks its next
  group by choosing its peer id or its place in the member list.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from swarm import ConfigError

MAX_DIMENSIONS = 16
MAX_SIZE = 2**16
MAX_CAPACITY = 2**64
"""Upper bound on size**dimensions, so that initial coordinates drawn from a
256-bit hash stay uniform."""

_INIT_PERSON = b"swarm.moshpit.in"
_SHIFT_PERSON = b"swarm.moshpit.sh"
_SLOT_PERSON = b"swarm.moshpit.sl"
_GOLDEN_FRACTION = (3 - math.sqrt(5)) / 2  # 1/phi**2, about 0.382


@dataclass(frozen=True)
class MoshpitGrid:
    """The virtual grid: ``dimensions`` axes (the paper's d) of ``size`` cells (M).

    A group is the peers that share a key, i.e. a line of the grid along the
    round's axis, so a group holds about N / M^(d-1) peers. Use ``for_swarm``
    to derive d and M from the expected number of peers and the target group
    size. Raises ``ConfigError`` when a field is out of range.
    """

    dimensions: int
    size: int

    def __post_init__(self) -> None:
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
            raise ConfigError(f"dimensions must be an int, got {self.dimensions!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int):
            raise ConfigError(f"size must be an int, got {self.size!r}")
        if not 1 <= self.dimensions <= MAX_DIMENSIONS:
            raise ConfigError(
                f"dimensions must be between 1 and {MAX_DIMENSIONS}, got {self.dimensions}: "
                "use MoshpitGrid.for_swarm(expected_peers, target_group_size)"
            )
        if not 1 <= self.size <= MAX_SIZE:
            raise ConfigError(
                f"size (cells per axis, about the group size) must be between 1 and "
                f"{MAX_SIZE}, got {self.size}"
            )
        if self.size**self.dimensions > MAX_CAPACITY:
            raise ConfigError(
                f"a {self.size}^{self.dimensions} grid has more than 2^64 cells: "
                "lower dimensions or size"
            )

    @classmethod
    def for_swarm(cls, expected_peers: int, target_group_size: int) -> MoshpitGrid:
        """The grid for about ``expected_peers`` peers in groups of at most about
        ``target_group_size``.

        d is the fewest axes with target_group_size^d >= expected_peers (the
        paper's d = ceil(log_M N)); M is then the smallest size with
        M^d >= expected_peers, so the grid is as full as it can be and groups
        hold about M <= target_group_size peers. Shrinking M matters: 1,100
        peers with target 32 would otherwise get a 32x32x32 grid whose groups
        hold about one peer each; this gives 11x11x11 with groups of about 10.
        Raises ``ConfigError`` for a count below 1, a target below 2, or a
        target so small that the grid would need more than 16 axes.
        """
        if isinstance(expected_peers, bool) or not isinstance(expected_peers, int):
            raise ConfigError(f"expected_peers must be an int, got {expected_peers!r}")
        if isinstance(target_group_size, bool) or not isinstance(target_group_size, int):
            raise ConfigError(f"target_group_size must be an int, got {target_group_size!r}")
        if expected_peers < 1:
            raise ConfigError(f"expected_peers must be at least 1, got {expected_peers}")
        if target_group_size < 2:
            raise ConfigError(
                f"target_group_size must be at least 2 (a group of one averages nothing), "
                f"got {target_group_size}"
            )
        dimensions = 1
        while target_group_size**dimensions < expected_peers:
            dimensions += 1
        if dimensions > MAX_DIMENSIONS:
            raise ConfigError(
                f"{expected_peers} peers in groups of {target_group_size} need more than "
                f"{MAX_DIMENSIONS} grid axes: raise target_group_size"
            )
        size = max(1, math.floor(expected_peers ** (1 / dimensions)) - 1)
        while size**dimensions < expected_peers:
            size += 1
        return cls(dimensions=dimensions, size=size)

    @property
    def capacity(self) -> int:
        """Number of cells, M^d: with this many peers averaging is exact in d rounds."""
        return int(self.size**self.dimensions)

    def axis(self, round: int) -> int:
        """The axis averaged over in ``round`` (Algorithm 1: round t varies axis t mod d)."""
        _check_round(round)
        return round % self.dimensions

    def initial_coordinates(self, peer_id: bytes) -> tuple[int, ...]:
        """Where a newcomer starts: a uniform cell derived from a hash of its peer id.

        Deterministic, so a peer that restarts with the same identity starts in
        the same cell.
        """
        digest = hashlib.blake2b(bytes(peer_id), digest_size=32, person=_INIT_PERSON).digest()
        value = int.from_bytes(digest, "big")
        coordinates = []
        for _ in range(self.dimensions):
            value, coordinate = divmod(value, self.size)
            coordinates.append(coordinate)
        return tuple(coordinates)

    def group_key(self, prefix: str, round: int, coordinates: Sequence[int]) -> str:
        """The DHT key under which the peers of one group find each other.

        ``f"{prefix}.moshpit.r{round}.{c0}.{c1}..."`` with ``*`` in place of the
        coordinate on the round's axis: peers that share every other coordinate
        and the round share the key (Algorithm 1, ``DHT[C_i^{t-1}, t]``). The
        round is part of the key so that peers of different rounds never meet.
        Raises ``ValueError`` for an empty prefix, a negative round or
        coordinates that do not fit the grid.
        """
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("the key prefix must be a non-empty string")
        axis = self.axis(round)
        self._check_coordinates(coordinates)
        cells = ".".join(
            "*" if position == axis else str(coordinate)
            for position, coordinate in enumerate(coordinates)
        )
        return f"{prefix}.moshpit.r{round}.{cells}"

    def next_coordinates_of_group(
        self,
        round: int,
        coordinates: Sequence[int],
        group_id: bytes,
        members: Sequence[bytes],
    ) -> list[tuple[int, ...]]:
        """Every member's coordinates for the next round, in the order of ``members``.

        ``coordinates`` are those of any member (members share all but the
        round's axis, which is the one replaced). Each member keeps its other
        coordinates and takes ``(offset + rank) mod size`` on the round's axis,
        where ``offset`` comes from the group key (see the module docstring)
        and ``rank`` is the member's place when members are sorted by a hash of
        (group id, peer id). So members of a group of at most ``size`` peers
        take distinct cells, which puts them in different groups next round
        (when ``dimensions >= 2``); a larger group wraps around the axis.

        Raises ``ValueError`` for bad coordinates, a negative round, an empty
        member list or a peer listed twice.
        """
        axis = self.axis(round)
        self._check_coordinates(coordinates)
        if not members:
            raise ValueError("a group has at least one member")
        if len(set(members)) != len(members):
            raise ValueError("the member list names a peer more than once")
        offset = self._offset(round, coordinates)
        group = bytes(group_id)
        hashes = [
            hashlib.blake2b(
                struct.pack(">I", len(group)) + group + bytes(member),
                digest_size=16,
                person=_SLOT_PERSON,
            ).digest()
            for member in members
        ]
        by_hash = sorted(range(len(members)), key=lambda index: (hashes[index], index))
        result: list[tuple[int, ...]] = [()] * len(members)
        for rank, index in enumerate(by_hash):
            new = list(coordinates)
            new[axis] = (offset + rank) % self.size
            result[index] = tuple(new)
        return result

    def next_coordinates(
        self,
        round: int,
        coordinates: Sequence[int],
        group_id: bytes,
        members: Sequence[bytes],
        index: int,
    ) -> tuple[int, ...]:
        """The coordinates of ``members[index]`` for the next round.

        The same as ``next_coordinates_of_group(...)[index]``: every member that
        calls this with the same group id and member list gets its own part of
        one agreed assignment. Raises ``ValueError`` as that method does, and
        for an index outside the member list.
        """
        if isinstance(index, bool) or not 0 <= index < len(members):
            raise ValueError(f"index {index} is not a position in a group of {len(members)}")
        return self.next_coordinates_of_group(round, coordinates, group_id, members)[index]

    def _offset(self, round: int, coordinates: Sequence[int]) -> int:
        """First cell of the arc a group fills on the round's axis.

        The groups whose members meet next round differ only on axis
        ``axis + 1`` (the one next round leaves out), so the offset is that
        coordinate times ``_spread(size)`` (a bijection: they start at M
        distinct cells) plus a shift hashed from the round and the other
        coordinates. With one axis, no later group depends on it: shift only.
        """
        axis = round % self.dimensions
        following = (axis + 1) % self.dimensions
        rest = [
            coordinate
            for position, coordinate in enumerate(coordinates)
            if position not in (axis, following)
        ]
        material = struct.pack(f">QBB{len(rest)}I", round, self.dimensions, axis, *rest)
        digest = hashlib.blake2b(material, digest_size=8, person=_SHIFT_PERSON).digest()
        shift = int.from_bytes(digest, "big") % self.size
        if self.dimensions == 1:
            return shift
        return (coordinates[following] * _spread(self.size) + shift) % self.size

    def _check_coordinates(self, coordinates: Sequence[int]) -> None:
        if len(coordinates) != self.dimensions:
            raise ValueError(
                f"a {self.dimensions}-dimensional grid needs {self.dimensions} coordinates, "
                f"got {len(coordinates)}"
            )
        for coordinate in coordinates:
            if isinstance(coordinate, bool) or not isinstance(coordinate, int):
                raise ValueError(f"coordinates are ints, got {coordinate!r}")
            if not 0 <= coordinate < self.size:
                raise ValueError(f"coordinate {coordinate} is outside [0, {self.size})")


@dataclass(frozen=True)
class MoshpitState:
    """All a peer remembers of the Moshpit schedule: the round and its cell."""

    round: int
    coordinates: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_round(self.round)
        if not isinstance(self.coordinates, tuple):
            raise ValueError("coordinates must be a tuple")

    @classmethod
    def join(cls, grid: MoshpitGrid, peer_id: bytes, round: int = 0) -> MoshpitState:
        """The state of a newcomer that enters the schedule at ``round``."""
        return cls(round, grid.initial_coordinates(peer_id))

    def key(self, grid: MoshpitGrid, prefix: str) -> str:
        """The DHT key of this round's group (``MoshpitGrid.group_key``)."""
        return grid.group_key(prefix, self.round, self.coordinates)

    def after_group(
        self, grid: MoshpitGrid, group_id: bytes, members: Sequence[bytes], index: int
    ) -> MoshpitState:
        """The state for the next round after averaging as ``members[index]``."""
        coordinates = grid.next_coordinates(self.round, self.coordinates, group_id, members, index)
        return MoshpitState(self.round + 1, coordinates)

    def after_missed_round(self) -> MoshpitState:
        """The state for the next round when this peer did not average in this one.

        It keeps its cell: its value was not mixed, so there is nothing to
        scatter, and it joins whichever group its key names next round.
        """
        return MoshpitState(self.round + 1, self.coordinates)


@functools.lru_cache(maxsize=64)
def _spread(size: int) -> int:
    """The multiplier coprime with ``size`` closest to size/phi^2 (smaller on a tie).

    Coprime, so that ``c * spread mod size`` is a bijection; near size/phi^2,
    so that consecutive coordinates land far apart (as in Fibonacci hashing)
    and an arc of cells in one round meets an arc of the next only briefly.
    """
    if size <= 2:
        return 1
    target = size * _GOLDEN_FRACTION
    candidates = [k for k in range(1, size) if math.gcd(k, size) == 1]
    return min(candidates, key=lambda k: (abs(k - target), k))


def _check_round(round: int) -> None:
    if isinstance(round, bool) or not isinstance(round, int):
        raise ValueError(f"a round is an int, got {round!r}")
    if not 0 <= round < 2**64:
        raise ValueError(f"a round is between 0 and 2^64, got {round}")
