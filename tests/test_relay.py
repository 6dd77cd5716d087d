"""Relays (``swarm._relay``) over real sockets on 127.0.0.1 (ephemeral ports).

Three peers: R relays, X registers with R and is dialed only through it (the
direct address the tests pass leads nowhere), D dials X. A man in the middle
(``mitm_harness``) between D and R's relay port stands in for a relay that
changes bytes: what it forwards is exactly what R forwards.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing
from mitm_harness import serve_proxy

from swarm import (
    ConfigError,
    Identity,
    PeerConfig,
    PeerID,
    PeerUnreachableError,
    ProtocolError,
    PunchConfig,
    PunchError,
    open_peer,
)
from swarm._bans import BanList
from swarm._connections import Address, Connections, Stream, open_connections
from swarm._counters import count_of
from swarm._errors import StreamResetError
from swarm._punch import PUNCH, AutoPunch
from swarm._relay import (
    RAW_MAGIC,
    REGISTER,
    Relay,
    RelayConfig,
    decode_registered,
    encode_preamble,
    keep_relay,
    serve_relay,
)

R = Identity.from_seed(b"R" * 32)
X = Identity.from_seed(b"X" * 32)
Y = Identity.from_seed(b"Y" * 32)
D = Identity.from_seed(b"D" * 32)
HOST = "127.0.0.1"
#: What tests pass as X's direct address: nothing listens there, so any
#: answer came through the relay.
NOWHERE: Address = (HOST, 1)


@dataclass
class Swarm:
    relay: Relay
    r: Connections
    x: Connections
    d: Connections
    circuit: Address  # R's relay port, where D asks for X
    received: list[Any]  # what X's echo handler received, and from whom


@asynccontextmanager
async def relayed_swarm(config: RelayConfig | None = None) -> AsyncIterator[Swarm]:
    async with (
        open_connections(R) as r,
        serve_relay(r, config) as relay,
        # bans on, as in a peer: a relay must not get honest peers banned
        open_connections(X, bans=BanList(clock=trio.current_time)) as x,
        open_connections(D, bans=BanList(clock=trio.current_time)) as d,
        trio.open_nursery() as nursery,
    ):
        received: list[Any] = []

        async def echo(stream: Stream) -> None:
            message = await stream.receive()
            received.append((stream.remote, message))
            await stream.send(message)

        x.set_handler("echo", echo)
        circuit = await nursery.start(keep_relay, x, R.peer_id, (HOST, r.port))
        d.set_relay_route(X.peer_id, circuit)
        yield Swarm(relay, r, x, d, circuit, received)
        nursery.cancel_scope.cancel()


async def test_a_circuit_through_a_relay_carries_an_authenticated_connection() -> None:
    async with relayed_swarm() as s:
        assert s.relay.relayed_peers == {X.peer_id}
        reply = await s.d.call(X.peer_id, NOWHERE, "echo", ["hello", b"\x00" * 1000], timeout=10)
        assert reply == ["hello", b"\x00" * 1000]
        # X's handshake proved who dialed; the relay forwarded every byte of it.
        assert s.received == [(D.peer_id, ["hello", b"\x00" * 1000])]
        assert s.relay.circuits_made == 1
        assert s.relay.bytes_relayed >= 1000


async def test_without_a_relay_route_the_unreachable_address_fails() -> None:
    async with relayed_swarm() as s:
        s.d.set_relay_route(X.peer_id, None)
        with pytest.raises(PeerUnreachableError):
            await s.d.call(X.peer_id, NOWHERE, "echo", "hi", timeout=10)
        assert s.relay.circuits_made == 0


async def test_the_relay_refuses_a_circuit_to_a_peer_it_does_not_relay() -> None:
    async with relayed_swarm() as s:
        s.d.set_relay_route(Y.peer_id, s.circuit)
        with pytest.raises(PeerUnreachableError, match="not relayed here"):
            await s.d.call(Y.peer_id, NOWHERE, "echo", "hi", timeout=10)


def _connect_preamble_size() -> int:
    return len(RAW_MAGIC + encode_preamble(["connect", bytes(X.peer_id)]))


async def test_two_dialers_reach_the_relayed_peer_at_once() -> None:
    async with relayed_swarm() as s, open_connections(Y) as y:
        y.set_relay_route(X.peer_id, s.circuit)
        async with trio.open_nursery() as nursery:
            for who in (s.d, y):
                call = functools.partial(who.call, timeout=10)
                nursery.start_soon(call, X.peer_id, NOWHERE, "echo", bytes(who.peer_id))
        assert sorted(s.received) == sorted(
            [(D.peer_id, bytes(D.peer_id)), (Y.peer_id, bytes(Y.peer_id))]
        )
        assert s.relay.circuits_made == 2


async def test_circuits_beyond_max_circuits_are_refused() -> None:
    async with relayed_swarm(RelayConfig(max_circuits=1)) as s:
        async with s.d.open_stream(X.peer_id, NOWHERE, "echo") as held:
            # The held stream keeps the one circuit busy, so this call dials anew.
            with pytest.raises(PeerUnreachableError, match="already 1 circuits"):
                await s.d.call(X.peer_id, NOWHERE, "echo", "second", timeout=10)
            await held.send("first")
            assert await held.receive() == "first"
        assert s.received == [(D.peer_id, "first")]


async def test_a_relay_that_leaves_ends_the_registration() -> None:
    """``keep_relay`` raises when its relay goes, so its caller can pick another."""
    async with (
        open_connections(X) as x,
        open_connections(R) as r,
        serve_relay(r) as relay,
        trio.open_nursery() as nursery,
    ):
        ended = trio.Event()

        async def keep() -> None:
            with pytest.raises((PeerUnreachableError, StreamResetError)):
                await keep_relay(x, R.peer_id, (HOST, r.port))
            ended.set()

        nursery.start_soon(keep)
        for _ in range(100):  # bounded: until X is registered
            if relay.relayed_peers:
                break
            await trio.sleep(0.01)
        assert relay.relayed_peers == {X.peer_id}
        await r.aclose()
        with trio.fail_after(10):
            await ended.wait()


async def test_a_relay_that_changes_a_handshake_byte_is_detected() -> None:
    """A flipped bit in X's handshake reply (M2): D's handshake fails with
    ``ProtocolError`` and X's handler never runs."""
    async with relayed_swarm() as s, trio.open_nursery() as nursery:
        flip = len(encode_preamble(["ok"])) + 40  # inside M2's signed core
        proxy = await nursery.start(serve_proxy, s.circuit[1], None, flip)
        s.d.set_relay_route(X.peer_id, (HOST, proxy))
        with pytest.raises(ProtocolError):
            await s.d.call(X.peer_id, NOWHERE, "echo", "hi", timeout=10)
        assert s.received == []
        await _nobody_banned_and_the_honest_circuit_works(s)
        nursery.cancel_scope.cancel()


