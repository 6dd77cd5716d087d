"""``SessionKeys``: per-pair MAC keys that spare most DHT datagrams their Ed25519.

Why: every DHT datagram used to carry an Ed25519 signature, and a node spent
more than half its CPU signing and verifying them (``benchmarks/scale.py``
under py-spy at 128 peers: 40% verifying, 13% signing; a signature costs
about 30 us to make and 86 us to check, a keyed BLAKE2b about 1 us). A run of
a thousand peers in one process was CPU bound on it.

How: each node holds an X25519 key pair for the life of its process and
offers the public half in every datagram it signs (``_messages``: the
signature covers it, so the offer is bound to the sender's Ed25519 identity).
Two nodes that saw each other's offers share ``X25519(a, B)``; the MAC key of
the pair is BLAKE2b over that secret and both nodes' Ed25519 and X25519
public keys (``_derive``), computed once per pair, when first needed. A
datagram authenticated with it carries a 16-byte MAC in place of the
signature; the MAC covers the sender's public key, so a datagram cannot be
turned back on its sender as if its peer had sent it.

When a node MACs rather than signs (``mac_key``): only towards a peer that
holds its current offer, as far as it knows (*confirmed*):

- the peer answered a request that this node signed (it verified that
  request, offer included, before answering), or
- the peer's last datagram carried a valid MAC (it holds the shared key).

A peer that offers a new key (it restarted) is unconfirmed until then. The
answer to a signed request is signed, with our offer: its sender may not
hold our offer (it is new, restarted, or forgot us), and after that answer
it does. A request that gets no answer forgets the peer's session
(``forget``): a peer that lost ours drops our MACs, and the next request,
signed, sets things right. The cost of a lost session is one request's
timeout, which look-ups hedge around.

What it does not weaken: every datagram is still authenticated by its
sender's identity (a signature, or a MAC under a key only the two nodes
derive, bound to both identities by their signatures), and records keep their
own Ed25519 signatures, which storing nodes and readers verify as before.
A MAC'd request can be replayed from another address like a signed one could.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from swarm._identity import PeerID

#: Size of an X25519 public key, as offered in a signed datagram.
OFFER_SIZE = 32
#: Size of a datagram's MAC.
MAC_SIZE = 16
_KEY_PERSON = b"swarm.dht.pair"
_MAC_PERSON = b"swarm.dht.mac"


@dataclass
class _Session:
    """What this node knows of one peer: its Ed25519 public key and X25519
    offer, the MAC key (derived when first needed) and whether the peer is
    known to hold this node's offer."""

    public_key: bytes
    offer: bytes
    key: bytes | None = None
    confirmed: bool = False


def datagram_mac(key: bytes, message: bytes) -> bytes:
    """The MAC of ``message`` (``_messages``' authenticated part) under a pair's key."""
    return hashlib.blake2b(message, key=key, digest_size=MAC_SIZE, person=_MAC_PERSON).digest()


def mac_matches(key: bytes, message: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(datagram_mac(key, message), mac)


class SessionKeys:
    """This node's X25519 offer and the sessions of the last ``capacity``
    peers it heard from (least recently used forgotten first). Not
    thread-safe: one protocol's loop uses it. Raises ``ValueError`` for a
    capacity below 1."""

    def __init__(self, public_key: bytes, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._public_key = public_key
        self._own_id = PeerID.from_public_key(public_key)
        self._private = X25519PrivateKey.generate()
        #: this node's X25519 public key, offered in every datagram it signs
        self.offer = self._private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def offered(self, sender: PeerID, public_key: bytes, offer: bytes) -> None:
        """A signed datagram from ``sender`` (its signature verified) offered
        ``offer`` (empty: none, which ends the session). A new offer replaces
        the old session, unconfirmed (see the module docstring)."""
        if sender == self._own_id:
            return  # never a session with ourselves: our own datagrams, reflected
        if len(offer) != OFFER_SIZE:
            self._sessions.pop(bytes(sender), None)
            return
        session = self._sessions.get(bytes(sender))
        if session is None or session.offer != offer or session.public_key != public_key:
            session = _Session(public_key, offer)
            self._sessions[bytes(sender)] = session
            if len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(bytes(sender))

    def confirm(self, peer: bytes) -> None:
        """``peer`` holds this node's offer: MACs from now on, if we hold its."""
        session = self._sessions.get(bytes(peer))
        if session is not None:
            session.confirmed = True
            self._sessions.move_to_end(bytes(peer))

    def forget(self, peer: bytes) -> None:
        """Sign to ``peer`` again (it did not answer: it may have lost our session)."""
        self._sessions.pop(bytes(peer), None)

    def mac_key(self, peer: bytes | None) -> bytes | None:
        """The key to MAC a datagram to ``peer`` with, or None to sign it."""
        if peer is None:
            return None
        session = self._sessions.get(bytes(peer))
        if session is None or not session.confirmed:
            return None
        return self._key(session)

    def verifying_key(self, sender: PeerID, public_key: bytes) -> bytes | None:
        """The key a MAC'd datagram from ``sender`` (claiming ``public_key``)
        must verify under; None if there is no session with it."""
        session = self._sessions.get(bytes(sender))
        if session is None or session.public_key != public_key:
            return None
        return self._key(session)

    def _key(self, session: _Session) -> bytes | None:
        if session.key is None and session.offer:
            try:
                session.key = _derive(self._private, self._public_key, self.offer, session)
            except ValueError:  # not a curve point, or a low-order one: no session
                session.offer = b""
        return session.key


def _derive(private: X25519PrivateKey, public_key: bytes, offer: bytes, peer: _Session) -> bytes:
    """The pair's MAC key: the same on both sides, bound to both identities
    and both offers. Raises ``ValueError`` for an offer that is not a usable
    X25519 public key (``cryptography`` refuses an all-zero shared secret)."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer.offer))
    ends = sorted([(public_key, offer), (peer.public_key, peer.offer)])
    material = shared + b"".join(k + o for k, o in ends)
    return hashlib.blake2b(material, digest_size=32, person=_KEY_PERSON).digest()
