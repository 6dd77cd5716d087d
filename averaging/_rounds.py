"""The rounds a peer runs now, by group id: where an incoming stream finds its round.

A member's stream may arrive before this peer has started the round it is
for (the others left matchmaking a moment earlier), so a lookup waits a
bounded time for the round to be registered. Both data planes route their
streams through one of these: the reliable all-reduce (``_allreduce``) and
the lossy one's control streams (``_lossy``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

import trio

from swarm import ConfigError

R = TypeVar("R")


class RoundsByGroup(Generic[R]):
    """Rounds by group id. Not thread-safe: use it on one trio thread."""

    def __init__(self) -> None:
        self._rounds: dict[bytes, R] = {}
        self._changed = trio.Event()

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._rounds

    @contextmanager
    def register(self, group_id: bytes, rnd: R) -> Iterator[None]:
        """``rnd`` is the round of ``group_id`` while the block runs. Raises
        ``ConfigError`` if a round of that group already runs here."""
        if group_id in self._rounds:
            raise ConfigError(
                f"a round of group {group_id.hex()} is already running on this peer"
            )
        self._rounds[group_id] = rnd
        self._changed.set()
        self._changed = trio.Event()
        try:
            yield
        finally:
            del self._rounds[group_id]

    def wake(self) -> None:
        """Wake every ``find`` to check its ``unless`` again."""
        self._changed.set()
        self._changed = trio.Event()

    async def find(
        self, group_id: bytes, *, wait: float, unless: Callable[[], bool] | None = None
    ) -> R | None:
        """The round of ``group_id``, waiting up to ``wait`` seconds for it to
        be registered; None if none was, or if ``unless()`` became true (checked
        on each ``register`` and ``wake``)."""
        with trio.move_on_after(wait):
            while group_id not in self._rounds and not (unless is not None and unless()):
                await self._changed.wait()
        return self._rounds.get(group_id)
