"""DHT records: layout, signatures, validation and merge rules. Pure code.

A record is one value under one (key, sub-key) with an absolute expiration
time. A key without a sub-key holds a plain value; a key with sub-keys holds a
dictionary that many peers write independently. Storage keeps one record per
(key, sub-key) and merges versions with ``newer``: the later expiration wins,
ties broken by the value bytes so every node converges on the same version.

A key or sub-key that contains an owner marker (``owner_marker(peer_id)``,
i.e. ``[owner:<40 hex digits>]``) can only be written by that owner: the record
carries the owner's Ed25519 public key and a signature over (key, sub-key,
value, expiration). Since the expiration is signed, a replay with a new
expiration fails verification. Storing nodes run ``validate`` before keeping a
record and readers run it again before returning one.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from swarm._errors import ProtocolError, RecordRejectedError, RejectReason
from swarm._identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    Identity,
    PeerID,
    verify_signature,
)
from swarm._wire import expect_bytes, expect_float, expect_list, pack, unpack

from ._messages import MAX_BODY_SIZE

_SIGNING_DOMAIN = b"swarm.dht.record.v1\x00"
_OWNER_PATTERN = re.compile(rb"\[owner:([0-9a-f]{40})\]")

#: Most bytes a record's wire list adds to its key, sub-key and value: the
#: list header, three bin16 headers, the float64 expiration, the public key
#: and the signature with their bin8 headers.
_RECORD_OVERHEAD = 1 + 3 * 3 + 9 + (2 + PUBLIC_KEY_SIZE) + (2 + SIGNATURE_SIZE)
#: Largest encoded record: what one store request (``["store", [record], flag]``)
#: carries in one datagram.
MAX_RECORD_SIZE = MAX_BODY_SIZE - len(pack(["store", [b""], 1]))

#: The type of a sub-key as users pass it. Sub-keys travel msgpack-encoded.
Subkey = str | bytes | int


@dataclass(frozen=True)
class RecordLimits:
    """Size and lifetime limits that every storing node enforces.

    A record at all the limits, with its signature, must fit in one store
    request, which is one datagram of at most 1,400 bytes (``_messages``):
    ``RecordLimits`` raises ``ValueError`` for sizes that add up to more.
    """

    max_key_size: int = 256
    max_subkey_size: int = 256
    #: Largest msgpack-encoded value. Larger data belongs on a peer connection.
    max_value_size: int = 512
    #: Expirations further ahead than this are refused (a record cannot pin
    #: storage forever).
    max_ttl: float = 24 * 3600.0
    #: Tolerated clock difference between writer and storing node.
    max_clock_skew: float = 60.0
    #: Largest number of sub-keys one key may hold on one storing node; beyond
    #: it the soonest-expiring sub-keys are evicted.
    max_subkeys_per_key: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_key_size", "max_subkey_size", "max_value_size", "max_subkeys_per_key"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RecordLimits.{name} must be positive")
        if self.max_ttl <= 0 or self.max_clock_skew < 0:
            raise ValueError("RecordLimits.max_ttl must be positive and max_clock_skew >= 0")
        largest = self.max_key_size + self.max_subkey_size + self.max_value_size + _RECORD_OVERHEAD
        if largest > MAX_RECORD_SIZE:
            raise ValueError(
                f"RecordLimits: a record of max_key_size + max_subkey_size + max_value_size "
                f"would encode to {largest} bytes, more than the {MAX_RECORD_SIZE} that fit "
                "in one datagram: lower them"
            )


def owner_marker(peer_id: PeerID) -> str:
    """The marker that makes a key or sub-key writable only by ``peer_id``.

    Put it anywhere in a key or sub-key, e.g. ``f"{run_id}.progress"`` with
    sub-key ``owner_marker(peer.peer_id)``.
    """
    return f"[owner:{peer_id.hex()}]"


def encode_key(key: str | bytes) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    raise TypeError(f"a DHT key is str or bytes, not {type(key).__name__}")


def encode_subkey(subkey: Subkey) -> bytes:
    if isinstance(subkey, bool) or not isinstance(subkey, str | bytes | int):
        raise TypeError(f"a DHT sub-key is str, bytes or int, not {type(subkey).__name__}")
    return pack(subkey)


def decode_subkey(raw: bytes) -> Subkey:
    value = unpack(raw, max_size=len(raw))
    if isinstance(value, bool) or not isinstance(value, str | bytes | int):
        raise ProtocolError("a sub-key decodes to a str, bytes or int")
    return value


def key_id(key: bytes) -> bytes:
    """The 160-bit position of ``key`` in the Kademlia key space."""
    return hashlib.sha1(key).digest()


@dataclass(frozen=True)
class Record:
    """One stored value. ``subkey`` is the msgpack-encoded sub-key or None."""

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration: float
    public_key: bytes | None = None
    signature: bytes | None = None

    @property
    def key_id(self) -> bytes:
        return key_id(self.key)

    def owner(self) -> PeerID | None:
        """The owner named in the key or sub-key, if any.

        Raises ``RecordRejectedError(FORGED)`` if they name different owners.
        """
        found = set(_OWNER_PATTERN.findall(self.key))
        if self.subkey is not None:
            found.update(_OWNER_PATTERN.findall(self.subkey))
        if not found:
            return None
        if len(found) > 1:
            raise RecordRejectedError(RejectReason.FORGED, "key and sub-key name different owners")
        return PeerID(bytes.fromhex(found.pop().decode()))

    def signing_payload(self) -> bytes:
        return _SIGNING_DOMAIN + pack([self.key, self.subkey, self.value, self.expiration])

    def to_wire(self) -> list[Any]:
        return [self.key, self.subkey, self.value, self.expiration, self.public_key, self.signature]

    @classmethod
    def from_wire(cls, obj: Any, limits: RecordLimits) -> Record:
        """Decode the wire layout; raises ``ProtocolError`` if it is malformed.

        Only the layout and sizes are checked here; ``validate`` checks the rest.
        """
        key, subkey, value, expiration, public_key, signature = expect_list(obj, 6, "record")
        key = expect_bytes(key, "record key", max_size=limits.max_key_size)
        if subkey is not None:
            subkey = expect_bytes(subkey, "record sub-key", max_size=limits.max_subkey_size)
        value = expect_bytes(value, "record value", max_size=limits.max_value_size)
        expiration = expect_float(expiration, "record expiration")
        if public_key is not None:
            public_key = expect_bytes(public_key, "record public key", size=PUBLIC_KEY_SIZE)
        if signature is not None:
            signature = expect_bytes(signature, "record signature", size=SIGNATURE_SIZE)
        return cls(key, subkey, value, expiration, public_key, signature)

    def decoded_value(self) -> Any:
        return unpack(self.value, max_size=len(self.value))

    def sort_key(self) -> tuple[float, bytes]:
        return (self.expiration, self.value)


def make_record(
    key: str | bytes,
    value: Any,
    expiration: float,
    *,
    subkey: Subkey | None = None,
    signer: Identity | None = None,
    limits: RecordLimits,
) -> Record:
    """Build a record, signing it when its key or sub-key names ``signer``.

    Raises ``RecordRejectedError`` with ``OVERSIZED`` when a part is too large
    and ``NOT_OWNER`` when the record names an owner other than ``signer``.
    """
    raw_key = encode_key(key)
    raw_subkey = None if subkey is None else encode_subkey(subkey)
    try:
        raw_value = pack(value, max_size=limits.max_value_size)
    except ValueError as e:
        if "limit" in str(e):
            raise RecordRejectedError(RejectReason.OVERSIZED, str(e)) from e
        raise
    if len(raw_key) > limits.max_key_size:
        raise RecordRejectedError(
            RejectReason.OVERSIZED, f"key is {len(raw_key)} bytes, limit {limits.max_key_size}"
        )
    if raw_subkey is not None and len(raw_subkey) > limits.max_subkey_size:
        raise RecordRejectedError(
            RejectReason.OVERSIZED,
            f"sub-key is {len(raw_subkey)} bytes, limit {limits.max_subkey_size}",
        )
    record = Record(raw_key, raw_subkey, raw_value, float(expiration))
    owner = record.owner()
    if owner is None:
        return record
    if signer is None or signer.peer_id != owner:
        raise RecordRejectedError(RejectReason.NOT_OWNER, f"the record names owner {owner}")
    signature = signer.sign(record.signing_payload())
    return Record(raw_key, raw_subkey, raw_value, float(expiration), signer.public_key, signature)


def validate(record: Record, now: float, limits: RecordLimits) -> None:
    """Raise ``RecordRejectedError`` unless ``record`` may be stored or served at ``now``."""
    if len(record.key) > limits.max_key_size or len(record.value) > limits.max_value_size:
        raise RecordRejectedError(RejectReason.OVERSIZED)
    if record.subkey is not None and len(record.subkey) > limits.max_subkey_size:
        raise RecordRejectedError(RejectReason.OVERSIZED)
    if not record.expiration > now:
        raise RecordRejectedError(RejectReason.EXPIRED)
    if record.expiration > now + limits.max_ttl + limits.max_clock_skew:
        raise RecordRejectedError(RejectReason.TOO_FAR_IN_FUTURE)
    try:
        if record.subkey is not None:
            decode_subkey(record.subkey)
        record.decoded_value()
    except ProtocolError as e:
        raise RecordRejectedError(RejectReason.MALFORMED, str(e)) from e
    owner = record.owner()
    if owner is None:
        if record.public_key is not None or record.signature is not None:
            raise RecordRejectedError(RejectReason.MALFORMED, "signature on an unowned record")
        return
    if record.public_key is None or record.signature is None:
        raise RecordRejectedError(RejectReason.FORGED, "owned record without a signature")
    if PeerID.from_public_key(record.public_key) != owner:
        raise RecordRejectedError(RejectReason.FORGED, "public key does not match the owner")
    if not SIGNATURES.verify(record.public_key, record.signature, record.signing_payload()):
        raise RecordRejectedError(RejectReason.FORGED, "bad signature")


class SignatureCache:
    """The last ``capacity`` (public key, signature, message) triples that
    verified, by digest (see the module docstring). Thread-safe: the peers of
    one process may each run their trio thread. Raises ``ValueError`` for a
    capacity below 1."""

    def __init__(self, capacity: int = 1 << 15) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        #: verifications answered from the cache, and run
        self.hits = 0
        self.misses = 0

    def verify(self, public_key: bytes, signature: bytes, message: bytes) -> bool:
        """``verify_signature``, answered from the cache when these exact bytes
        verified before."""
        digest = hashlib.blake2b(digest_size=32, person=b"swarm.sigcache")
        for part in (public_key, signature, message):
            digest.update(len(part).to_bytes(4, "big"))
            digest.update(part)
        key = digest.digest()
        with self._lock:
            if key in self._verified:
                self._verified.move_to_end(key)
                self.hits += 1
                return True
            self.misses += 1
        if not verify_signature(public_key, signature, message):
            return False
        with self._lock:
            self._verified[key] = None
            if len(self._verified) > self.capacity:
                self._verified.popitem(last=False)
        return True


#: the process's cache (``validate``): every node of a process shares it
SIGNATURES = SignatureCache()


def newer(candidate: Record, current: Record | None) -> bool:
    """True if ``candidate`` should replace ``current`` for the same (key, sub-key)."""
    return current is None or candidate.sort_key() > current.sort_key()


def merge(records: dict[bytes | None, Record], incoming: Record) -> bool:
    """Merge ``incoming`` into a key's records in place; True if it was kept."""
    if newer(incoming, records.get(incoming.subkey)):
        records[incoming.subkey] = incoming
        return True
    return False
