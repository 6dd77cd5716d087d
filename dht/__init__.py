"""The DHT: Kademlia (the ``kademlia`` package, under trio) with signed, expiring records.

Modules, from pure code up to the node:

- ``_records``: record layout, owner signatures, validation and merge rules (pure)
- ``_messages``: the signed datagram envelope (pure)
- ``_storage``: kademlia ``IStorage`` holding validated records by key id, with
  per-sender quotas (``StorageQuota``)
- ``_ratelimit``: token buckets per source address and node id (``RequestRateLimit``)
- ``_protocol``: kademlia's protocol subclass speaking signed datagrams and records
- ``_rtt``: ``RoundTrips``, reply deadlines learned from measured round trips (pure)
- ``_routing``: ``NearestNodes``, a look-up's candidate heap with O(1) membership
- ``_crawl``: a value look-up that merges the replies of the responsible nodes
- ``_server``: kademlia's ``Server`` subclass storing and finding records
- ``_aio``: the one seam between trio and asyncio (trio-asyncio), including
  the UDP socket that a trio task reads for the protocol
- ``_node``: ``DHTNode`` and ``open_dht_node``, the trio API, and ``RecordDHT``,
  the part of it that code above the DHT depends on
"""

from ._node import (
    DHTConfig,
    DHTNode,
    DHTStats,
    DHTValue,
    RecordDHT,
    estimate_network_size,
    open_dht_node,
)
from ._ratelimit import RequestRateLimit
from ._records import Record, RecordLimits, make_record, owner_marker
from ._storage import StorageQuota

__all__ = [
    "DHTConfig",
    "DHTNode",
    "DHTStats",
    "DHTValue",
    "Record",
    "RecordDHT",
    "RecordLimits",
    "RequestRateLimit",
    "StorageQuota",
    "estimate_network_size",
    "make_record",
    "open_dht_node",
    "owner_marker",
]
