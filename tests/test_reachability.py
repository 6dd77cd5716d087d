"""Reachability found out by dial-back (``swarm._reachability``).

The verdict and the reply codec are pure and tested without a network; the
dial-back itself runs between real peers on 127.0.0.1. Peers behind a real
NAT are in ``test_reachability_nat.py``.
"""

from __future__ import annotations

import socket

import pytest
import trio

from swarm import (
    ConfigError,
    PeerConfig,
    ProtocolError,
    Reachability,
    ReachabilityConfig,
    open_peer,
)
from swarm._identity import Identity
from swarm._reachability import (
    DIAL_BACK,
    DialBack,
    Verdict,
    check_reachability,
    decide,
    decode_reply,
    encode_reply,
    pick_helpers,
)

ALWAYS = ReachabilityConfig(check="always", dial_timeout=2.0)


def _reply(host: str, tcp: bool, udp: bool = True) -> DialBack:
    return DialBack(host, 40000, tcp, udp)


def test_a_majority_of_the_answers_that_got_through_both_ways_decides() -> None:
    assert decide([]) == Verdict(Reachability.UNCHECKED, None, 0)
    assert decide([_reply("1.2.3.4", True)]) == Verdict(Reachability.REACHABLE, "1.2.3.4", 1)
    # UDP alone can pass through the mapping the requester made toward the
    # helper: it never makes a peer reachable
    assert decide([_reply("1.2.3.4", False, True)]).reachability is Reachability.UNREACHABLE
    assert decide([_reply("1.2.3.4", True, False)]).reachability is Reachability.UNREACHABLE
    # a tie is not a majority: a helper on the same LAN reaches a NATed peer
    lan_and_internet = [_reply("192.168.1.5", True), _reply("5.6.7.8", False)]
    assert decide(lan_and_internet) == Verdict(Reachability.UNREACHABLE, "192.168.1.5", 2)
    forwarded = [_reply("5.6.7.8", True), _reply("5.6.7.8", True), _reply("10.0.0.2", False)]
    assert decide(forwarded) == Verdict(Reachability.REACHABLE, "5.6.7.8", 3)


def test_replies_round_trip_and_malformed_ones_are_protocol_errors() -> None:
    reply = _reply("10.77.0.3", False)
    assert decode_reply(encode_reply(reply)) == reply
    with pytest.raises(ProtocolError, match="refused: busy"):
        decode_reply(["refused", "busy"])
    malformed = [
        [], "ok", ["ok", "h", 1, True], ["ok", "h", 70000, True, True], ["ok", "h", 1, 1, 0],
        ["ok", 5, 1, True, True], ["yes", "h", 1, True, True],
    ]  # fmt: skip
    for bad in malformed:
        with pytest.raises(ProtocolError):
            decode_reply(bad)


def test_config_is_validated() -> None:
    for bad in (
        {"check": "sometimes"},
        {"helpers": 0},
        {"dial_timeout": 0.0},
        {"dial_timeout": float("nan")},
        {"recheck_interval": -1.0},
        {"max_dial_backs": 0},
    ):
        with pytest.raises(ConfigError):
            ReachabilityConfig(**bad)  # type: ignore[arg-type]


def test_helpers_are_the_initial_peers_first_and_never_oneself() -> None:
    a, b, c, me = (Identity.from_seed(bytes([i]) * 32).peer_id for i in range(4))
    contacts = [(a, "10.0.0.1", 1), (me, "10.0.0.9", 9), (b, "10.0.0.2", 2), (c, "10.0.0.3", 3)]
    picked = pick_helpers(contacts, me, [("10.0.0.3", 3)], 2)
    assert picked == [(c, ("10.0.0.3", 3)), (a, ("10.0.0.1", 1))]


