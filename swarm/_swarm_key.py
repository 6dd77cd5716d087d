"""The pre-shared key of a private swarm, and the file that holds it.

A private swarm is a set of peers that share one secret: every connection
handshake (``_handshake``) and every DHT datagram (``dht._messages``) proves
knowledge of it, and peers without it get no answer. The key file holds one
line, ``swarm-key-v1 <64 hex digits>`` (32 random bytes). It is created by
``swarm keygen --swarm-key FILE`` with mode 0600 and, like the identity file,
refused if other users can read or write it. Copy it to every machine of the
swarm over a channel you trust (scp, a secrets manager).
"""

from __future__ import annotations

import os
from pathlib import Path

from ._errors import ConfigError
from ._secret_file import create_secret_file, read_secret_file

SWARM_KEY_SIZE = 32
_HEADER = "swarm-key-v1"


def create_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """Write a new random key to ``path`` (mode 0600) and return it.

    Raises ``ConfigError`` if ``path`` exists: overwriting a swarm's key would
    lock this machine out of its swarm.
    """
    path = Path(path)
    key = os.urandom(SWARM_KEY_SIZE)
    if not create_secret_file(path, f"{_HEADER} {key.hex()}\n".encode()):
        raise ConfigError(f"swarm key file {path} exists already; pass another path")
    return key


def load_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """The key stored at ``path``.

    Raises ``ConfigError`` if the file is missing (the message says how to
    create one), is accessible by other users, or does not hold a key.
    """
    path = Path(path)
    try:
        data = read_secret_file(path, "swarm key file")
    except FileNotFoundError:
        raise ConfigError(
            f"swarm key file {path} does not exist; "
            f"create one with: swarm keygen --swarm-key {path}"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"swarm key file {path} is a directory") from None
    fields = data.decode("ascii", errors="replace").split()
    if len(fields) != 2 or fields[0] != _HEADER:
        raise ConfigError(f"swarm key file {path} is not a swarm key (made by swarm keygen)")
    try:
        key = bytes.fromhex(fields[1])
    except ValueError:
        raise ConfigError(f"swarm key file {path} holds a key that is not hex") from None
    if len(key) != SWARM_KEY_SIZE:
        raise ConfigError(f"swarm key file {path} holds {len(key)} bytes, not {SWARM_KEY_SIZE}")
    return key
