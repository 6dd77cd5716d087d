"""The seam between trio and the asyncio world of the ``kademlia`` package.

Only this module imports ``trio_asyncio``. Everything asyncio (kademlia's
server, crawlers and our protocol subclass) runs inside a loop opened here,
and trio code reaches it only through ``AsyncioLoop.call``, with one
exception, kept here too: ``DatagramSocket``, the DHT's UDP socket, is read
by a trio task that calls the protocol's synchronous ``datagram_received``.
asyncio's datagram transport under trio-asyncio cost several trio task
switches per datagram (a reader task wakes, runs the transport's callback,
then waits for one more round of the asyncio loop, ``synchronize``); here
one task hands every waiting datagram over directly, in a trio context where
``asyncio.get_event_loop()`` is the node's trio-asyncio loop, so the
protocol's timers, futures and tasks work as before. Sending is a
non-blocking ``sendto`` that drops the datagram when the kernel's buffer is
full, as UDP may anyway.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
import trio_asyncio

from swarm._errors import ClosedError

T = TypeVar("T")

log = logging.getLogger(__name__)

#: Largest datagram read (the UDP payload limit; bigger ones cannot arrive).
_MAX_READ = 65_535
#: Datagrams handled per wake-up before other tasks get a turn.
_BATCH = 64


class AsyncioLoop:
    """Handle on a running trio-asyncio loop, callable from any trio task."""

    def __init__(self, loop: Any) -> None:
        self._loop = loop

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await asyncio coroutine function ``fn(*args)`` on this loop.

        Cancelling the trio caller cancels the asyncio task (the caller sees
        ``trio.Cancelled``). A task cancelled from the asyncio side, as every
        task left is when the loop closes under a caller that still waits,
        raises ``ClosedError``: asyncio's ``CancelledError`` is a
        ``BaseException`` that no ``except Exception`` boundary would catch.
        """
        try:
            result: T = await trio_asyncio.aio_as_trio(fn, loop=self._loop)(*args)
        except asyncio.CancelledError:
            raise ClosedError("the DHT node closed during the call") from None
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


class DatagramSocket:
    """A bound, non-blocking UDP socket with the transport methods the protocol uses."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._closed = False

    @classmethod
    def bind(cls, host: str, port: int) -> DatagramSocket:
        """Bind UDP ``host:port`` (``port=0``: a free one). Raises ``OSError``."""
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind(sockaddr)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    @property
    def port(self) -> int:
        port: int = self._sock.getsockname()[1]
        return port

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock.getsockname() if name == "sockname" else default

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._closed:
            return
        try:
            self._sock.sendto(data, addr)
        except OSError as e:  # a full buffer, or an ICMP error of an earlier datagram
            log.debug("datagram to %s not sent: %s", addr, e)

    def is_closing(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the socket; ``serve_datagrams`` on it returns."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._sock)
        self._sock.close()

    async def serve_datagrams(self, protocol: asyncio.DatagramProtocol) -> None:
        """Hand every datagram that arrives to ``protocol.datagram_received``
        until the socket is closed (then return). Exceptions the protocol
        raises propagate. Cancellation stops reading; the socket stays open."""
        sock = self._sock
        while not self._closed:
            try:
                await trio.lowlevel.wait_readable(sock)
            except (trio.ClosedResourceError, OSError):
                return
            for _ in range(_BATCH):
                if self._closed:
                    return
                try:
                    data, addr = sock.recvfrom(_MAX_READ)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:  # e.g. the ICMP "port unreachable" of a datagram we sent
                    log.debug("UDP receive error: %s", e)
                    continue
                protocol.datagram_received(data, (addr[0], addr[1]))
