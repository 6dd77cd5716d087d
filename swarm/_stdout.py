"""Lines for the user on stdout that survive a reader going away.

``swarm train | head`` closes the pipe after ten lines; a peer that died of the
``BrokenPipeError`` of its next ``print`` would lose its training and leave a
ghost progress record behind. ``say`` prints and flushes; once stdout is
closed it points file descriptor 1 at ``/dev/null`` (so Python's own flush at
exit cannot fail either), notes it once in the log, and carries on.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("swarm")

_closed = False


def say(line: str) -> None:
    """Print ``line`` to stdout and flush it; never raises for a closed stdout."""
    global _closed
    if _closed:
        return
    try:
        print(line, flush=True)
    except BrokenPipeError:
        _closed = True
        _discard_stdout()
        log.info("stdout was closed by its reader; carrying on without it")


def stdout_closed() -> bool:
    """True once a write to stdout found it closed."""
    return _closed


def _discard_stdout() -> None:
    # Whatever is still buffered would raise again at the next flush: send
    # the descriptor to /dev/null, so the buffer drains into nothing.
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
