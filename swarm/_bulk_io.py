"""Bulk payloads moved by worker threads, off the trio loop.

A connection's large frames (an all-reduce chunk: hundreds of KiB to MiB)
are sealed and written, or read and opened, by a worker thread that makes
blocking-style system calls of its own: it waits for the socket with
``poll`` instead of trio's scheduler, and it does the framing's cryptography
(``_framing``) and the caller's ``progress`` checks there too. System calls,
AES-GCM and torch's reductions release the GIL, so each direction of each
connection moves its bytes while the trio thread serves everything else
(the DHT, the other connections, the round's bookkeeping), and a link is
never left idle because the one trio thread was busy elsewhere.

``run_in_thread`` is the seam between the two worlds. It runs a function
``fn(stopper)`` in a worker thread (trio's thread cache, so threads are
reused) and waits for it. Cancelling the waiting task asks the function to
stop (``Stopper.stop``, which also wakes it from ``poll``) and still waits
for it to return, which it does between two system calls: the objects it
works on (a frame decoder or encoder) are then in a consistent state, and
the cancellation is raised at the caller's next checkpoint.

``worker_batches`` is the seam for a whole transfer: one worker thread runs
it (an all-reduce's every chunk from one peer, ``Stream.receive_sequence``)
and hands its items over in batches (``Batches``), so that the trio thread
is woken once per batch instead of twice per frame.

The worker thread works on a duplicate of the socket's file descriptor
(``os.dup``), never on the socket's own: a socket closed by the trio thread
meanwhile cannot have its descriptor number reused under the worker's feet
(a new connection's bytes read by an old stream). Closing the connection
stops its workers (``Stopper.stop``); the last descriptor they close ends
the TCP connection as the socket's close would have.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Generic, TypeVar

import outcome
import trio

_T = TypeVar("_T")


class Stopped(Exception):
    """The worker stopped (cancelled, or its connection closed) before its work was done."""


class Stopper:
    """Asks one worker thread to stop between system calls.

    ``stop`` may be called from the trio thread at any time, also twice; the
    worker checks ``stopped`` before each system call, and ``wait`` returns
    as soon as ``stop`` is called. ``close`` (trio thread, once the worker has
    returned) frees the wake-up descriptor.
    """

    def __init__(self) -> None:
        self.stopped = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            os.eventfd_write(self._wake, 1)

    def wait(self, fd: int, events: int) -> None:
        """Block until ``fd`` is ready for ``events`` (``select.POLLIN`` or
        ``POLLOUT``), has an error or hang-up, or ``stop`` is called."""
        poller = select.poll()
        poller.register(fd, events)
        poller.register(self._wake, select.POLLIN)
        if not self.stopped:
            poller.poll()

    def check(self) -> None:
        """``Stopped`` if ``stop`` was called."""
        if self.stopped:
            raise Stopped("the worker was asked to stop")

    def close(self) -> None:
        os.close(self._wake)


async def run_in_thread(fn: Callable[[Stopper], _T], active: set[Stopper]) -> _T:
    """``fn(stopper)`` in a worker thread; its result, or what it raised.

    ``stopper`` is in ``active`` while the worker runs, so that whoever closes
    the resource it works on can stop it. On cancellation the worker is asked
    to stop and this still waits for it to return (``fn`` must then return or
    raise soon: it checks ``stopper`` between system calls); its result is
    returned, or ``Stopped`` raised, and the cancellation follows at the
    caller's next checkpoint. ``fn`` must not touch trio objects.
    """
    await trio.lowlevel.checkpoint_if_cancelled()
    stopper = Stopper()
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[_T]) -> None:  # in the worker thread
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        stopper.stop()
        return trio.lowlevel.Abort.FAILED  # the worker's ``deliver`` reschedules us

    active.add(stopper)
    try:
        trio.lowlevel.start_thread_soon(lambda: fn(stopper), deliver)
        value: _T = await trio.lowlevel.wait_task_rescheduled(abort)
        return value
    finally:
        active.discard(stopper)
        stopper.close()


def duplicate(sock: trio.socket.SocketType) -> socket.socket:
    """A socket object on a duplicate descriptor of ``sock`` (same connection,
    same non-blocking flag), for a worker thread; the caller closes it."""
    return socket.socket(fileno=os.dup(sock.fileno()))


class Batches(Generic[_T]):
    """Items that one long-lived worker thread makes, taken by the trio thread
    in batches.

    ``run_in_thread`` costs two hand-offs per call (the thread's wake-up, then
    the trio thread's), tens of microseconds of the trio thread's CPU each: per
    chunk of an all-reduce, that was half of what a peer spent on a 100 Mbit/s
    link. Here the worker runs a whole transfer (``work(batches)``) and
    ``put``\\ s each item as it is done; the trio thread is woken once for
    whatever accumulated since it last took (``next_batch``), so a trio thread
    busy elsewhere takes several items per wake-up, and an idle one one.

    The worker runs at most ``window`` items ahead of what was taken (``put``
    then sleeps), so that it cannot fill memory faster than the trio thread
    uses it. ``wake_ups`` counts the trio thread's wake-ups (for tests).
    Use it through ``worker_batches``, which starts the worker and, whatever
    happens, stops it and waits for it to return.
    """

    def __init__(self, window: int, active: set[Stopper]) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be at least 1")
        self._window = window
        self._active = active
        self.stopper = Stopper()
        self._lock = threading.Lock()
        self._ready: list[_T] = []
        self._wake_pending = False  # a wake-up is on its way to the trio thread
        self._full = False  # the worker sleeps until items are taken
        self._room = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._token = trio.lowlevel.current_trio_token()
        self._event = trio.Event()
        self._returned = False
        self._error: BaseException | None = None
        self.wake_ups = 0

    def put(self, item: _T) -> None:
        """Worker thread: hand ``item`` over. Sleeps while ``window`` items
        wait to be taken; ``Stopped`` if asked to stop meanwhile."""
        while True:
            with self._lock:
                if len(self._ready) < self._window:
                    self._ready.append(item)
                    wake, self._wake_pending = not self._wake_pending, True
                    break
                self._full = True
            self.stopper.wait(self._room, select.POLLIN)
            self.stopper.check()
            with suppress(BlockingIOError):
                os.eventfd_read(self._room)
        if wake:
            self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:  # trio thread
        self.wake_ups += 1
        self._event.set()

    def _returns(self, result: outcome.Outcome[None]) -> None:  # trio thread
        self._returned = True
        if isinstance(result, outcome.Error):
            self._error = result.error
        self._event.set()

    async def next_batch(self) -> list[_T]:
        """The items put since the last call (at least one), waiting for one
        if none is ready; ``[]`` once the worker has returned and every item
        was taken; then what the worker raised, if it did (after the items it
        put before). Cancellation loses nothing."""
        while True:
            with self._lock:
                items, self._ready = self._ready, []
                self._wake_pending = False
                if self._full:
                    self._full = False
                    os.eventfd_write(self._room, 1)
            if items or self._returned:
                await trio.lowlevel.checkpoint()
                if not items and self._error is not None:
                    raise self._error
                return items
            self._event = trio.Event()
            await self._event.wait()

    def _start(self, work: Callable[[Batches[_T]], None]) -> None:
        token = self._token

        def deliver(result: outcome.Outcome[None]) -> None:  # in the worker thread
            token.run_sync_soon(self._returns, result)

        self._active.add(self.stopper)
        trio.lowlevel.start_thread_soon(lambda: work(self), deliver)

    async def _stop(self) -> None:
        """Ask the worker to stop, wait for it to return, free the descriptors."""
        self.stopper.stop()
        with trio.CancelScope(shield=True):
            while not self._returned:
                self._event = trio.Event()
                await self._event.wait()
        self._active.discard(self.stopper)
        self.stopper.close()
        os.close(self._room)


@asynccontextmanager
async def worker_batches(
    work: Callable[[Batches[_T]], None], active: set[Stopper], window: int
) -> AsyncIterator[Batches[_T]]:
    """Run ``work(batches)`` in a worker thread (trio's thread cache) for the
    body of the ``async with``, which takes its items with
    ``batches.next_batch()``. On leaving, also by an error or a cancellation,
    the worker is asked to stop (``work`` must check ``batches.stopper``
    between system calls, as ``run_in_thread``'s functions do) and waited
    for. ``batches.stopper`` is in ``active`` while the worker runs, so that
    whoever closes what it works on can stop it. ``work`` must not touch trio
    objects."""
    await trio.lowlevel.checkpoint_if_cancelled()
    batches: Batches[_T] = Batches(window, active)
    batches._start(work)
    try:
        yield batches
    finally:
        await batches._stop()