async def test_a_relay_that_changes_a_payload_byte_is_detected() -> None:
    """A flipped bit in D's request frame: X's frame authentication fails, the
    handler gets nothing, and X resets D's stream saying why."""
    async with relayed_swarm() as s, trio.open_nursery() as nursery:
        # Past the preamble and the handshake (M1 and M3 are under 300 bytes
        # together): inside the 4000-byte request.
        flip = _connect_preamble_size() + 2000
        proxy = await nursery.start(serve_proxy, s.circuit[1], flip, None)
        s.d.set_relay_route(X.peer_id, (HOST, proxy))
        with pytest.raises(StreamResetError, match=r"AuthenticationError: .*failed authentication"):
            await s.d.call(X.peer_id, NOWHERE, "echo", b"\x07" * 4000, timeout=10)
        assert s.received == []
        await _nobody_banned_and_the_honest_circuit_works(s)
        nursery.cancel_scope.cancel()


async def _nobody_banned_and_the_honest_circuit_works(s: Swarm) -> None:
    """After a relay altered a connection: neither end banned the other (the
    relay, not the remote, may be at fault), and through an honest relay the
    two talk again."""
    assert not s.x.bans.is_banned(D.peer_id) and not s.d.bans.is_banned(X.peer_id)
    s.d.set_relay_route(X.peer_id, s.circuit)
    assert await s.d.call(X.peer_id, NOWHERE, "echo", "again", timeout=10) == "again"
    assert s.received == [(D.peer_id, "again")]


async def test_registrations_beyond_max_relayed_peers_are_refused() -> None:
    async with relayed_swarm(RelayConfig(max_relayed_peers=1)) as s, open_connections(Y) as y:
        with pytest.raises(PeerUnreachableError, match="already relaying for 1 peers"):
            await keep_relay(y, R.peer_id, (HOST, s.r.port))
        assert s.relay.relayed_peers == {X.peer_id}


