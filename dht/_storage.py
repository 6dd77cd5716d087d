"""Record storage of one DHT node: kademlia's ``IStorage`` for signed, expiring records.

Storage is indexed by the 160-bit key id (``sha1(key)``). Each entry holds one
record per sub-key (``None`` for a plain value), merged by ``records.merge``.
Expired records are dropped whenever an entry is touched and by ``cull``;
nothing expired is ever returned.

Only validated records enter: ``store`` runs ``records.validate`` first, so
everything this storage hands to the protocol (replies, pushes to new
neighbours, republishing) passes validation at the time it was stored.

Every stored record is charged to the ``Source`` that sent its current version
(the proven node id and the host address of the store request; records this
node stores itself are charged to no one). ``StorageQuota`` bounds what one
node id and one host may hold, and the policy never lets one sender push out
another's records:

- a store that would take a sender over its quota is refused (``OVER_QUOTA``),
  and a store when the whole storage is full is refused (``STORAGE_FULL``):
  nothing already stored is evicted to make room;
- when a key exceeds ``max_subkeys_per_key``, the evicted sub-key is the
  soonest-expiring one of the source holding the most sub-keys of that key, so
  flooding a key with sub-keys only evicts the flooder's own.

Replacing a record with a newer version moves its charge to the new sender
(records without an owner marker are writable by anyone; owned ones only by
their owner).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from kademlia.storage import IStorage

from swarm._clock import WallClock
from swarm._errors import ConfigError, RecordRejectedError, RejectReason

from ._records import Record, RecordLimits, newer, validate

_A = TypeVar("_A", bytes, str)


class Source(NamedTuple):
    """Who sent a record: the proven node id and the host (IP) it came from."""

    node_id: bytes
    host: str


@dataclass(frozen=True)
class StorageQuota:
    """How much of one node's storage one sender may hold.

    With the default ``RecordLimits`` a record is at most about 1.2 kB, so one
    node id can fill at most ``max_bytes_per_peer`` (2 MiB) and one host at
    most ``max_bytes_per_host`` (16 MiB) of a node's memory. An honest peer
    writes a few records per run; the per-peer count leaves room for a
    neighbour pushing, or republishing, the records of others that a node is
    responsible for (about ``k / N`` of all records in a swarm of ``N`` nodes).
    """

    #: most records one node id may hold on this node
    max_records_per_peer: int = 2_000
    #: most record bytes (key + sub-key + value + signature) one node id may hold
    max_bytes_per_peer: int = 2 * 2**20
    #: most records all node ids behind one host address may hold together:
    #: node ids are free to make, addresses are not
    max_records_per_host: int = 20_000
    max_bytes_per_host: int = 16 * 2**20

    def __post_init__(self) -> None:
        for name in (
            "max_records_per_peer",
            "max_bytes_per_peer",
            "max_records_per_host",
            "max_bytes_per_host",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"StorageQuota.{name} must be at least 1")
        if self.max_records_per_host < self.max_records_per_peer:
            raise ConfigError(
                "StorageQuota.max_records_per_host must be at least max_records_per_peer"
            )
        if self.max_bytes_per_host < self.max_bytes_per_peer:
            raise ConfigError("StorageQuota.max_bytes_per_host must be at least max_bytes_per_peer")


def record_size(record: Record) -> int:
    """Bytes charged for ``record``: its key, sub-key, value, key and signature."""
    return (
        len(record.key)
        + len(record.subkey or b"")
        + len(record.value)
        + len(record.public_key or b"")
        + len(record.signature or b"")
        + 8
    )


@dataclass
class _Entry:
    records: dict[bytes | None, Record] = field(default_factory=dict)
    #: who sent each record's current version (None: this node itself)
    sources: dict[bytes | None, Source | None] = field(default_factory=dict)
    #: monotonic time of the last accepted write, for republishing
    updated: float = field(default_factory=time.monotonic)
    #: no record expires before this: until then, touching the entry need
    #: not scan its records for expired ones (a key of hundreds of records is
    #: touched by every page a reader asks for). At most the soonest expiration.
    soonest: float = math.inf


def _node_id(source: Source | None) -> bytes | None:
    return None if source is None else source.node_id


def _add(table: dict[_A, list[int]], account: _A, sign: int, size: int) -> None:
    usage = table.setdefault(account, [0, 0])
    usage[0] += sign
    usage[1] += sign * size
    if usage[0] <= 0:
        del table[account]


class RecordStorage(IStorage):
    """Validated records by key id. Not thread-safe; lives on the DHT's event loop."""

    def __init__(
        self,
        clock: WallClock,
        limits: RecordLimits,
        max_records: int = 100_000,
        quota: StorageQuota | None = None,
    ) -> None:
        self._clock = clock
        self._limits = limits
        self._max_records = max_records
        self._quota = quota or StorageQuota()
        self._entries: dict[bytes, _Entry] = {}
        self._count = 0
        # (records, bytes) charged to each node id and each host
        self._by_peer: dict[bytes, list[int]] = {}
        self._by_host: dict[str, list[int]] = {}
        #: called with the key id of each record that becomes the stored
        #: version (``DHTNode.wait_for_store``)
        self.on_stored: Callable[[bytes], None] | None = None

    # -- our interface -------------------------------------------------------

    def store(self, record: Record, source: Source | None = None) -> bool:
        """Validate and merge ``record`` sent by ``source`` (None: this node).

        True if it is now the stored version. An older version than the stored
        one is not an error: it returns False. Raises ``RecordRejectedError`` if
        validation fails (nothing changes), ``OVER_QUOTA`` if ``source`` would
        exceed its ``StorageQuota`` and ``STORAGE_FULL`` if the node holds
        ``max_records`` already.
        """
        validate(record, self._clock(), self._limits)
        dkey = record.key_id
        entry = self._live_entry(dkey)
        if entry is not None and next(iter(entry.records.values())).key != record.key:
            # sha1 collision or a crafted key: never mix two keys in one entry
            raise RecordRejectedError(RejectReason.MALFORMED, "key id collision")
        current = None if entry is None else entry.records.get(record.subkey)
        if not newer(record, current):
            return False
        if current is None and self._count >= self._max_records:
            self.cull()
            if self._count >= self._max_records:
                raise RecordRejectedError(RejectReason.STORAGE_FULL)
        old_source = None if entry is None else entry.sources.get(record.subkey)
        if source is not None:
            self._check_quota(record, current, old_source, source)
        if entry is None:
            entry = self._entries[dkey] = _Entry()
        if current is not None:
            self._uncharge(current, old_source)
        else:
            self._count += 1
        entry.records[record.subkey] = record
        entry.sources[record.subkey] = source
        entry.soonest = min(entry.soonest, record.expiration)
        self._charge(record, source)
        entry.updated = time.monotonic()
        too_many = len(entry.records) > self._limits.max_subkeys_per_key
        if too_many and self._evict_from(entry) is record:
            return False
        if self.on_stored is not None:
            self.on_stored(dkey)
        return True

    def _check_quota(
        self, record: Record, current: Record | None, old_source: Source | None, source: Source
    ) -> None:
        size = record_size(record)
        replaced = record_size(current) if current is not None else 0
        q = self._quota
        for usage, same, max_records, max_bytes, who in (
            (
                self._by_peer.get(source.node_id, [0, 0]),
                old_source is not None and old_source.node_id == source.node_id,
                q.max_records_per_peer,
                q.max_bytes_per_peer,
                "node id",
            ),
            (
                self._by_host.get(source.host, [0, 0]),
                old_source is not None and old_source.host == source.host,
                q.max_records_per_host,
                q.max_bytes_per_host,
                "host",
            ),
        ):
            records = usage[0] + (0 if same else 1)
            used = usage[1] + size - (replaced if same else 0)
            if records > max_records or used > max_bytes:
                raise RecordRejectedError(
                    RejectReason.OVER_QUOTA,
                    f"this {who} would hold {records} records / {used} bytes "
                    f"(limits {max_records} / {max_bytes})",
                )

    def _charge(self, record: Record, source: Source | None, sign: int = 1) -> None:
        if source is None:
            return
        size = record_size(record)
        _add(self._by_peer, source.node_id, sign, size)
        _add(self._by_host, source.host, sign, size)

    def _uncharge(self, record: Record, source: Source | None) -> None:
        self._charge(record, source, -1)

    def _evict_from(self, entry: _Entry) -> Record:
        """Drop the soonest-expiring record of the source holding most sub-keys."""
        owners = {sk: _node_id(entry.sources.get(sk)) for sk in entry.records}
        counts = Counter(owners.values())
        # ties: a remote sender before this node's own records, then by id
        biggest = max(counts, key=lambda n: (counts[n], n is not None, n or b""))
        evict = min(
            (r for sk, r in entry.records.items() if owners[sk] == biggest), key=Record.sort_key
        )
        self._drop(entry, evict.subkey)
        return evict

    def _drop(self, entry: _Entry, subkey: bytes | None) -> None:
        record = entry.records.pop(subkey)
        self._uncharge(record, entry.sources.pop(subkey, None))
        self._count -= 1

    def records(self, dkey: bytes) -> list[Record]:
        """The live records under ``dkey``, newest first (empty if none)."""
        entry = self._live_entry(dkey)
        if entry is None:
            return []
        return sorted(entry.records.values(), key=Record.sort_key, reverse=True)

    def page(self, dkey: bytes, after: bytes | None = None) -> list[Record]:
        """The live records under ``dkey`` in the order of a find_value reply's
        pages: the plain value (if any) first, then by sub-key bytes; with
        ``after``, only the sub-keyed ones whose sub-key follows it. Sorts the
        sub-keys alone (bytes), not the records: a reader pages through a key
        of a thousand records a page at a time, and each page asks again."""
        entry = self._live_entry(dkey)
        if entry is None:
            return []
        records = entry.records
        if after is None:
            subkeys = sorted(sk for sk in records if sk is not None)
            first = [records[None]] if None in records else []
        else:
            subkeys = sorted(sk for sk in records if sk is not None and sk > after)
            first = []
        return first + [records[sk] for sk in subkeys]

    def cull(self) -> None:
        """Drop every expired record."""
        for dkey in list(self._entries):
            self._live_entry(dkey)

    def key_ids(self) -> list[bytes]:
        """The key ids held, some of which may have just expired (``records``
        of such a key is empty)."""
        return list(self._entries)

    def key_count(self) -> int:
        self.cull()
        return len(self._entries)

    def record_count(self) -> int:
        return self._count

    def usage(self, source: Source) -> tuple[int, int, int, int]:
        """(records, bytes) charged to ``source``'s node id, then to its host."""
        peer = self._by_peer.get(source.node_id, [0, 0])
        host = self._by_host.get(source.host, [0, 0])
        return peer[0], peer[1], host[0], host[1]

    def _live_entry(self, dkey: bytes) -> _Entry | None:
        entry = self._entries.get(dkey)
        if entry is None:
            return None
        now = self._clock()
        if now < entry.soonest and entry.records:
            return entry
        for sk in [sk for sk, r in entry.records.items() if r.expiration <= now]:
            self._drop(entry, sk)
        entry.soonest = min((r.expiration for r in entry.records.values()), default=math.inf)
        if not entry.records:
            del self._entries[dkey]
            return None
        return entry

    # -- kademlia's IStorage -------------------------------------------------

    def __setitem__(self, dkey: bytes, record: Record) -> None:
        if record.key_id != dkey:
            raise RecordRejectedError(RejectReason.MALFORMED, "record stored under a wrong key id")
        self.store(record)

    def __getitem__(self, dkey: bytes) -> list[Record]:
        found = self.records(dkey)
        if not found:
            raise KeyError(dkey)
        return found

    def get(self, dkey: bytes, default: list[Record] | None = None) -> list[Record] | None:
        return self.records(dkey) or default

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, list[Record]]]:
        self.cull()
        cutoff = time.monotonic() - seconds_old
        return [(k, self.records(k)) for k, e in list(self._entries.items()) if e.updated <= cutoff]

    def __iter__(self) -> Iterator[tuple[bytes, list[Record]]]:
        self.cull()
        return iter([(k, self.records(k)) for k in list(self._entries)])
