"""DHT abuse: per-sender storage quotas, request rate limits, and a flood on real UDP.

The quota and token-bucket rules are pure code and tested without a network;
the flood test sends a bounded number of datagrams from one 127.0.0.1 socket
while a well-behaved node stores and reads through the flooded node.
"""

from __future__ import annotations

import random
import socket

import pytest
import trio
from dht_harness import open_pair, send_datagrams

from dht import DHTConfig, DHTValue, RequestRateLimit, StorageQuota
from dht._messages import Kind, decode, encode, new_msg_id
from dht._ratelimit import RateLimiter, TokenBucket
from dht._records import Record, RecordLimits, make_record
from dht._storage import RecordStorage, Source
from swarm import ConfigError, Identity, ManualClock, RecordRejectedError, RejectReason

NOW = 1_700_000_000.0
LIMITS = RecordLimits(max_subkeys_per_key=8)
HONEST = Source(b"h" * 20, "10.0.0.1")
MALLORY = Source(b"m" * 20, "10.0.0.2")


def _record(key: str, value: int = 1, ttl: float = 100.0, subkey: object = None) -> Record:
    return make_record(key, value, NOW + ttl, subkey=subkey, limits=LIMITS)  # type: ignore[arg-type]


def _storage(**quota: int) -> RecordStorage:
    q = StorageQuota(**{"max_records_per_host": 10, "max_records_per_peer": 4, **quota})
    return RecordStorage(ManualClock(NOW), LIMITS, max_records=50, quota=q)


def test_one_peer_cannot_store_beyond_its_quota_and_others_are_unaffected() -> None:
    storage = _storage()
    for i in range(4):
        assert storage.store(_record(f"m{i}"), MALLORY)
    with pytest.raises(RecordRejectedError) as e:
        storage.store(_record("m4"), MALLORY)
    assert e.value.reason is RejectReason.OVER_QUOTA
    # updating a record it already holds is not a new record
    assert storage.store(_record("m0", value=2, ttl=200), MALLORY)
    assert storage.usage(MALLORY)[0] == 4
    assert storage.store(_record("h0"), HONEST)
    assert storage.store(_record("local"))  # this node's own records are not charged
    assert storage.record_count() == 6


def test_quota_counts_bytes_and_all_ids_of_one_host() -> None:
    storage = _storage(max_bytes_per_peer=300, max_bytes_per_host=10_000)
    with pytest.raises(RecordRejectedError) as e:
        storage.store(make_record("big", b"x" * 400, NOW + 10, limits=LIMITS), MALLORY)
    assert e.value.reason is RejectReason.OVER_QUOTA
    sybils = [Source(bytes([i]) * 20, MALLORY.host) for i in range(5)]
    stored = 0
    for n, sybil in enumerate(sybils):
        for i in range(3):
            try:
                stored += storage.store(_record(f"s{n}.{i}"), sybil)
            except RecordRejectedError as e:
                assert e.reason is RejectReason.OVER_QUOTA
    assert stored == 10  # max_records_per_host, however many ids
    assert storage.usage(sybils[0])[2] == 10
    assert storage.store(_record("h"), HONEST)


def test_overwriting_moves_the_charge_and_expiry_releases_it() -> None:
    clock = ManualClock(NOW)
    storage = RecordStorage(clock, LIMITS, quota=StorageQuota(max_records_per_peer=2))
    assert storage.store(_record("shared", ttl=10), HONEST)
    assert storage.store(_record("shared", value=2, ttl=20), MALLORY)
    assert storage.usage(HONEST)[:2] == (0, 0)
    assert storage.usage(MALLORY)[0] == 1
    clock.advance(30)
    storage.cull()
    assert storage.usage(MALLORY) == (0, 0, 0, 0)
    assert storage.record_count() == 0


def test_flooding_a_key_with_subkeys_evicts_only_the_flooders() -> None:
    storage = _storage(max_records_per_peer=100, max_records_per_host=100)
    for i in range(3):
        assert storage.store(_record("room", ttl=10 + i, subkey=f"honest{i}"), HONEST)
    # far-future sub-keys, more than the key may hold
    for i in range(20):
        storage.store(_record("room", ttl=1000 + i, subkey=f"evil{i}"), MALLORY)
    kept = {r.subkey for r in storage.records(_record("room").key_id)}
    assert len(kept) == LIMITS.max_subkeys_per_key
    assert {_record("room", subkey=f"honest{i}").subkey for i in range(3)} <= kept
    assert storage.usage(MALLORY)[0] == LIMITS.max_subkeys_per_key - 3


