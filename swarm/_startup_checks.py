"""What ``swarm train`` checks before it starts, so a bad setting costs seconds, not a run.

Each check raises ``ConfigError`` with one line that says what to change (the
command line turns it into exit 2): a checkpoint directory that cannot be
written (found by writing and removing a probe file, not by reading mode bits,
which root ignores and a read-only file system overrides), a checkpoint
directory whose every checkpoint is damaged, and a port that is taken.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from pathlib import Path

from ._errors import ConfigError

log = logging.getLogger("swarm")

#: Name of the file written and removed to prove a directory writable.
PROBE_NAME = ".swarm-write-probe"
#: Suffix given to damaged checkpoints set aside by ``--restart-from-scratch``.
DAMAGED_SUFFIX = ".damaged"


def check_writable_directory(directory: Path, option: str = "--checkpoint-dir") -> None:
    """Create ``directory`` if missing and prove it writable with a probe file.

    Raises ``ConfigError`` naming ``option`` if it cannot be created, written to
    or cleaned up."""
    try:
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{option} {directory} is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / PROBE_NAME
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"swarm")
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise ConfigError(
            f"{option} {directory} is not writable ({reason}): pass a directory this user can write"
        ) from e


def check_checkpoints_loadable(directory: Path, *, restart_from_scratch: bool) -> None:
    """Refuse a checkpoint directory whose every checkpoint is damaged.

    Starting from scratch there would silently throw the run away. With
    ``restart_from_scratch`` the damaged files are set aside (renamed with
    ``DAMAGED_SUFFIX``, so they are kept for inspection and never loaded again)
    and the peer starts anew. Raises ``ConfigError`` otherwise. A directory with
    no checkpoint, or with one that loads, passes.
    """
    from trainer import CheckpointDir, load_checkpoint

    paths = CheckpointDir(directory).paths()
    for path in reversed(paths):  # newest first: the one the peer would resume from
        try:
            load_checkpoint(path)
            return
        except ConfigError:
            continue
    if not paths:
        return
    if not restart_from_scratch:
        raise ConfigError(
            f"every checkpoint in {directory} is damaged ({len(paths)} files): "
            "pass --restart-from-scratch to set them aside and start anew"
        )
    for path in paths:
        path.rename(path.with_name(path.name + DAMAGED_SUFFIX))
    log.warning(
        "every checkpoint in %s is damaged: set %d aside as *%s, starting from scratch",
        directory,
        len(paths),
        DAMAGED_SUFFIX,
    )


def check_port_free(host: str, port: int) -> None:
    """Raise ``ConfigError`` if ``port`` (nonzero) is taken on ``host`` for TCP or UDP.

    A peer listens on one port number for both. The sockets are closed again at
    once; another program could still take the port before the peer binds it,
    which the peer then reports as a runtime failure."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for kind, name in ((socket.SOCK_STREAM, "TCP"), (socket.SOCK_DGRAM, "UDP")):
        with socket.socket(family, kind) as sock:
            if kind == socket.SOCK_STREAM:
                # what the peer's listener sets too: a port in TIME_WAIT is free
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"port {port} on {host} is in use ({name}): pass another --port, "
                        "or --port 0 for any free one"
                    ) from e
                raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e})") from e
