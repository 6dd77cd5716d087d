"""Fault injection for the all-reduce, by composition (as torchft's ``fail_at``).

The production code asks its ``FaultPlan`` at a few well-defined points (before
sending a chunk, before returning an averaged chunk); with no plan, or no
fault for a member, every hook returns at once. Tests and chaos runs build a
plan; nothing subclasses or copies the all-reduce.

Faults are per role and counted in chunks, so their effect on the other
members is deterministic: "fails after sending 2 chunks" means every reducer
receives exactly chunks 0 and 1 of that member's data.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import trio


class InjectedFault(Exception):
    """Raised where a ``FaultPlan`` makes a member fail; it breaks that role's streams."""


@dataclass(frozen=True)
class MemberFault:
    """What goes wrong with one member. Chunk counts are per part (per stream)."""

    #: Crash at the start of the round: neither sends nor reduces
    #: (``all_reduce`` raises ``InjectedFault`` before touching the network).
    fail_before_sending: bool = False
    #: Stop sending after this many chunks to each reducer (streams break).
    fail_after_sending: int | None = None
    #: Sleep this long before each chunk from chunk ``send_delay_after`` on.
    send_delay: float = 0.0
    send_delay_after: int = 0
    #: As a reducer, break every stream after returning this many averaged chunks.
    fail_after_reducing: int | None = None
    #: As a reducer, sleep this long before returning each averaged chunk from
    #: chunk ``reduce_delay_after`` on.
    reduce_delay: float = 0.0
    reduce_delay_after: int = 0
    #: Call ``cancel`` (e.g. the caller's ``CancelScope.cancel``) and checkpoint
    #: when about to send this chunk: the member is cancelled as by its caller.
    cancel_before_chunk: int | None = None
    cancel: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if (self.cancel_before_chunk is None) != (self.cancel is None):
            raise ValueError("cancel_before_chunk and cancel go together")
        if self.send_delay < 0 or self.reduce_delay < 0:
            raise ValueError("delays must be >= 0")

    async def before_send(self, chunk: int) -> None:
        """Called by a sender before it sends ``chunk`` of a part."""
        if self.cancel_before_chunk is not None and chunk >= self.cancel_before_chunk:
            assert self.cancel is not None
            self.cancel()
            await trio.lowlevel.checkpoint()
        if self.fail_after_sending is not None and chunk >= self.fail_after_sending:
            raise InjectedFault(f"fault plan: fail after sending {self.fail_after_sending} chunks")
        if self.send_delay and chunk >= self.send_delay_after:
            await trio.sleep(self.send_delay)

    async def before_reply(self, chunk: int) -> None:
        """Called by a reducer before it returns averaged ``chunk`` to a sender."""
        if self.fail_after_reducing is not None and chunk >= self.fail_after_reducing:
            raise InjectedFault(
                f"fault plan: fail after reducing {self.fail_after_reducing} chunks"
            )
        if self.reduce_delay and chunk >= self.reduce_delay_after:
            await trio.sleep(self.reduce_delay)


NO_FAULT = MemberFault()


@dataclass(frozen=True)
class DatagramFaults:
    """A terrible network for the lossy all-reduce's datagrams (``_lossy``),
    applied where each member receives them, from a seeded generator.

    Each datagram is dropped with probability ``drop``; one that is kept is
    delivered twice with probability ``duplicate``, and held back until after
    the next datagram with probability ``reorder``.
    """

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be a probability in [0, 1]")

    def filter(self, member: int) -> DatagramFilter:
        """The filter of member ``member``'s receiver: its own seeded stream."""
        return DatagramFilter(self, random.Random(self.seed * 1_000_003 + member))


class DatagramFilter:
    """One receiver's ``DatagramFaults``: datagrams in, datagrams to deliver out."""

    def __init__(self, faults: DatagramFaults, rng: random.Random) -> None:
        self._faults = faults
        self._rng = rng
        self._held: bytes | None = None

    def __call__(self, datagram: bytes) -> list[bytes]:
        f, rng = self._faults, self._rng
        if rng.random() < f.drop:
            return []
        out = [datagram, datagram] if rng.random() < f.duplicate else [datagram]
        if self._held is not None:
            out.append(self._held)  # the held one goes after this one: reordered
            self._held = None
        elif rng.random() < f.reorder:
            self._held, out = out[-1], out[:-1]
        return out


@dataclass(frozen=True)
class FaultPlan:
    """Faults by member index; members not named behave. ``datagrams``: the
    network the lossy all-reduce's datagrams cross (None: whatever the real
    one does)."""

    faults: Mapping[int, MemberFault] = field(default_factory=dict)
    datagrams: DatagramFaults | None = None

    def for_member(self, index: int) -> MemberFault:
        return self.faults.get(index, NO_FAULT)
