"""The DHT datagram envelope. Pure code: bytes in, typed messages out.

Every datagram is one msgpack list::

    [version, kind, msg_id, sender_public_key, body, auth, swarm_proof, offer]

``body`` is the msgpack encoding of ``[method, args]`` for a request and of the
result for a response. ``auth`` authenticates a domain string, the kind, the
message id, ``offer`` and the body bytes (the *authenticated part*), in one
of two ways:

- an Ed25519 signature (64 bytes) by the sender's key; ``offer`` is then the
  sender's X25519 public key (``_sessions``), or empty when it offers none;
- a 16-byte MAC under the key the sender shares with the receiver
  (``_sessions``: derived from both nodes' offers, which each one signed),
  computed over the authenticated part and the sender's public key; ``offer``
  is then empty. Nodes MAC once each knows the other holds its offer, so
  most datagrams cost a keyed hash instead of an Ed25519 signature and
  verification (more than half a busy node's CPU).

Either way:

- the sender's node id (``PeerID.from_public_key``) is proven on every
  datagram: a node cannot claim another node's id or position in the key space;
- a response authenticates the requester's fresh random ``msg_id``, so an old
  response cannot be replayed as the answer to a new request.

Every datagram fits in one Ethernet frame without IP fragmentation
(``MAX_DATAGRAM_SIZE``, 1,400 bytes of UDP payload): a 65 kB datagram is 45
IP fragments, and on a real link losing any one of them loses all of it.
``encode`` is the one place that enforces it (``DatagramTooLargeError``); what
could outgrow it (a key's records, a list of contacts) is cut into pages by
the code that builds the body, which budgets with ``MAX_BODY_SIZE``, and the
reader is told that more remains (``_protocol``).

In a private swarm, ``swarm_proof`` is ``HMAC-SHA256(dht_key, authenticated
part || sender_public_key || auth)`` with ``dht_key`` derived from the swarm
key (``derive_proof_key``); in a public swarm it is empty. A node checks the
proof (cheap) before the signature or MAC: a datagram from outside its swarm,
or from a private swarm when it is public, is dropped without a reply.

Version 2 added the offer and the MAC; a node drops datagrams of version 1.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarm._errors import ProtocolError, SwarmError
from swarm._identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, Identity, PeerID, verify_signature
from swarm._wire import expect_bytes, expect_int, expect_list, pack, unpack

from ._sessions import MAC_SIZE, OFFER_SIZE, datagram_mac, mac_matches

VERSION = 2
MSG_ID_SIZE = 20
#: Largest datagram we send or accept: an Ethernet frame (1,500 bytes) less the
#: IPv6 and UDP headers (48) and room for tunnels and PPPoE on the way.
MAX_DATAGRAM_SIZE = 1_400
#: Most bytes the envelope adds to a body: the list header, version, kind,
#: message id, public key, the body's bin16 header, signature, swarm proof and
#: offer (a signed datagram; a MAC'd one is 80 bytes smaller).
ENVELOPE_OVERHEAD = (
    1 + 1 + 1 + (2 + MSG_ID_SIZE) + (2 + 32) + 3 + (2 + 64) + (2 + 32) + (2 + OFFER_SIZE)
)
#: Largest msgpack-encoded body that ``encode`` accepts.
MAX_BODY_SIZE = MAX_DATAGRAM_SIZE - ENVELOPE_OVERHEAD
_DOMAIN = b"swarm.dht.datagram.v2\x00"
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
    #: the sender's Ed25519 public key
    public_key: bytes = b""
    #: the sender's X25519 offer (``_sessions``), signed with the datagram;
    #: empty when it offered none or the datagram was MAC'd
    offer: bytes = b""
    #: authenticated by a MAC under the pair's key, not by a signature
    mac: bool = False


#: ``(sender, sender_public_key) -> the pair's MAC key``, or None without a session
MacKeys = Callable[[PeerID, bytes], bytes | None]


#: the peer id of a datagram's sender: a SHA-256 per datagram otherwise, from
#: the same few hundred peers again and again
_peer_id = functools.lru_cache(maxsize=4096)(PeerID.from_public_key)


def new_msg_id() -> bytes:
    return os.urandom(MSG_ID_SIZE)


def _signed_part(kind: Kind, msg_id: bytes, offer: bytes, body: bytes) -> bytes:
    return _DOMAIN + bytes([kind]) + msg_id + bytes([len(offer)]) + offer + body


def derive_proof_key(swarm_key: bytes) -> bytes:
    """The DHT's own key, derived from the swarm key (never used raw, so the
    DHT and the connection handshake never share a MAC key)."""
    return hmac.new(swarm_key, _PROOF_KEY_LABEL, hashlib.sha256).digest()


def _proof(proof_key: bytes, signed: bytes, public_key: bytes, signature: bytes) -> bytes:
    return hmac.new(proof_key, signed + public_key + signature, hashlib.sha256).digest()


def encode(
    identity: Identity,
    kind: Kind,
    msg_id: bytes,
    body: Any,
    *,
    proof_key: bytes | None = None,
    offer: bytes = b"",
    mac_key: bytes | None = None,
) -> bytes:
    """Authenticate and encode one datagram: MAC'd under ``mac_key`` (the key
    this node shares with the receiver, ``_sessions``) when given, else signed
    with ``offer`` (this node's X25519 public key, or empty for none). With
    ``proof_key`` (a private swarm), prove the swarm key too.

    Raises ``DatagramTooLargeError`` (nothing is signed) if it would exceed
    ``MAX_DATAGRAM_SIZE``, ``ValueError`` if ``body`` is not msgpack-able or
    ``offer`` is neither empty nor an X25519 key's size."""
    if offer and len(offer) != OFFER_SIZE:
        raise ValueError(f"an offer is {OFFER_SIZE} bytes, got {len(offer)}")
    body_bytes = pack(body, max_size=2**32)
    if len(body_bytes) > MAX_BODY_SIZE:
        raise DatagramTooLargeError(
            f"a datagram body of {len(body_bytes)} bytes exceeds {MAX_BODY_SIZE} "
            f"(datagrams are at most {MAX_DATAGRAM_SIZE} bytes)"
        )
    if mac_key is not None:
        offer = b""
    signed = _signed_part(kind, msg_id, offer, body_bytes)
    if mac_key is not None:
        auth = datagram_mac(mac_key, signed + identity.public_key)
    else:
        auth = identity.sign(signed)
    proof = b"" if proof_key is None else _proof(proof_key, signed, identity.public_key, auth)
    data = pack([VERSION, int(kind), msg_id, identity.public_key, body_bytes, auth, proof, offer])
    if len(data) > MAX_DATAGRAM_SIZE:  # cannot happen: ENVELOPE_OVERHEAD is the most it adds
        raise DatagramTooLargeError(f"a datagram of {len(data)} bytes exceeds {MAX_DATAGRAM_SIZE}")
    return data


def decode(
    data: bytes, *, proof_key: bytes | None = None, mac_keys: MacKeys | None = None
) -> Datagram:
    """Decode and authenticate one datagram from the network: its signature,
    or its MAC under the key ``mac_keys`` gives for its sender.

    Raises ``ProtocolError`` if it is malformed, oversized, of another version,
    does not prove ``proof_key`` (or proves a key when ``proof_key`` is None),
    its signature does not verify, or it is MAC'd and ``mac_keys`` has no key
    for its sender or the MAC does not match.
    """
    outer = expect_list(unpack(data, max_size=MAX_DATAGRAM_SIZE), 8, "datagram")
    version, kind, msg_id, public_key, body_bytes, auth, proof, offer = outer
    if expect_int(version, "datagram version") != VERSION:
        raise ProtocolError(f"datagram version {version} is not {VERSION}")
    kind = Kind(expect_int(kind, "datagram kind", lo=0, hi=1))
    msg_id = expect_bytes(msg_id, "message id", size=MSG_ID_SIZE)
    public_key = expect_bytes(public_key, "sender public key", size=PUBLIC_KEY_SIZE)
    body_bytes = expect_bytes(body_bytes, "datagram body")
    auth = expect_bytes(auth, "datagram signature or MAC", max_size=SIGNATURE_SIZE)
    proof = expect_bytes(proof, "swarm key proof", max_size=_PROOF_SIZE)
    offer = expect_bytes(offer, "session offer", max_size=OFFER_SIZE)
    if len(auth) not in (SIGNATURE_SIZE, MAC_SIZE):
        raise ProtocolError(f"datagram auth is {len(auth)} bytes, not a signature or a MAC")
    mac = len(auth) == MAC_SIZE
    if offer and (mac or len(offer) != OFFER_SIZE):
        raise ProtocolError("a session offer is 32 bytes, in a signed datagram only")
    signed = _signed_part(kind, msg_id, offer, body_bytes)
    if proof_key is None:
        if proof:
            raise ProtocolError("datagram from a private swarm (it proves a swarm key)")
    elif not hmac.compare_digest(proof, _proof(proof_key, signed, public_key, auth)):
        raise ProtocolError("datagram does not prove this swarm's key")
    sender = _peer_id(public_key)
    if mac:
        key = None if mac_keys is None else mac_keys(sender, public_key)
        if key is None:
            raise ProtocolError("MAC'd datagram from a node without a session")
        if not mac_matches(key, signed + public_key, auth):
            raise ProtocolError("datagram MAC does not match")
    elif not verify_signature(public_key, auth, signed):
        raise ProtocolError("datagram signature does not verify")
    body = unpack(body_bytes, max_size=MAX_DATAGRAM_SIZE)
    return Datagram(kind, msg_id, sender, body, public_key, offer, mac)
