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
from collections.abc import Callable
from typing import TypeVar

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
