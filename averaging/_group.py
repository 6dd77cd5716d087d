"""The description of one averaging group, as every member of it sees it.

Matchmaking (leader-based, see DESIGN.md) hands every member the same
``Group``: the same ordered members and the same group id. Everything the
all-reduce derives from it (part boundaries, chunk boundaries, who reduces
what) is a pure function of this description, so members agree without
talking about it.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import struct
from dataclasses import dataclass, field

from swarm import ConfigError, PeerID

#: Largest group the all-reduce accepts. Moshpit groups are small (Ryabinin et
#: al. 2021, sec. 3.2 use groups of tens); the bound keeps contributor masks and
#: per-chunk bookkeeping small.
MAX_GROUP_SIZE = 256


class MemberMode(enum.Enum):
    """What a member does in the butterfly all-reduce."""

    #: Sends its data to every reducer, reduces its own part, gets the mean back.
    NODE = "node"
    #: Cannot accept connections: reduces nothing (part of size 0), only sends
    #: its data and receives the mean.
    CLIENT = "client"
    #: Has no data of its own (weight 0): only reduces its part for the others.
    AUX = "aux"


@dataclass(frozen=True)
class GroupMember:
    """One member: who it is, where to dial it, how fast it is, what it does.

    ``bandwidth`` is the member's declared share of the reducing work, relative
    to the others' (0: it reduces nothing). ``upload`` and ``download`` are the
    rates its link was measured to move in its earlier rounds, in bytes per
    second (``_link_meter``; 0: not measured, or the member declared its
    share instead). Parts follow the measured uploads when every member that
    reduces has one, and the declared shares otherwise
    (``_partition.part_weights``).

    ``relay`` is the address of a relay's circuit port when the member cannot
    be dialed at ``host:port`` (behind a NAT, ``swarm._relay``): the others
    reach it through a circuit there, and it can still reduce a part. None for
    a member anyone can dial.
    """

    peer_id: PeerID
    host: str
    port: int
    bandwidth: float = 1.0
    mode: MemberMode = MemberMode.NODE
    upload: float = 0.0
    download: float = 0.0
    relay: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        for name in ("bandwidth", "upload", "download"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.relay is not None:
            relay_host, relay_port = self.relay
            if not relay_host or not 0 < relay_port < 65536:
                raise ConfigError(f"relay {self.relay} is not a host and a port in [1, 65535]")

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


@dataclass(frozen=True)
class Group:
    """An ordered list of members, the group id they agreed on, and who we are.

    ``local_index`` is the only field that differs between members.
    """

    group_id: bytes
    members: tuple[GroupMember, ...]
    local_index: int
    #: the leader's view of how long the group took to gather: seconds from
    #: the leader opening its lobby to admitting its last member (the same for
    #: every member; None from a leader that predates it). Round timing
    #: (``trainer.RoundTiming``) sizes the next window from it.
    gathered: float | None = field(default=None, compare=False)
    #: the leader's decision that the members re-synchronise their state
    #: right after this round (the same for every member; None from a leader
    #: that did not decide or predates it). A lossy trainer re-synchronises
    #: on its own measured loss otherwise, and members whose measurements
    #: differed held state rounds that nobody else joined (``trainer._drift``).
    resync: bool | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = len(self.members)
        if not 1 <= n <= MAX_GROUP_SIZE:
            raise ConfigError(f"a group has 1 to {MAX_GROUP_SIZE} members, got {n}")
        if not 0 <= self.local_index < n:
            raise ConfigError(f"local_index {self.local_index} is not a member index (0..{n - 1})")
        if not 1 <= len(self.group_id) <= 64:
            raise ConfigError("group_id must be 1 to 64 bytes")
        if self.gathered is not None and not (
            math.isfinite(self.gathered) and self.gathered >= 0
        ):
            raise ConfigError(f"gathered must be a finite number >= 0, got {self.gathered}")
        if len({m.peer_id for m in self.members}) != n:
            raise ConfigError("a peer appears twice in the group")
        if not any(m.mode is not MemberMode.CLIENT and m.bandwidth > 0 for m in self.members):
            raise ConfigError(
                "no member can reduce: at least one member must be NODE or AUX with bandwidth > 0"
            )

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def local(self) -> GroupMember:
        return self.members[self.local_index]

    def senders(self) -> tuple[int, ...]:
        """Indices of the members that contribute data (everyone but AUX)."""
        return tuple(i for i, m in enumerate(self.members) if m.mode is not MemberMode.AUX)

    def sub_round(self, tag: bytes) -> Group:
        """The same members under a group id derived from ``tag``.

        For a further all-reduce of this group in the same step (ARC-Top-K
        averages sketches, then values): the all-reduce keys its rounds by
        group id, so rounds with different tags never exchange a chunk, and a
        member that calls with another tag is a failed member to the others.
        """
        if not 1 <= len(tag) <= 255:
            raise ConfigError("a sub-round tag is 1 to 255 bytes")
        digest = hashlib.blake2b(
            struct.pack("<B", len(tag)) + tag + self.group_id, digest_size=32, person=b"swarm.sub"
        ).digest()
        return dataclasses.replace(self, group_id=digest)


def mask_size(group_size: int) -> int:
    """Bytes of a contributor mask: one bit per member, in whole u32s."""
    return -(-group_size // 32) * 4


def contributor_mask(members: frozenset[int], group_size: int) -> bytes:
    """The contributor mask of ``members`` (member indices): bit i of byte
    i // 8 set for member i, ``mask_size`` bytes."""
    mask = bytearray(mask_size(group_size))
    for i in members:
        mask[i // 8] |= 1 << (i % 8)
    return bytes(mask)


def mask_members(mask: bytes | memoryview, group_size: int) -> frozenset[int]:
    """The member indices whose bits ``mask`` (``contributor_mask``) sets."""
    return frozenset(i for i in range(group_size) if mask[i // 8] >> (i % 8) & 1)
