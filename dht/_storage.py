"""Record storage of one DHT node: kademlia's ``IStorage`` for signed, expiring records.

Storage is indexed by the 160-bit key id (``sha1(key)``). Each entry holds one
record per sub-key (``None`` for a plain value), merged by ``records.merge``.
Expired records are dropped whenever an entry is touched and by ``cull``;
nothing expired is ever returned.

Only validated records enter: ``store`` runs ``records.validate`` first, so
everything this storage hands to the protocol (replies, pushes to new
neighbours, republishing) passes validation at the time it was stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kademlia.storage import IStorage

from swarm._clock import WallClock
from swarm._errors import RecordRejectedError, RejectReason

from ._records import Record, RecordLimits, merge, validate


@dataclass
class _Entry:
    records: dict[bytes | None, Record] = field(default_factory=dict)
    #: monotonic time of the last accepted write, for republishing
    updated: float = field(default_factory=time.monotonic)


class RecordStorage(IStorage):
    """Validated records by key id. Not thread-safe; lives on the DHT's event loop."""

    def __init__(self, clock: WallClock, limits: RecordLimits, max_records: int = 100_000) -> None:
        self._clock = clock
        self._limits = limits
        self._max_records = max_records
        self._entries: dict[bytes, _Entry] = {}
        self._count = 0

    # -- our interface -------------------------------------------------------

    def store(self, record: Record) -> bool:
        """Validate and merge ``record``. True if it is now the stored version.

        Raises ``RecordRejectedError`` if validation fails or storage is full.
        An older version than the stored one is not an error: it returns False.
        """
        validate(record, self._clock(), self._limits)
        dkey = record.key_id
        entry = self._live_entry(dkey)
        if entry is None:
            if self._count >= self._max_records:
                self.cull()
                if self._count >= self._max_records:
                    raise RecordRejectedError(RejectReason.TOO_MANY_SUBKEYS, "storage is full")
            entry = self._entries[dkey] = _Entry()
        if entry.records and next(iter(entry.records.values())).key != record.key:
            # sha1 collision or a crafted key: never mix two keys in one entry
            raise RecordRejectedError(RejectReason.MALFORMED, "key id collision")
        is_new_subkey = record.subkey not in entry.records
        if not merge(entry.records, record):
            return False
        entry.updated = time.monotonic()
        if is_new_subkey:
            self._count += 1
            if len(entry.records) > self._limits.max_subkeys_per_key:
                evict = min(entry.records.values(), key=Record.sort_key)
                del entry.records[evict.subkey]
                self._count -= 1
                return evict is not record
        return True

    def records(self, dkey: bytes) -> list[Record]:
        """The live records under ``dkey``, newest first (empty if none)."""
        entry = self._live_entry(dkey)
        if entry is None:
            return []
        return sorted(entry.records.values(), key=Record.sort_key, reverse=True)

    def cull(self) -> None:
        """Drop every expired record."""
        for dkey in list(self._entries):
            self._live_entry(dkey)

    def key_count(self) -> int:
        self.cull()
        return len(self._entries)

    def record_count(self) -> int:
        return self._count

    def _live_entry(self, dkey: bytes) -> _Entry | None:
        entry = self._entries.get(dkey)
        if entry is None:
            return None
        now = self._clock()
        expired = [sk for sk, r in entry.records.items() if r.expiration <= now]
        for sk in expired:
            del entry.records[sk]
        self._count -= len(expired)
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
