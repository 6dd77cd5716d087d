"""Peer identity: an Ed25519 key pair and the peer id derived from it.

The peer id is the first 20 bytes of SHA-256 over the raw public key. It is
also the node id in the Kademlia key space (160 bits, as in the paper), so a
node can only sit where a key it owns hashes to.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from ._errors import ConfigError, ProtocolError
from ._secret_file import create_secret_file, read_secret_file

PEER_ID_SIZE = 20
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
_PRIVATE_KEY_SIZE = 32


class PeerID(bytes):
    """A 20-byte peer id. ``str()`` gives its hex form, which users see in logs."""

    def __new__(cls, value: bytes) -> PeerID:
        if len(value) != PEER_ID_SIZE:
            raise ValueError(f"a peer id is {PEER_ID_SIZE} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        if len(public_key) != PUBLIC_KEY_SIZE:
            raise ProtocolError(f"an Ed25519 public key is {PUBLIC_KEY_SIZE} bytes")
        return cls(hashlib.sha256(public_key).digest()[:PEER_ID_SIZE])

    @classmethod
    def from_hex(cls, text: str) -> PeerID:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as e:
            raise ValueError(f"not a peer id: {text!r}") from e

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"PeerID({self.hex()[:12]}…)"

    def short(self) -> str:
        return self.hex()[:8]


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    """The parsed key, cached: a DHT node verifies datagrams from the same few
    hundred peers again and again, and parsing costs a few microseconds. Raises
    ``ValueError`` (not cached) for bytes that are not a valid key."""
    return Ed25519PublicKey.from_public_bytes(raw)


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message``.

    Never raises on malformed input: a bad key or signature simply fails.
    """
    if len(public_key) != PUBLIC_KEY_SIZE or len(signature) != SIGNATURE_SIZE:
        return False
    try:
        _public_key(bytes(public_key)).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 private key with its public key and peer id."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A deterministic identity from 32 bytes (tests and reproducible runs)."""
        if len(seed) != _PRIVATE_KEY_SIZE:
            raise ValueError(f"an Ed25519 seed is {_PRIVATE_KEY_SIZE} bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the identity stored at ``path``, or create one there.

        A new file is created with mode 0600 (atomically: it never exists with
        wider permissions or half-written). An existing file that other users can
        read or write is refused with ``ConfigError``, as is one that is not a
        key written by this function.
        """
        path = Path(path)
        try:
            return cls._load(path)
        except FileNotFoundError:
            pass
        identity = cls.generate()
        identity._create(path)
        return identity

    @classmethod
    def _load(cls, path: Path) -> Identity:
        data = read_secret_file(path, "identity file")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except ValueError as e:
            raise ConfigError(f"identity file {path} does not hold a private key: {e}") from e
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"identity file {path} holds a key that is not Ed25519")
        return cls(key)

    def _create(self, path: Path) -> None:
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # If another process created the file meanwhile, both processes must
        # end up with the same identity: the first one.
        if not create_secret_file(path, pem):
            loaded = Identity._load(path)
            self._private, self.public_key, self.peer_id = (
                loaded._private,
                loaded.public_key,
                loaded.peer_id,
            )

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"Identity({self.peer_id!r})"
