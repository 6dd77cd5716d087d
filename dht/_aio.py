"""The seam between trio and the asyncio world of the ``kademlia`` package.

Only this module imports ``trio_asyncio``. Everything asyncio (kademlia's
server, crawlers and our protocol subclass) runs inside a loop opened here,
and trio code reaches it only through ``AsyncioLoop.call``, with one
exception: the trio task reading the UDP socket (``_udp``) calls the
protocol's synchronous ``datagram_received`` directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio_asyncio

T = TypeVar("T")


class AsyncioLoop:
    """Handle on a running trio-asyncio loop, callable from any trio task."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await asyncio coroutine function ``fn(*args)`` on this loop.

        Cancelling the trio caller cancels the asyncio task.
        """
        result: T = await trio_asyncio.aio_as_trio(fn, loop=self._loop)(*args)
        return result

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run plain ``fn(*args)`` with this loop current (for code that
        schedules asyncio callbacks or tasks)."""

        async def wrapper() -> T:
            return fn(*args)

        return await self.call(wrapper)


@asynccontextmanager
async def open_asyncio_loop() -> AsyncIterator[AsyncioLoop]:
    """An asyncio loop for the duration of the block.

    Re-uses the loop of an enclosing block in the same task tree (many DHT nodes
    in one process share one loop), otherwise opens one.
    """
    loop = trio_asyncio.current_loop.get()
    if loop is not None:
        yield AsyncioLoop(loop)
        return
    async with trio_asyncio.open_loop() as loop:
        yield AsyncioLoop(loop)