def test_full_storage_refuses_new_records_and_keeps_old_ones() -> None:
    storage = RecordStorage(
        ManualClock(NOW),
        LIMITS,
        max_records=3,
        quota=StorageQuota(max_records_per_peer=3, max_records_per_host=3),
    )
    for i in range(3):
        storage.store(_record(f"k{i}"), HONEST)
    with pytest.raises(RecordRejectedError) as e:
        storage.store(_record("k3"), MALLORY)
    assert e.value.reason is RejectReason.STORAGE_FULL
    assert storage.store(_record("k0", value=5, ttl=300), HONEST)  # updates still work
    assert storage.record_count() == 3


def test_token_bucket_refills_at_its_rate() -> None:
    clock = ManualClock(0.0)
    bucket = TokenBucket(3, 2.0, clock())
    assert [bucket.take(clock()) for _ in range(4)] == [True, True, True, False]
    clock.advance(0.5)
    assert bucket.take(clock()) and not bucket.take(clock())
    clock.advance(100)
    assert sum(bucket.take(clock()) for _ in range(10)) == 3  # never above capacity


def test_rate_limiter_keeps_sources_apart_and_bounds_memory() -> None:
    clock = ManualClock(0.0)
    limiter = RateLimiter.for_requests(RequestRateLimit(rate=1.0, burst=5, max_sources=10), clock)
    assert sum(limiter.allow("flooder") for _ in range(1000)) == 5
    assert sum(limiter.allow("honest") for _ in range(5)) == 5
    for i in range(100):
        limiter.allow(i)
    assert limiter.tracked() == 10


def test_limit_configs_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="burst"):
        RequestRateLimit(burst=0)
    with pytest.raises(ConfigError, match="rate"):
        RequestRateLimit(rate=0)
    with pytest.raises(ConfigError, match="reply_bytes_burst"):
        RequestRateLimit(reply_bytes_burst=1000)
    with pytest.raises(ConfigError, match="max_records_per_host"):
        StorageQuota(max_records_per_peer=10, max_records_per_host=5)
    with pytest.raises(ConfigError, match="max_records"):
        DHTConfig(max_records=10)


# -- a flood on real sockets --------------------------------------------------------

FLOOD_DATAGRAMS = 3000
FLOOD_CONFIG = DHTConfig(
    rpc_timeout=0.5,
    bootstrap_timeout=5.0,
    quota=StorageQuota(max_records_per_peer=50, max_records_per_host=1000),
    rate_limit=RequestRateLimit(rate=100.0, burst=300),
)


def _flood(mallory: Identity, rng: random.Random, now: float) -> list[bytes]:
    """Valid store requests for many keys, pings, junk, truncations and bit flips."""
    limits = FLOOD_CONFIG.limits
    datagrams = []
    for i in range(FLOOD_DATAGRAMS):
        kind = i % 5
        if kind == 0:
            record = make_record(f"flood{i}", b"x" * 200, now + 100, limits=limits)
            body = ["store", [record.to_wire()]]
        elif kind == 1:
            body = ["ping", []]
        else:
            body = ["find_value", [rng.randbytes(20)]]
        data = encode(mallory, Kind.REQUEST, new_msg_id(), body)
        if kind == 3:
            data = rng.randbytes(rng.randrange(1, 200))
        elif kind == 4:
            mutated = bytearray(data)
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
            data = bytes(mutated[: rng.randrange(1, len(mutated) + 1)])
        datagrams.append(data)
    return datagrams