async def test_a_peer_that_does_not_relay_refuses_registrations_and_circuits() -> None:
    async with (
        open_connections(R) as r,
        serve_relay(r, RelayConfig(serve=False)) as relay,
        open_connections(X) as x,
    ):
        assert relay.port == 0
        with pytest.raises(PeerUnreachableError, match="does not relay"):
            await keep_relay(x, R.peer_id, (HOST, r.port))
        assert relay.relayed_peers == frozenset()
        # Its port takes no circuits: the bytes that ask for one fail as a handshake.
        x.set_relay_route(D.peer_id, (HOST, r.port))
        with pytest.raises(PeerUnreachableError, match="closed"):
            await x.call(D.peer_id, NOWHERE, "echo", "hi", timeout=10)


async def test_a_peer_that_registers_again_replaces_its_registration() -> None:
    """Its earlier connection may be dead without the relay knowing: the new
    registration takes its place (and its slot), circuits go to the new one."""
    async with relayed_swarm(RelayConfig(max_relayed_peers=1)) as s, trio.open_nursery() as n:
        await n.start(keep_relay, s.x, R.peer_id, (HOST, s.r.port))
        assert s.relay.relayed_peers == {X.peer_id}
        assert await s.d.call(X.peer_id, NOWHERE, "echo", "again", timeout=10) == "again"
        n.cancel_scope.cancel()


async def test_a_relayed_peer_that_leaves_is_unregistered() -> None:
    async with (
        open_connections(R) as r,
        serve_relay(r) as relay,
        open_connections(X) as x,
    ):
        async with trio.open_nursery() as nursery:
            await nursery.start(keep_relay, x, R.peer_id, (HOST, r.port))
            assert relay.relayed_peers == {X.peer_id}
            nursery.cancel_scope.cancel()
        for _ in range(100):  # bounded: the relay sees the lost stream
            if not relay.relayed_peers:
                break
            await trio.sleep(0.01)
        assert relay.relayed_peers == frozenset()


async def test_the_rate_limit_spaces_out_forwarded_bytes(autojump_clock: Any) -> None:
    relay = Relay(RelayConfig(max_bytes_per_second=1000.0))
    start = trio.current_time()
    for _ in range(3):
        await relay._throttle(500)
    # At 1000 bytes/s the third 500-byte chunk starts once the first two are through.
    assert trio.current_time() - start == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_relayed_peers": 0},
        {"max_circuits": 0},
        {"max_bytes_per_second": 0.0},
        {"max_bytes_per_second": float("inf")},
        {"circuit_timeout": -1.0},
        {"keepalive_interval": 0.0},
        {"keepalive_interval": float("nan")},
    ],
)
def test_config_is_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RelayConfig(**kwargs)


async def test_peers_relay_by_default_and_a_client_is_reached_through_one() -> None:
    """``open_peer`` serves relaying (``PeerConfig.relay``): a peer registers
    with another as a service and a third reaches it through the relay."""
    async with (
        open_peer(R, PeerConfig()) as r,
        open_peer(X, PeerConfig(initial_peers=(r.address,), client_mode=True)) as x,
        open_peer(D, PeerConfig(initial_peers=(r.address,), client_mode=True)) as d,
    ):
        assert r.relay is not None and r.relay.port == r.port
        received: list[PeerID] = []

        async def who(stream: Stream) -> None:
            await stream.receive()
            received.append(stream.remote)
            await stream.send(bytes(X.peer_id))

        x.connections.set_handler("who", who)
        await x.start_service(keep_relay, x.connections, R.peer_id, r.endpoint)
        d.connections.set_relay_route(X.peer_id, r.endpoint)
        assert await d.connections.call(X.peer_id, NOWHERE, "who", "?", timeout=10) == bytes(
            X.peer_id
        )
        assert received == [D.peer_id]
        assert r.relay.relayed_peers == {X.peer_id}
        # what it relayed is among the figures the peer exposes
        (relay_bytes,) = [m for m in r.metrics if m.describe()[0].name == "swarm_relay_bytes"]
        assert count_of(relay_bytes) == r.relay.bytes_relayed > 0


KEEPALIVE = RelayConfig(keepalive_interval=0.2)


async def test_an_idle_registration_lives_on_keepalives() -> None:
    """Nothing but pings for many times the silence either side tolerates
    (3 intervals): still registered, and a circuit still reaches X."""
    async with relayed_swarm(KEEPALIVE) as s:
        await trio.sleep(10 * KEEPALIVE.keepalive_interval)
        assert s.relay.relayed_peers == {X.peer_id}
        assert await s.d.call(X.peer_id, NOWHERE, "echo", "idle", timeout=10) == "idle"


