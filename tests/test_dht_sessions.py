"""Per-pair MAC keys for DHT datagrams (``dht._sessions``): the rules of the
session table, the MAC'd envelope, and real nodes that sign only until each
holds the other's offer, and recover when a peer restarts with a new one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
from dht_harness import TEST_CONFIG, open_swarm

from dht import _messages as messages
from dht import open_dht_node
from dht._sessions import SessionKeys
from swarm import Identity, ManualClock, ProtocolError
from swarm._wire import pack, unpack

NOW = 1_700_000_000.0
ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
CAROL = Identity.from_seed(b"c" * 32)


def _sessions(*identities: Identity) -> list[SessionKeys]:
    return [SessionKeys(i.public_key) for i in identities]


def _introduce(a: SessionKeys, ida: Identity, b: SessionKeys, idb: Identity) -> None:
    """Each verified a signed datagram of the other, and each answered one."""
    a.offered(idb.peer_id, idb.public_key, b.offer)
    b.offered(ida.peer_id, ida.public_key, a.offer)
    a.confirm(idb.peer_id)
    b.confirm(ida.peer_id)


def test_a_pair_macs_with_one_key_once_each_holds_the_others_offer() -> None:
    alice, bob = _sessions(ALICE, BOB)
    alice.offered(BOB.peer_id, BOB.public_key, bob.offer)
    # alice holds bob's offer, but bob may not hold hers: she still signs
    assert alice.mac_key(BOB.peer_id) is None
    assert alice.mac_key(None) is None
    bob.offered(ALICE.peer_id, ALICE.public_key, alice.offer)
    alice.confirm(BOB.peer_id)
    key = alice.mac_key(BOB.peer_id)
    assert key is not None and len(key) == 32
    assert bob.verifying_key(ALICE.peer_id, ALICE.public_key) == key
    assert bob.mac_key(ALICE.peer_id) is None  # not confirmed on bob's side yet
    bob.confirm(ALICE.peer_id)
    assert bob.mac_key(ALICE.peer_id) == key
    # a key claimed for another public key, or for a stranger, is none
    assert bob.verifying_key(ALICE.peer_id, CAROL.public_key) is None
    assert bob.verifying_key(CAROL.peer_id, CAROL.public_key) is None


def test_a_new_offer_replaces_the_key_and_a_silence_forgets_it() -> None:
    alice, bob = _sessions(ALICE, BOB)
    _introduce(alice, ALICE, bob, BOB)
    old = alice.mac_key(BOB.peer_id)
    # bob signs again with the same offer (he answers a signed request)
    alice.offered(BOB.peer_id, BOB.public_key, bob.offer)
    assert alice.mac_key(BOB.peer_id) == old
    # bob restarted: a new offer, a new key
    (restarted,) = _sessions(BOB)
    alice.offered(BOB.peer_id, BOB.public_key, restarted.offer)
    restarted.offered(ALICE.peer_id, ALICE.public_key, alice.offer)
    alice.confirm(BOB.peer_id)
    new = alice.mac_key(BOB.peer_id)
    assert new is not None and new != old
    assert restarted.verifying_key(ALICE.peer_id, ALICE.public_key) == new
    # a signed datagram without an offer ends the session; so does a silence
    alice.offered(BOB.peer_id, BOB.public_key, b"")
    assert alice.verifying_key(BOB.peer_id, BOB.public_key) is None
    _introduce(alice, ALICE, restarted, BOB)
    alice.forget(BOB.peer_id)
    assert alice.mac_key(BOB.peer_id) is None
    assert alice.verifying_key(BOB.peer_id, BOB.public_key) is None


def test_no_session_with_oneself_or_an_unusable_offer() -> None:
    (alice,) = _sessions(ALICE)
    alice.offered(ALICE.peer_id, ALICE.public_key, alice.offer)
    alice.confirm(ALICE.peer_id)
    assert alice.mac_key(ALICE.peer_id) is None and len(alice) == 0
    # the all-zero point has a low order: its shared secret is all zeros
    alice.offered(BOB.peer_id, BOB.public_key, bytes(32))
    alice.confirm(BOB.peer_id)
    assert alice.mac_key(BOB.peer_id) is None
    assert alice.verifying_key(BOB.peer_id, BOB.public_key) is None
    with pytest.raises(ValueError, match="at least 1"):
        SessionKeys(ALICE.public_key, capacity=0)


def test_the_least_recently_heard_peer_is_forgotten_first() -> None:
    alice = SessionKeys(ALICE.public_key, capacity=2)
    others = [Identity.from_seed(bytes([i]) * 32) for i in range(3)]
    offers = [SessionKeys(o.public_key).offer for o in others]
    for other, offer in zip(others[:2], offers[:2], strict=True):
        alice.offered(other.peer_id, other.public_key, offer)
        alice.confirm(other.peer_id)
    alice.confirm(others[0].peer_id)  # heard from again: the most recent
    alice.offered(others[2].peer_id, others[2].public_key, offers[2])
    assert len(alice) == 2
    assert alice.verifying_key(others[1].peer_id, others[1].public_key) is None
    assert alice.verifying_key(others[0].peer_id, others[0].public_key) is not None


def _mac_keys(sessions: SessionKeys) -> messages.MacKeys:
    return sessions.verifying_key


@pytest.mark.parametrize("swarm_key", [None, b"k" * 32])
def test_a_macd_datagram_verifies_only_under_its_pairs_key(swarm_key: bytes | None) -> None:
    proof_key = None if swarm_key is None else messages.derive_proof_key(swarm_key)
    alice, bob, carol = _sessions(ALICE, BOB, CAROL)
    _introduce(alice, ALICE, bob, BOB)
    _introduce(carol, CAROL, bob, BOB)
    key = alice.mac_key(BOB.peer_id)
    msg_id = messages.new_msg_id()
    data = messages.encode(
        ALICE, messages.Kind.REQUEST, msg_id, ["ping", []], proof_key=proof_key, mac_key=key
    )
    signed = messages.encode(
        ALICE, messages.Kind.REQUEST, msg_id, ["ping", []], proof_key=proof_key, offer=alice.offer
    )
    assert len(data) == len(signed) - 80  # a MAC 48 bytes shorter, and no offer
    got = messages.decode(data, proof_key=proof_key, mac_keys=_mac_keys(bob))
    assert (got.sender, got.body, got.mac, got.offer) == (ALICE.peer_id, ["ping", []], True, b"")
    with pytest.raises(ProtocolError, match="without a session"):
        messages.decode(data, proof_key=proof_key)
    # carol shares a key with bob too, but not alice's
    with pytest.raises(ProtocolError, match="without a session"):
        messages.decode(data, proof_key=proof_key, mac_keys=_mac_keys(carol))
    forged = messages.encode(
        CAROL, messages.Kind.REQUEST, msg_id, ["ping", []], proof_key=proof_key, mac_key=key
    )
    # carol uses a key she cannot know, under her own name: it does not match hers
    with pytest.raises(ProtocolError, match="MAC does not match"):
        messages.decode(forged, proof_key=proof_key, mac_keys=_mac_keys(bob))
    # every authenticated part is covered: body, kind, message id, sender
    outer = unpack(data, max_size=messages.MAX_DATAGRAM_SIZE)
    for index, value in [
        (4, pack(["ping", [1]])),
        (1, int(messages.Kind.RESPONSE)),
        (2, bytes(20)),
        (3, CAROL.public_key),
    ]:
        tampered = list(outer)
        tampered[index] = value
        with pytest.raises(ProtocolError):
            messages.decode(pack(tampered), proof_key=proof_key, mac_keys=_mac_keys(bob))
    # a MAC'd datagram offers nothing (the offer must be signed)
    with_offer = list(outer)
    with_offer[7] = alice.offer
    with pytest.raises(ProtocolError, match="signed datagram only"):
        messages.decode(pack(with_offer), proof_key=proof_key, mac_keys=_mac_keys(bob))


def test_a_signed_datagram_binds_its_offer_and_old_versions_are_refused() -> None:
    (alice,) = _sessions(ALICE)
    data = messages.encode(ALICE, messages.Kind.REQUEST, bytes(20), ["ping", []], offer=alice.offer)
    got = messages.decode(data)
    assert (got.offer, got.mac, got.public_key) == (alice.offer, False, ALICE.public_key)
    fields = unpack(data, max_size=messages.MAX_DATAGRAM_SIZE)
    swapped = list(fields)
    swapped[7] = SessionKeys(ALICE.public_key).offer  # someone else's offer, same signature
    with pytest.raises(ProtocolError, match="signature does not verify"):
        messages.decode(pack(swapped))
    with pytest.raises(ProtocolError, match="version 1"):
        messages.decode(pack([1, *fields[1:]]))
    with pytest.raises(ProtocolError):
        messages.decode(pack(fields[:7]))  # version 1's layout
    with pytest.raises(ValueError, match="32 bytes"):
        messages.encode(ALICE, messages.Kind.REQUEST, bytes(20), None, offer=b"short")


async def test_real_nodes_sign_only_until_each_holds_the_others_offer() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(2, clock, seed=3) as swarm:
        a, b = swarm.nodes
        with trio.fail_after(10):
            # the first exchanges in each direction sign and carry the offers
            assert await a.store("warm", 0, NOW + 60)
            assert await b.store("warm", 1, NOW + 60)
            before = [node.stats() for node in (a, b)]
            for i in range(3):
                assert await a.store(f"k{i}", i, NOW + 60)
                assert (await b.get(f"k{i}")) is not None
                assert await b.store(f"j{i}", i, NOW + 60)
                assert (await a.get(f"j{i}")) is not None
            after = [node.stats() for node in (a, b)]
    for old, new in zip(before, after, strict=True):
        assert new.sent_datagrams > old.sent_datagrams
        # none signed but the copies resent (signed) when a reply was slow
        signed = new.signed_datagrams - old.signed_datagrams
        assert signed == new.resent_requests - old.resent_requests


async def test_a_peer_that_restarts_with_a_new_offer_is_reached_again() -> None:
    clock = ManualClock(NOW)
    config = replace(TEST_CONFIG, rpc_timeout=0.5, rpc_timeout_floor=0.5)
    async with open_swarm(2, clock, config=config, seed=5) as swarm:
        a, b = swarm.nodes
        identity, port = b.identity, b.port
        with trio.fail_after(20):
            assert await a.store("before", 0, NOW + 60)
            assert await b.store("before", 1, NOW + 60)
            signed = a.stats().signed_datagrams
            assert await a.store("macd", 0, NOW + 60)
            assert a.stats().signed_datagrams == signed  # a MACs to b now
            await swarm.stop(b)
            # the same id on the same port, with a new offer, and silent: a
            # learns of the restart only from its requests going unanswered
            async with open_dht_node(
                identity, host="127.0.0.1", port=port, config=config, clock=clock
            ) as restarted:
                assert restarted.stored_key_count() == 0
                attempts = 0
                while restarted.stored_key_count() == 0:
                    attempts += 1
                    assert attempts <= 3, "the restarted node was never reached again"
                    await a.store("after", attempts, NOW + 60)
                # the MAC'd copy was dropped; the copy resent, signed with
                # a's offer, reached b, whose signed answer renewed the session
                # (a second store only if the machine stalled past the timeout)
                assert attempts <= 2 and a.stats().resent_requests > 0
                signed = a.stats().signed_datagrams
                assert await a.store("again", 0, NOW + 60)
                assert a.stats().signed_datagrams == signed  # and MACs again
