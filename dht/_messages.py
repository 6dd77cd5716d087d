"""The DHT datagram envelope. Pure code: bytes in, typed messages out.

Every datagram is one msgpack list::

    [version, kind, msg_id, sender_public_key, body, signature]

``body`` is the msgpack encoding of ``[method, args]`` for a request and of the
result for a response. The signature covers a domain string, the kind, the
message id and the body bytes, so:

- the sender's node id (``PeerID.from_public_key``) is proven on every
  datagram: a node cannot claim another node's id or position in the key space;
- a response signs the requester's fresh random ``msg_id``, so an old response
  cannot be replayed as the answer to a new request.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from swarm._errors import ProtocolError
from swarm._identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature
from swarm._wire import expect_bytes, expect_int, expect_list, pack, unpack

VERSION = 1
MSG_ID_SIZE = 20
#: Largest datagram we send or accept: under the 65,507-byte UDP payload limit.
MAX_DATAGRAM_SIZE = 65_000
_DOMAIN = b"swarm.dht.datagram.v1\x00"


class Kind(enum.IntEnum):
    REQUEST = 0
    RESPONSE = 1


@dataclass(frozen=True)
class Datagram:
    kind: Kind
    msg_id: bytes
    sender: PeerID
    body: Any


def new_msg_id() -> bytes:
    return os.urandom(MSG_ID_SIZE)


def _signed_part(kind: Kind, msg_id: bytes, body: bytes) -> bytes:
    return _DOMAIN + bytes([kind]) + msg_id + body


def encode(identity: Identity, kind: Kind, msg_id: bytes, body: Any) -> bytes:
    """Sign and encode one datagram. Raises ``ValueError`` if it would be too large."""
    body_bytes = pack(body, max_size=MAX_DATAGRAM_SIZE)
    signature = identity.sign(_signed_part(kind, msg_id, body_bytes))
    return pack(
        [VERSION, int(kind), msg_id, identity.public_key, body_bytes, signature],
        max_size=MAX_DATAGRAM_SIZE,
    )


def decode(data: bytes) -> Datagram:
    """Decode and verify one datagram from the network.

    Raises ``ProtocolError`` if it is malformed, oversized, of another version,
    or its signature does not verify.
    """
    outer = expect_list(unpack(data, max_size=MAX_DATAGRAM_SIZE), 6, "datagram")
    version, kind, msg_id, public_key, body_bytes, signature = outer
    if expect_int(version, "datagram version") != VERSION:
        raise ProtocolError(f"datagram version {version} is not {VERSION}")
    kind = Kind(expect_int(kind, "datagram kind", lo=0, hi=1))
    msg_id = expect_bytes(msg_id, "message id", size=MSG_ID_SIZE)
    public_key = expect_bytes(public_key, "sender public key", size=PUBLIC_KEY_SIZE)
    body_bytes = expect_bytes(body_bytes, "datagram body")
    signature = expect_bytes(signature, "datagram signature", size=SIGNATURE_SIZE)
    if not verify_signature(public_key, signature, _signed_part(kind, msg_id, body_bytes)):
        raise ProtocolError("datagram signature does not verify")
    body = unpack(body_bytes, max_size=MAX_DATAGRAM_SIZE)
    return Datagram(kind, msg_id, PeerID.from_public_key(public_key), body)