async def test_a_relayed_peer_that_falls_silent_is_unregistered() -> None:
    """A registration whose peer sends no keepalive (vanished, or its NAT
    forgot the mapping) ends after 3 silent intervals, freeing its slot."""
    async with (
        open_connections(R) as r,
        serve_relay(r, KEEPALIVE) as relay,
        open_connections(X) as x,
        x.open_stream(R.peer_id, (HOST, r.port), REGISTER) as stream,
    ):
        assert await stream.receive() == ["registered", r.port, KEEPALIVE.keepalive_interval]
        assert relay.relayed_peers == {X.peer_id}
        for _ in range(200):  # bounded: 3 silent intervals are 0.6 s
            if not relay.relayed_peers:
                break
            await trio.sleep(0.05)
        assert relay.relayed_peers == frozenset()


async def test_a_silent_relay_is_left_so_that_another_can_be_found() -> None:
    """A relay that registered X and then says nothing (a machine that
    vanished without closing its connections): X gives up on it after 3
    keepalive intervals with ``PeerUnreachableError``."""
    async with open_connections(R) as r, open_connections(X) as x:

        async def stalled(stream: Stream) -> None:
            await stream.send(["registered", r.port, 0.2])
            await trio.sleep_forever()

        r.set_handler(REGISTER, stalled)
        with trio.fail_after(10), pytest.raises(PeerUnreachableError, match="sent nothing"):
            await keep_relay(x, R.peer_id, (HOST, r.port))


@pytest.mark.parametrize(
    "reply",
    [
        ["registered", 7000, 0.0],
        ["registered", 7000, 1e9],
        ["registered", 7000, "15"],
        ["registered", 0],
        ["registered", 7000, 15.0, 1],
        ["welcome", 7000],
        "registered",
    ],
)
def test_a_malformed_registration_reply_is_a_protocol_error(reply: Any) -> None:
    with pytest.raises(ProtocolError):
        decode_registered(reply, R.peer_id)


def test_old_and_new_registration_replies_decode() -> None:
    assert decode_registered(["registered", 7000], R.peer_id) == (7000, None)
    assert decode_registered(["registered", 7000, 15.0], R.peer_id) == (7000, 15.0)
    with pytest.raises(PeerUnreachableError, match="refused: full"):
        decode_registered(["refused", "full"], R.peer_id)


async def test_a_client_refuses_to_relay() -> None:
    """A peer others cannot dial is never a relay: a configured client (and an
    unreachable peer, ``AsyncPeer.can_relay``) refuses registrations."""
    async with (
        open_peer(R, PeerConfig()) as r,
        open_peer(X, PeerConfig(initial_peers=(r.address,), client_mode=True)) as x,
        open_peer(D, PeerConfig(initial_peers=(r.address,))) as d,
    ):
        assert not x.can_relay() and r.can_relay()
        with pytest.raises(PeerUnreachableError, match="cannot be dialed itself"):
            await keep_relay(d.connections, X.peer_id, x.endpoint)


async def test_a_punch_needs_both_peers_to_know_the_address_others_see_them_at() -> None:
    """Punching itself needs NATs (``test_relayed_members_nat``: on loopback
    each SYN meets a closed port at once); here the refusals: a peer that
    does not know the address others see it at neither asks nor answers."""
    async with (
        open_peer(R, PeerConfig()) as r,
        open_peer(X, PeerConfig(initial_peers=(r.address,))) as x,
    ):
        with pytest.raises(PunchError, match="does not know the address"):
            await x.punch(R.peer_id, r.endpoint)
        x.observed_host = HOST
        with pytest.raises(PunchError, match="refused to punch"):
            await x.punch(R.peer_id, r.endpoint)


@dataclass
class _Seen:
    """A peer's view of its own public address (``_punch.SeenFromOutside``)."""

    observed_host: str | None = HOST


async def _until(condition: Any) -> None:
    """Let the other tasks run until ``condition()`` holds."""
    while not condition():
        await trio.testing.wait_all_tasks_blocked(cushion=0.001)


@pytest.fixture
def jumping_clock() -> trio.testing.MockClock:
    """Real time, plus whatever the test jumps (pytest-trio runs the test on
    a fixture that is a clock)."""
    return trio.testing.MockClock(rate=1.0)


#: Keepalives rarer than any jump of the tests that jump: registrations stay.
RARE_KEEPALIVE = RelayConfig(keepalive_interval=3600.0)
#: Back-off far longer than the tests take between jumps.
BACKOFF = PunchConfig(retry_after=1000.0, max_retry_after=2000.0)


