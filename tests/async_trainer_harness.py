"""Many ``AsyncCollaborativeOptimizer`` peers in one ``trio.run`` on virtual time.

``held_clock`` is a ``MockClock`` that jumps to the next timer once the whole
process has been idle for 50 ms (every peer lives in this process and their
packets are on loopback, so idleness means everyone waits for a timer), and
that stands still while any worker thread of ``trio.to_thread.run_sync`` runs:
the optimizer's tensor work (accumulating, the inner step, staging, state
averaging's chunks) takes no virtual time, so a peer computing on a loaded
machine never misses a deadline that its compute would not miss in real time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

T = TypeVar("T")

#: real seconds of idleness after which virtual time jumps to the next timer
IDLE = 0.05


def held_clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """A clock for the test's trio run (return it from a fixture: pytest-trio
    uses a fixture that is a clock) whose autojump is held while any
    ``trio.to_thread.run_sync`` of the run computes."""
    clock = trio.testing.MockClock(autojump_threshold=IDLE)
    real = trio.to_thread.run_sync
    computing = 0

    async def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        nonlocal computing
        computing += 1
        clock.autojump_threshold = math.inf
        try:
            return await real(fn, *args, **kwargs)
        finally:
            computing -= 1
            if computing == 0:
                clock.autojump_threshold = IDLE

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    return clock
