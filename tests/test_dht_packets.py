"""The DHT fits in packets: no datagram exceeds 1,400 bytes, and a key's
records that do not fit in one reply are paged, never cut unannounced.

The encoder's limit is checked directly; every reply a node can build is
checked by driving its request handler with extreme contents (longest keys,
sub-keys and values, IPv6 contacts with the longest addresses) from seeded
random generators; paging is checked end to end over real UDP.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
from dht_harness import TEST_CONFIG, open_swarm
from kademlia.node import Node

from dht import RecordLimits, RequestRateLimit, owner_marker
from dht import _messages as messages
from dht._messages import MAX_BODY_SIZE, MAX_DATAGRAM_SIZE, DatagramTooLargeError
from dht._protocol import SwarmProtocol, decode_find_value_reply, page_key
from dht._records import MAX_RECORD_SIZE, Record, make_record
from dht._storage import RecordStorage, StorageQuota
from swarm import Identity, ManualClock, SwarmError
from swarm._wire import pack

NOW = 1_700_000_000.0
LIMITS = RecordLimits()
SERVER = Identity.from_seed(b"s" * 32)
ASKER = Identity.from_seed(b"a" * 32)


def test_the_encoder_refuses_what_does_not_fit_in_a_frame() -> None:
    proof_key = messages.derive_proof_key(b"k" * 32)
    fits = b"x" * (MAX_BODY_SIZE - 3)  # a bin16 header makes it MAX_BODY_SIZE
    assert len(pack(fits)) == MAX_BODY_SIZE
    for key in (None, proof_key):
        data = messages.encode(SERVER, messages.Kind.RESPONSE, bytes(20), fits, proof_key=key)
        assert len(data) <= MAX_DATAGRAM_SIZE
        assert messages.decode(data, proof_key=key).body == fits
        with pytest.raises(DatagramTooLargeError) as raised:
            messages.encode(SERVER, messages.Kind.RESPONSE, bytes(20), fits + b"x", proof_key=key)
        assert isinstance(raised.value, SwarmError)


def test_a_datagram_over_the_limit_is_refused_on_arrival() -> None:
    body = b"x" * (MAX_BODY_SIZE - 3)
    data = messages.encode(SERVER, messages.Kind.RESPONSE, bytes(20), body)
    padded = data + b"\x00" * (MAX_DATAGRAM_SIZE + 1 - len(data))
    with pytest.raises(SwarmError):
        messages.decode(padded)


def test_record_limits_must_fit_one_store_request() -> None:
    with pytest.raises(ValueError, match="one datagram"):
        RecordLimits(max_value_size=4096)
    # a record at every limit fits, and so does the store request carrying it
    owner = owner_marker(SERVER.peer_id)
    key = "k" * (LIMITS.max_key_size - len(owner)) + owner
    record = make_record(
        key,
        b"v" * (LIMITS.max_value_size - 3),
        NOW + 10,
        subkey="s" * (LIMITS.max_subkey_size - 3),
        signer=SERVER,
        limits=LIMITS,
    )
    assert len(pack(record.to_wire())) <= MAX_RECORD_SIZE
    body = ["store", [record.to_wire()], 1]
    assert len(messages.encode(SERVER, messages.Kind.REQUEST, bytes(20), body)) <= 1_400


class _Sent:
    """A transport that keeps what the protocol sends."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: Any) -> None:
        self.sent.append(data)

    def close(self) -> None:
        pass


def _server(rng: random.Random) -> tuple[SwarmProtocol, _Sent]:
    clock = ManualClock(NOW)
    quota = StorageQuota(max_records_per_peer=10_000, max_records_per_host=10_000)
    proto = SwarmProtocol(
        Node(SERVER.peer_id),
        RecordStorage(clock, LIMITS, 100_000, quota),
        20,
        identity=SERVER,
        limits=LIMITS,
        rpc_timeout=1.0,
        clock=clock,
        rate_limit=RequestRateLimit(),
        rate_clock=ManualClock(0.0),
    )
    sent = _Sent()
    proto.transport = sent  # type: ignore[assignment]
    proto._pinging.add(bytes(ASKER.peer_id))  # no ping-back: no event loop runs here
    # the longest contacts there are: IPv6 addresses of 39 characters, high ports
    for _ in range(20):
        ip = ":".join(f"{rng.getrandbits(16) | 0x1000:x}" for _ in range(8))
        proto.router.add_contact(Node(rng.randbytes(20), ip, 65_535))
    return proto, sent


def _ask(proto: SwarmProtocol, sent: _Sent, method: str, args: list[Any]) -> Any:
    sent.sent.clear()
    request = messages.Datagram(messages.Kind.REQUEST, bytes(20), ASKER.peer_id, [method, args])
    proto._answer(request, ("127.0.0.1", 9))
    (reply,) = sent.sent
    assert len(reply) <= MAX_DATAGRAM_SIZE
    return messages.decode(reply).body


def _random_record(rng: random.Random, key: str, index: int) -> Record:
    subkey = f"{index:06d}" + "s" * rng.randrange(LIMITS.max_subkey_size - 10)
    value = b"v" * rng.randrange(LIMITS.max_value_size - 3)
    return make_record(key, value, NOW + 1 + rng.random() * 100, subkey=subkey, limits=LIMITS)


@pytest.mark.parametrize("seed", range(8))
def test_every_reply_fits_and_pages_hold_every_record(seed: int) -> None:
    rng = random.Random(seed)
    proto, sent = _server(rng)
    key = "k" * rng.randrange(1, LIMITS.max_key_size)
    stored = [_random_record(rng, key, i) for i in range(rng.randrange(0, 120))]
    if rng.random() < 0.5:  # a plain value under the same key comes first
        stored.append(make_record(key, b"p" * 400, NOW + 5, limits=LIMITS))
    for record in stored:
        assert proto.storage.store(record)
    dkey = stored[0].key_id if stored else Record(key.encode(), None, b"", 0.0).key_id

    assert len(_ask(proto, sent, "find_node", [dkey])) >= 16  # most of k, even over IPv6
    _ask(proto, sent, "ping", [])
    records, contacts, more = decode_find_value_reply(
        _ask(proto, sent, "find_value", [dkey]), LIMITS
    )
    assert contacts
    pages = 1
    while more:
        assert pages < 500
        cursor = page_key(records[-1]) if records else None
        page, no_contacts, more = decode_find_value_reply(
            _ask(proto, sent, "find_value", [dkey, cursor]), LIMITS
        )
        assert page and not no_contacts  # every later page makes progress
        records += page
        pages += 1
    assert sorted(records, key=page_key) == records  # in page order, nothing twice
    assert {(r.subkey, r.value) for r in records} == {(r.subkey, r.value) for r in stored}
    if stored:
        record = rng.choice(stored)
        assert _ask(proto, sent, "store", [record.to_wire()]) == [False, None]  # already held


async def test_hundreds_of_subkeys_come_back_whole_over_udp() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(6, clock, config=TEST_CONFIG, seed=11) as swarm:
        writer, reader = swarm.nodes[1], swarm.nodes[4]
        for i in range(300):
            assert await writer.store("crowded", {"i": i, "pad": "x" * 60}, NOW + 60, subkey=i)
        with trio.fail_after(60):
            found = await reader.get("crowded")
        assert found is not None
        assert {k: v.value["i"] for k, v in found.value.items()} == {i: i for i in range(300)}
        for node in swarm.nodes:
            assert node.stats().largest_datagram <= MAX_DATAGRAM_SIZE
