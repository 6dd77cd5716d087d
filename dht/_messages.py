"""The DHT datagram envelope. Pure code: bytes in, typed messages out.

Every datagram is one msgpack list::

    [version, kind, msg_id, sender_public_key, body, signature, swarm_proof]

``body`` is the msgpack encoding of ``[method, args]`` for a request and of the
result for a response. The signature covers a domain string, the kind, the
message id and the body bytes, so:

- the sender's node id (``PeerID.from_public_key``) is proven on every
  datagram: a node cannot claim another node's id or position in the key space;
- a response signs the requester's fresh random ``msg_id``, so an old response
  cannot be replayed as the answer to a new request.

Every datagram fits in one Ethernet frame without IP fragmentation
(``MAX_DATAGRAM_SIZE``, 1,400 bytes of UDP payload): a 65 kB datagram is 45
IP fragments, and on a real link losing any one of them loses all of it.
``encode`` is the one place that enforces it (``DatagramTooLargeError``); what
could outgrow it (a key's records, a list of contacts) is cut into pages by
the code that builds the body, which budgets with ``MAX_BODY_SIZE``, and the
reader is told that more remains (``_protocol``).

In a private swarm, ``swarm_proof`` is ``HMAC-SHA256(dht_key, signed part ||
sender_public_key || signature)`` with ``dht_key`` derived from the swarm key
(``derive_proof_key``); in a public swarm it is empty. A node checks the proof
(cheap) before the signature: a datagram from outside its swarm, or from a
private swarm when it is public, is dropped without a reply.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

from swarm._errors import ProtocolError, SwarmError
from swarm._identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature
from swarm._wire import expect_bytes, expect_int, expect_list, pack, unpack

VERSION = 1
MSG_ID_SIZE = 20
#: Largest datagram we send or accept: an Ethernet frame (1,500 bytes) less the
#: IPv6 and UDP headers (48) and room for tunnels and PPPoE on the way.
MAX_DATAGRAM_SIZE = 1_400
#: Most bytes the envelope adds to a body: the list header, version, kind,
#: message id, public key, the body's bin16 header, signature and swarm proof.
ENVELOPE_OVERHEAD = 1 + 1 + 1 + (2 + MSG_ID_SIZE) + (2 + 32) + 3 + (2 + 64) + (2 + 32)
#: Largest msgpack-encoded body that ``encode`` accepts.
MAX_BODY_SIZE = MAX_DATAGRAM_SIZE - ENVELOPE_OVERHEAD
_DOMAIN = b"swarm.dht.datagram.v1\x00"
_PROOF_KEY_LABEL = b"swarm.dht.swarm-key-proof.v1"
_PROOF_SIZE = 32


class DatagramTooLargeError(SwarmError, ValueError):
    """A datagram to send would exceed ``MAX_DATAGRAM_SIZE``: the local side
    built a body that does not fit (a bug, or a record over its limits)."""


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


def derive_proof_key(swarm_key: bytes) -> bytes:
    """The DHT's own key, derived from the swarm key (never used raw, so the
    DHT and the connection handshake never share a MAC key)."""
    return hmac.new(swarm_key, _PROOF_KEY_LABEL, hashlib.sha256).digest()


def _proof(proof_key: bytes, signed: bytes, public_key: bytes, signature: bytes) -> bytes:
    return hmac.new(proof_key, signed + public_key + signature, hashlib.sha256).digest()


def encode(
    identity: Identity, kind: Kind, msg_id: bytes, body: Any, *, proof_key: bytes | None = None
) -> bytes:
    """Sign and encode one datagram; with ``proof_key`` (a private swarm), prove
    the swarm key too. Raises ``DatagramTooLargeError`` (nothing is signed) if
    it would exceed ``MAX_DATAGRAM_SIZE``, and ``ValueError`` if ``body`` is
    not msgpack-able."""
    body_bytes = pack(body, max_size=2**32)
    if len(body_bytes) > MAX_BODY_SIZE:
        raise DatagramTooLargeError(
            f"a datagram body of {len(body_bytes)} bytes exceeds {MAX_BODY_SIZE} "
            f"(datagrams are at most {MAX_DATAGRAM_SIZE} bytes)"
        )
    signed = _signed_part(kind, msg_id, body_bytes)
    signature = identity.sign(signed)
    proof = b"" if proof_key is None else _proof(proof_key, signed, identity.public_key, signature)
    data = pack([VERSION, int(kind), msg_id, identity.public_key, body_bytes, signature, proof])
    if len(data) > MAX_DATAGRAM_SIZE:  # cannot happen: ENVELOPE_OVERHEAD is the most it adds
        raise DatagramTooLargeError(f"a datagram of {len(data)} bytes exceeds {MAX_DATAGRAM_SIZE}")
    return data


def decode(data: bytes, *, proof_key: bytes | None = None) -> Datagram:
    """Decode and verify one datagram from the network.

    Raises ``ProtocolError`` if it is malformed, oversized, of another version,
    does not prove ``proof_key`` (or proves a key when ``proof_key`` is None),
    or its signature does not verify.
    """
    outer = expect_list(unpack(data, max_size=MAX_DATAGRAM_SIZE), 7, "datagram")
    version, kind, msg_id, public_key, body_bytes, signature, proof = outer
    if expect_int(version, "datagram version") != VERSION:
        raise ProtocolError(f"datagram version {version} is not {VERSION}")
    kind = Kind(expect_int(kind, "datagram kind", lo=0, hi=1))
    msg_id = expect_bytes(msg_id, "message id", size=MSG_ID_SIZE)
    public_key = expect_bytes(public_key, "sender public key", size=PUBLIC_KEY_SIZE)
    body_bytes = expect_bytes(body_bytes, "datagram body")
    signature = expect_bytes(signature, "datagram signature", size=SIGNATURE_SIZE)
    proof = expect_bytes(proof, "swarm key proof", max_size=_PROOF_SIZE)
    signed = _signed_part(kind, msg_id, body_bytes)
    if proof_key is None:
        if proof:
            raise ProtocolError("datagram from a private swarm (it proves a swarm key)")
    elif not hmac.compare_digest(proof, _proof(proof_key, signed, public_key, signature)):
        raise ProtocolError("datagram does not prove this swarm's key")
    if not verify_signature(public_key, signature, signed):
        raise ProtocolError("datagram signature does not verify")
    body = unpack(body_bytes, max_size=MAX_DATAGRAM_SIZE)
    return Datagram(kind, msg_id, PeerID.from_public_key(public_key), body)
