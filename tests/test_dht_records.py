"""Record layout, signatures, validation and merge rules: pure code, no network."""

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht._messages import Kind, decode, encode, new_msg_id
from dht._protocol import page_key
from dht._records import (
    Record,
    RecordLimits,
    SignatureCache,
    make_record,
    merge,
    owner_marker,
    validate,
)
from dht._storage import RecordStorage
from swarm import Identity, ManualClock, ProtocolError, RecordRejectedError, RejectReason

LIMITS = RecordLimits()
NOW = 1_700_000_000.0
ALICE = Identity.from_seed(b"a" * 32)
MALLORY = Identity.from_seed(b"m" * 32)


def test_unowned_record_validates_and_round_trips() -> None:
    r = make_record("key", {"x": [1, 2]}, NOW + 10, limits=LIMITS)
    validate(r, NOW, LIMITS)
    assert Record.from_wire(r.to_wire(), LIMITS) == r
    assert r.decoded_value() == {"x": [1, 2]}


def test_owned_record_is_signed_and_verifies() -> None:
    r = make_record(
        "run.progress", 5, NOW + 10, subkey=owner_marker(ALICE.peer_id), signer=ALICE, limits=LIMITS
    )
    assert r.signature is not None and r.public_key == ALICE.public_key
    validate(r, NOW, LIMITS)


def test_cannot_sign_for_another_owner() -> None:
    with pytest.raises(RecordRejectedError) as e:
        make_record(
            "k", 1, NOW + 10, subkey=owner_marker(ALICE.peer_id), signer=MALLORY, limits=LIMITS
        )
    assert e.value.reason is RejectReason.NOT_OWNER


def test_forged_records_are_rejected() -> None:
    good = make_record(f"k{owner_marker(ALICE.peer_id)}", 1, NOW + 10, signer=ALICE, limits=LIMITS)
    # Mallory signs with her own key a record naming Alice
    forged = Record(
        good.key,
        None,
        good.value,
        good.expiration,
        MALLORY.public_key,
        MALLORY.sign(good.signing_payload()),
    )
    # replay of Alice's signature with a later expiration
    replayed = Record(
        good.key, None, good.value, good.expiration + 100, good.public_key, good.signature
    )
    # altered value
    altered = Record(good.key, None, b"\x02", good.expiration, good.public_key, good.signature)
    unsigned = Record(good.key, None, good.value, good.expiration)
    for bad in (forged, replayed, altered, unsigned):
        with pytest.raises(RecordRejectedError) as e:
            validate(bad, NOW, LIMITS)
        assert e.value.reason is RejectReason.FORGED


def test_two_different_owners_in_key_and_subkey_are_forged() -> None:
    r = Record(f"k{owner_marker(ALICE.peer_id)}".encode(), None, b"\x01", NOW + 1)
    r2 = Record(
        r.key,
        make_record(
            "x", 1, NOW + 1, subkey=owner_marker(MALLORY.peer_id), signer=MALLORY, limits=LIMITS
        ).subkey,
        b"\x01",
        NOW + 1,
    )
    with pytest.raises(RecordRejectedError) as e:
        validate(r2, NOW, LIMITS)
    assert e.value.reason is RejectReason.FORGED


@pytest.mark.parametrize(
    ("expiration", "reason"),
    [
        (NOW, RejectReason.EXPIRED),
        (NOW - 5, RejectReason.EXPIRED),
        (NOW + LIMITS.max_ttl + LIMITS.max_clock_skew + 1, RejectReason.TOO_FAR_IN_FUTURE),
    ],
)
def test_expiration_bounds(expiration: float, reason: RejectReason) -> None:
    r = make_record("k", 1, expiration, limits=LIMITS)
    with pytest.raises(RecordRejectedError) as e:
        validate(r, NOW, LIMITS)
    assert e.value.reason is reason


def test_oversized_parts_are_rejected_on_the_writer_side() -> None:
    for kwargs in ({"key": "k" * 300, "value": 1}, {"key": "k", "value": b"x" * 5000}):
        with pytest.raises(RecordRejectedError) as e:
            make_record(kwargs["key"], kwargs["value"], NOW + 1, limits=LIMITS)
        assert e.value.reason is RejectReason.OVERSIZED
    with pytest.raises(ProtocolError):
        Record.from_wire([b"k", None, b"x" * 5000, NOW + 1, None, None], LIMITS)


def test_merge_keeps_latest_expiration_and_is_order_independent() -> None:
    versions = [make_record("k", v, NOW + e, limits=LIMITS) for v, e in [(1, 5), (2, 9), (3, 7)]]
    for order in (versions, versions[::-1], [versions[1], versions[0], versions[2]]):
        held: dict[bytes | None, Record] = {}
        for r in order:
            merge(held, r)
        assert held[None].decoded_value() == 2


def test_storage_drops_expired_and_keeps_subkeys_apart() -> None:
    clock = ManualClock(NOW)
    storage = RecordStorage(clock, LIMITS)
    for i in range(3):
        assert storage.store(make_record("k", i, NOW + 10 + i, subkey=f"s{i}", limits=LIMITS))
    assert not storage.store(make_record("k", 9, NOW + 1, subkey="s0", limits=LIMITS))
    dkey = make_record("k", 0, NOW + 1, limits=LIMITS).key_id
    assert len(storage.records(dkey)) == 3
    clock.advance(10.5)
    assert [r.decoded_value() for r in storage.records(dkey)] == [2, 1]
    clock.advance(100)
    assert storage.records(dkey) == [] and storage.key_count() == 0
    assert storage.record_count() == 0