def test_who_checks_by_default() -> None:
    joining = ("127.0.0.1:5000",)
    assert PeerConfig(host="0.0.0.0", initial_peers=joining).checks_reachability
    assert PeerConfig(host="0.0.0.0").checks_reachability  # the founder, once others join
    assert not PeerConfig(host="127.0.0.1", initial_peers=joining).checks_reachability
    assert not PeerConfig(
        host="0.0.0.0", initial_peers=joining, announce="1.2.3.4:5000"
    ).checks_reachability
    assert not PeerConfig(
        host="0.0.0.0", initial_peers=joining, client_mode=True
    ).checks_reachability
    never = ReachabilityConfig(check="never")
    assert not PeerConfig(host="0.0.0.0", reachability=never).checks_reachability
    assert PeerConfig(reachability=ALWAYS).checks_reachability


async def test_a_joining_peer_that_others_reach_is_reachable_and_so_becomes_the_founder() -> None:
    async with open_peer(config=PeerConfig(reachability=ALWAYS)) as first:
        assert first.reachability is Reachability.UNCHECKED  # nobody to ask yet
        config = PeerConfig(initial_peers=(first.address,), reachability=ALWAYS)
        async with open_peer(config=config) as second:
            assert second.reachability is Reachability.REACHABLE
            assert not second.client_mode and not second.dht.client_mode
            assert second.address == f"127.0.0.1:{second.port}"
            # the founder asks the joiner once it is a contact (recheck_reachability)
            with trio.fail_after(30):
                await first.reachability_found.wait()
            assert first.reachability is Reachability.REACHABLE


async def test_a_peer_nobody_can_dial_back_becomes_a_client() -> None:
    """Asked to dial back a port where nothing listens, the helper fails both
    ways: UNREACHABLE. (The same peer on its real port is reachable.)"""
    async with (
        open_peer() as helper,
        open_peer(config=PeerConfig(initial_peers=(helper.address,))) as asking,
    ):
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            nowhere = closed.getsockname()[1]
        verdict = await check_reachability(
            asking.connections, asking.dht, asking.peer_id, nowhere, [], ALWAYS
        )
        assert verdict == Verdict(Reachability.UNREACHABLE, "127.0.0.1", 1)
        verdict = await check_reachability(
            asking.connections, asking.dht, asking.peer_id, asking.port, [], ALWAYS
        )
        assert verdict.reachability is Reachability.REACHABLE


async def test_a_helper_proves_who_answers_so_nobody_borrows_anothers_port() -> None:
    """A peer asks to be dialed back at another peer's port: the handshake
    there proves another id and the DHT ping is answered by another node."""
    async with open_peer() as helper:
        joined = PeerConfig(initial_peers=(helper.address,))
        async with open_peer(config=joined) as liar, open_peer(config=joined) as other:
            reply = await liar.connections.call(
                helper.peer_id,
                ("127.0.0.1", helper.port),
                DIAL_BACK,
                [other.port],
                timeout=ALWAYS.call_timeout,
            )
            assert decode_reply(reply) == DialBack("127.0.0.1", reply[2], False, False)
            honest = await liar.connections.call(
                helper.peer_id, ("127.0.0.1", helper.port), DIAL_BACK, [liar.port], timeout=10
            )
            assert decode_reply(honest)[2:] == (True, True)


async def test_a_peer_that_does_not_serve_dial_backs_refuses_and_decides_nothing() -> None:
    refusing = ReachabilityConfig(serve=False)
    async with open_peer(config=PeerConfig(reachability=refusing)) as helper:
        config = PeerConfig(initial_peers=(helper.address,), reachability=ALWAYS)
        async with open_peer(config=config) as asking:
            # as before checks existed: a full member, its DHT node full too
            assert asking.reachability is Reachability.UNCHECKED
            assert not asking.client_mode and not asking.dht.client_mode
            reply = await asking.connections.call(
                helper.peer_id, ("127.0.0.1", helper.port), DIAL_BACK, [asking.port], timeout=10
            )
            with pytest.raises(ProtocolError, match="does not dial others back"):
                decode_reply(reply)


async def test_a_configured_client_stays_one_and_says_so() -> None:
    async with open_peer() as first:
        config = PeerConfig(initial_peers=(first.address,), client_mode=True, reachability=ALWAYS)
        async with open_peer(config=config) as client:
            assert client.reachability is Reachability.CLIENT
            assert client.client_mode