async def test_flood_from_one_address_does_not_stop_serving_others() -> None:
    clock = ManualClock(NOW)
    # the budget clock stands still: the flooder gets exactly `burst` datagrams through
    frozen = ManualClock(0.0)
    mallory = Identity.from_seed(b"F" * 32)
    flood = _flood(mallory, random.Random(7), NOW)
    async with open_pair(FLOOD_CONFIG, clock, rate_clock=frozen) as (target, honest):
        done = trio.Event()

        async def send_flood() -> None:
            await send_datagrams(target, flood)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_flood)
            # during the flood
            assert await honest.store("during", "ok", NOW + 60)
            assert await honest.get("during") == DHTValue("ok", NOW + 60)
            await done.wait()
        # after the flood
        assert await honest.store("after", "ok", NOW + 60)
        assert await honest.get("after") == DHTValue("ok", NOW + 60)
        assert await honest.get("during") == DHTValue("ok", NOW + 60)

        # the target itself served the honest node: it holds both records, charged
        # to the honest node, and never failed to answer it
        storage = target._server.storage
        for key in ("during", "after"):
            (record,) = storage.records(_record(key).key_id)
            assert record.decoded_value() == "ok"
        assert storage.usage(Source(honest.peer_id, "127.0.0.1"))[0] == 2
        assert all(contact[0] != target.peer_id for contact in honest._server.proto._failed)
        # the flood was cut by the address budget and the per-peer quota
        burst = FLOOD_CONFIG.rate_limit.burst
        assert target.rate_limited_datagrams == FLOOD_DATAGRAMS - burst
        assert target.dropped_datagrams > 0
        flooded = storage.usage(Source(mallory.peer_id, "127.0.0.1"))[0]
        assert 0 < flooded <= FLOOD_CONFIG.quota.max_records_per_peer


async def test_storing_node_answers_malformed_and_over_quota_stores_with_the_reason() -> None:
    clock = ManualClock(NOW)
    config = DHTConfig(
        rpc_timeout=0.5, bootstrap_timeout=5.0, quota=StorageQuota(max_records_per_peer=1)
    )
    async with open_pair(config, clock) as (target, sender):
        good = make_record("fine", 1, NOW + 10, limits=config.limits)
        sig = sender.identity.sign(b"anything")
        cases: list[tuple[object, str]] = [
            ([b"k", None, b"\xc1", NOW + 10, None, None], "MALFORMED"),  # value not msgpack
            ([b"k", b"\xc1", b"\x01", NOW + 10, None, None], "MALFORMED"),  # bad sub-key
            ([b"k", None, b"\x01", NOW + 10, None], "MALFORMED"),  # five fields
            ([b"k", None, b"\x01", float("nan"), None, None], "MALFORMED"),
            ([b"k", None, b"\x01", NOW + 10, sender.identity.public_key, sig], "MALFORMED"),
            ([b"k" * 300, None, b"\x01", NOW + 10, None, None], "MALFORMED"),  # oversized
            ([b"k", None, b"\x01", NOW + 10**7, None, None], "TOO_FAR_IN_FUTURE"),
            (good.to_wire(), None),
            (make_record("second", 1, NOW + 10, limits=config.limits).to_wire(), "OVER_QUOTA"),
        ]
        proto = sender._server.proto
        for wire, reason in cases:
            ok, (_, reply) = await sender._loop.call(
                proto.call, ("127.0.0.1", target.port), "store", [wire]
            )
            assert ok
            assert reply == [reason is None, reason], wire
        assert target.stored_key_count() == 1


async def test_replies_to_one_address_are_bounded_in_bytes() -> None:
    """A forged source address cannot aim find_value replies at a victim: the
    node sends one address at most ``reply_bytes_burst`` bytes at once."""
    clock = ManualClock(NOW)
    config = DHTConfig(
        rpc_timeout=0.5,
        bootstrap_timeout=5.0,
        rate_limit=RequestRateLimit(reply_bytes_burst=3_000),
    )
    mallory = Identity.from_seed(b"V" * 32)
    async with open_pair(config, clock, rate_clock=ManualClock(0.0)) as (target, honest):
        for i in range(14):  # ~0.4 kB each: many full pages
            await honest.store("big", b"x" * 400, NOW + 60, subkey=i)
        request = encode(
            mallory, Kind.REQUEST, new_msg_id(), ["find_value", [_record("big").key_id]]
        )
        proto = target._server.proto
        unsent = proto.unsent_replies  # (the honest node's own address has a budget too)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as victim:
            victim.bind(("127.0.0.1", 0))
            victim.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            victim.setblocking(False)
            await send_datagrams(
                target, [request] * 10, source=trio.socket.from_stdlib_socket(victim)
            )
            received = []
            for _ in range(10):  # replies are sent as requests are read: all are here now
                try:
                    received.append(victim.recv(65_536))
                except BlockingIOError:
                    break
        # (the node also pings the unknown sender back, once: a small request)
        sizes = [len(r) for r in received if decode(r).kind is Kind.RESPONSE]
        assert len(sizes) == 2 and all(1_000 < s <= 1_400 for s in sizes), sizes
        assert proto.unsent_replies - unsent == 8
        # other addresses are still answered
        assert await honest.get("big") is not None