@given(
    st.lists(st.one_of(st.text(max_size=6), st.integers(-300, 300), st.binary(max_size=6))),
    st.booleans(),
    st.data(),
)
def test_storage_pages_in_page_key_order(
    subkeys: list[str | int | bytes], plain: bool, data: st.DataObject
) -> None:
    storage = RecordStorage(ManualClock(NOW), LIMITS)
    for i, subkey in enumerate(subkeys):
        storage.store(make_record("k", i, NOW + 10, subkey=subkey, limits=LIMITS))
    if plain:
        storage.store(make_record("k", "plain", NOW + 10, limits=LIMITS))
    dkey = make_record("k", 0, NOW + 1, limits=LIMITS).key_id
    ordered = sorted(storage.records(dkey), key=page_key)
    assert storage.page(dkey) == ordered
    after = data.draw(st.sampled_from([b""] + [page_key(r) for r in ordered]))
    assert storage.page(dkey, after) == [r for r in ordered if page_key(r) > after]


def test_storage_evicts_soonest_expiring_subkey_beyond_limit() -> None:
    limits = RecordLimits(max_subkeys_per_key=4)
    storage = RecordStorage(ManualClock(NOW), limits)
    for i in range(6):
        storage.store(make_record("k", i, NOW + 100 - i, subkey=i, limits=limits))
    kept = storage.records(make_record("k", 0, NOW + 1, limits=limits).key_id)
    assert sorted(r.decoded_value() for r in kept) == [0, 1, 2, 3]


def test_storage_refuses_invalid_records() -> None:
    storage = RecordStorage(ManualClock(NOW), LIMITS)
    with pytest.raises(RecordRejectedError):
        storage.store(Record(b"k", None, b"\x01", NOW - 1))
    assert storage.record_count() == 0


def test_datagram_round_trip_and_tampering() -> None:
    msg_id = new_msg_id()
    data = encode(ALICE, Kind.REQUEST, msg_id, ["ping", []])
    dg = decode(data)
    assert (dg.kind, dg.msg_id, dg.sender, dg.body) == (
        Kind.REQUEST,
        msg_id,
        ALICE.peer_id,
        ["ping", []],
    )
    for i in range(len(data)):
        tampered = bytearray(data)
        tampered[i] ^= 0x01
        with pytest.raises(ProtocolError):
            decode(bytes(tampered))


@given(st.binary(max_size=300))
def test_datagram_decoder_raises_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data)


@given(st.data())
def test_truncated_datagrams_are_rejected(data: st.DataObject) -> None:
    encoded = encode(ALICE, Kind.RESPONSE, new_msg_id(), [[b"x"], [], False])
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ProtocolError):
        decode(encoded[:cut])


@given(
    st.lists(
        st.none() | st.binary(max_size=40) | st.floats() | st.integers() | st.text(),
        min_size=0,
        max_size=7,
    )
)
def test_record_decoder_raises_only_protocol_error(fields: list[object]) -> None:
    try:
        r = Record.from_wire(fields, LIMITS)
    except ProtocolError:
        return
    with contextlib.suppress(RecordRejectedError):
        validate(r, NOW, LIMITS)


def test_a_verified_signature_is_remembered_and_a_changed_record_is_verified_afresh() -> None:
    cache = SignatureCache(capacity=2)
    r = make_record(
        "run.progress", 5, NOW + 10, subkey=owner_marker(ALICE.peer_id), signer=ALICE, limits=LIMITS
    )
    assert r.public_key is not None and r.signature is not None
    payload = r.signing_payload()
    assert cache.verify(r.public_key, r.signature, payload)
    assert cache.verify(r.public_key, r.signature, payload)
    assert (cache.hits, cache.misses) == (1, 1)
    # the same signature over other bytes (a changed value): verified, refused
    assert not cache.verify(r.public_key, r.signature, payload + b"x")
    assert not cache.verify(MALLORY.public_key, r.signature, payload)
    assert (cache.hits, cache.misses) == (1, 3)
    # bounded: two more verified triples evict the first
    for value in (6, 7):
        other = make_record(
            "run.progress",
            value,
            NOW + 10,
            subkey=owner_marker(ALICE.peer_id),
            signer=ALICE,
            limits=LIMITS,
        )
        assert other.public_key is not None and other.signature is not None
        assert cache.verify(other.public_key, other.signature, other.signing_payload())
    assert cache.verify(r.public_key, r.signature, payload)
    assert (cache.hits, cache.misses) == (1, 6)
    with pytest.raises(ValueError):
        SignatureCache(capacity=0)


def test_a_forged_copy_of_a_validated_record_is_still_rejected() -> None:
    r = make_record(
        "run.progress", 5, NOW + 10, subkey=owner_marker(ALICE.peer_id), signer=ALICE, limits=LIMITS
    )
    validate(r, NOW, LIMITS)
    validate(r, NOW, LIMITS)  # from the cache
    forged = Record(r.key, r.subkey, b"\x06", r.expiration, r.public_key, r.signature)
    with pytest.raises(RecordRejectedError) as caught:
        validate(forged, NOW, LIMITS)
    assert caught.value.reason is RejectReason.FORGED