async def test_a_peer_punches_by_itself_one_attempt_at_a_time_and_backs_off(
    jumping_clock: trio.testing.MockClock,
) -> None:
    """Each dial through a relay asks ``AutoPunch`` for a punch: it starts one
    unless one to that peer runs or failed too recently (``retry_after``,
    doubled per failure up to ``max_retry_after``). X refuses to punch here
    (on loopback no punch connects: ``test_punch_nat`` punches through NATs),
    and every failure stays inside the attempt."""
    config = BACKOFF
    async with relayed_swarm(RARE_KEEPALIVE) as s, trio.open_nursery() as nursery:
        auto = AutoPunch(s.d, _Seen(), config)
        await nursery.start(auto.serve)
        refuse = trio.Event()

        async def refuse_to_punch(stream: Stream) -> None:
            await refuse.wait()
            raise ProtocolError("no punching here")

        s.x.set_handler(PUNCH, refuse_to_punch)
        assert await s.d.call(X.peer_id, NOWHERE, "echo", "hi", timeout=10) == "hi"
        assert auto.attempts == 1
        await s.d.check_dial(X.peer_id, NOWHERE)  # while it runs: no second one
        assert auto.attempts == 1
        refuse.set()
        await _until(lambda: auto.failures == 1)
        await s.d.check_dial(X.peer_id, NOWHERE)  # too soon
        assert auto.attempts == 1
        expected = 1
        for wait, starts in [(1000.0, True), (1000.0, False), (1000.0, True), (2000.0, True)]:
            jumping_clock.jump(wait)
            await s.d.check_dial(X.peer_id, NOWHERE)
            expected += starts
            assert auto.attempts == expected, wait
            await _until(lambda: auto.failures == expected)  # noqa: B023
        assert auto.successes == 0
        # the relay still carries the streams
        assert await s.d.call(X.peer_id, NOWHERE, "echo", "still", timeout=10) == "still"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("config", "seen"),
    [(PunchConfig(auto=False), _Seen()), (PunchConfig(), _Seen(observed_host=None))],
    ids=["turned-off", "no-public-address"],
)
async def test_no_automatic_punch_when_off_or_without_a_public_address(
    config: PunchConfig, seen: _Seen
) -> None:
    async with relayed_swarm() as s, trio.open_nursery() as nursery:
        auto = AutoPunch(s.d, seen, config)
        await nursery.start(auto.serve)
        assert await s.d.call(X.peer_id, NOWHERE, "echo", "hi", timeout=10) == "hi"
        assert auto.attempts == 0
        nursery.cancel_scope.cancel()


async def test_the_pool_prefers_a_direct_connection_to_a_relayed_one() -> None:
    """With a direct connection to X (a punched one, in life) and a relayed
    one in the pool, a stream takes the direct one, although the relayed one
    was used last: the relay forwards none of its bytes."""
    async with relayed_swarm() as s:
        started, go = trio.Event(), trio.Event()

        async def wait(stream: Stream) -> None:
            await stream.receive()
            started.set()
            await go.wait()
            await stream.send("done")

        s.x.set_handler("wait", wait)
        async with trio.open_nursery() as nursery:
            # the relayed connection is busy meanwhile, so the call dials directly
            call = functools.partial(s.d.call, timeout=10)
            nursery.start_soon(call, X.peer_id, NOWHERE, "wait", "?")
            await started.wait()
            s.d.set_relay_route(X.peer_id, None)
            direct = (HOST, s.x.port)
            assert await s.d.call(X.peer_id, direct, "echo", "direct", timeout=10) == "direct"
            s.d.set_relay_route(X.peer_id, s.circuit)
            go.set()
        relayed = s.relay.bytes_relayed
        payload = b"\x00" * 100_000
        for _ in range(3):
            assert await s.d.call(X.peer_id, NOWHERE, "echo", payload, timeout=10) == payload
        # at most the tail of the earlier relayed call, counted after it arrived
        assert s.relay.bytes_relayed - relayed < len(payload)
        assert s.relay.circuits_made == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": 0.0},
        {"retry_after": float("inf")},
        {"max_retry_after": -1.0},
        {"retry_after": 10.0, "max_retry_after": 5.0},
    ],
)
def test_punch_config_is_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        PunchConfig(**kwargs)


async def test_a_relay_that_can_no_longer_be_dialed_ends_its_registrations() -> None:
    """A relay found unreachable after a peer registered (``Relay.set_usable``)
    ends the registration at its next keepalive, so the peer looks for a
    relay others can dial."""
    async with relayed_swarm(KEEPALIVE) as s:
        usable = True
        s.relay.set_usable(lambda: usable)
        usable = False
        for _ in range(100):  # bounded: one keepalive interval is 0.2 s
            if not s.relay.relayed_peers:
                break
            await trio.sleep(0.05)
        assert s.relay.relayed_peers == frozenset()
