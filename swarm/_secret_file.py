"""Files that hold secrets (identity keys, swarm keys): created 0600, refused
if other users can read or write them.

Both functions take ``what`` (e.g. ``"identity file"``) for their messages.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ._errors import ConfigError

#: Largest secret file we read; ours are a few hundred bytes.
MAX_SECRET_FILE = 4096


def read_secret_file(path: Path, what: str) -> bytes:
    """The contents of ``path``.

    Raises ``FileNotFoundError`` if it does not exist and ``ConfigError`` if
    group or others have any access to it (the message says how to fix it).
    The mode is checked on the open file, so it cannot change in between.
    """
    fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{what} {path} is accessible by other users "
                f"(mode {stat.S_IMODE(mode):o}); run: chmod 600 {path}"
            )
        return f.read(MAX_SECRET_FILE)


def create_secret_file(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` with mode 0600; True if this call created it.

    Atomic: the file never exists with wider permissions or half-written. If
    ``path`` exists already (also when another process created it meanwhile),
    nothing is written and the result is False.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)
