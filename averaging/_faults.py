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
class FaultPlan:
    """Faults by member index; members not named behave."""

    faults: Mapping[int, MemberFault] = field(default_factory=dict)

    def for_member(self, index: int) -> MemberFault:
        return self.faults.get(index, NO_FAULT)
