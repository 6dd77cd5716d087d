"""Dead contacts cost a look-up a few round trips, not RPC timeouts.

``RoundTrips`` (pure) is checked number by number; the DHT itself runs over
real UDP on 127.0.0.1 with a fifth of its nodes stopped and an RPC timeout
longer than the whole test is allowed to take, so an operation that waited
for any dead node's timeout would fail the test.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import trio
from dht_harness import TEST_CONFIG, open_swarm
from kademlia.node import Node

from dht import DHTConfig, DHTValue
from dht._messages import Kind, decode
from dht._records import encode_key, key_id, make_record
from dht._rtt import RoundTrips
from swarm import ConfigError, ManualClock
from swarm._wire import unpack

NOW = 1_700_000_000.0


def test_round_trips_follow_jacobson_karels() -> None:
    rtt = RoundTrips(cap=1.0, floor=0.05, hedge_floor=0.01)
    # nothing measured: as patient as the configured timeout
    assert rtt.timeout("a") == 1.0 and rtt.hedge_after("a") == 1.0
    assert rtt.smoothed() is None
    rtt.sample("a", 0.02)  # srtt 0.02, rttvar 0.01
    assert rtt.smoothed("a") == pytest.approx(0.02)
    assert rtt.timeout("a") == pytest.approx(0.06)  # 0.02 + 4 * 0.01
    assert rtt.hedge_after("a") == pytest.approx(0.04)  # 0.02 + 2 * 0.01
    rtt.sample("a", 0.04)  # rttvar 0.75*0.01 + 0.25*0.02, srtt 7/8*0.02 + 1/8*0.04
    assert rtt.smoothed("a") == pytest.approx(0.0225)
    assert rtt.timeout("a") == pytest.approx(0.0225 + 4 * 0.0125)
    # a contact never heard from gets the estimate of all contacts together
    assert rtt.timeout("b") == pytest.approx(rtt.timeout("a"))


def test_round_trips_clamp_and_keep_contacts_apart() -> None:
    rtt = RoundTrips(cap=1.0, floor=0.1, hedge_floor=0.01, max_contacts=2)
    rtt.sample("near", 0.001)
    assert rtt.timeout("near") == 0.1  # the floor
    assert rtt.hedge_after("near") == pytest.approx(0.01)  # hedge floor
    rtt.sample("far", 5.0)
    assert rtt.timeout("far") == 1.0  # the cap
    assert rtt.hedge_after("far") == 1.0  # never beyond the timeout
    assert rtt.timeout("near") == 0.1  # its own estimate, not the far one's
    rtt.sample("third", 0.001)  # evicts the least recently sampled contact ("near")
    assert rtt.smoothed("near") == rtt.smoothed()
    with pytest.raises(ValueError):
        RoundTrips(cap=0.1, floor=0.2)


def test_resend_after_a_few_round_trips_well_before_the_timeout() -> None:
    rtt = RoundTrips(cap=1.0, floor=0.25, hedge_floor=0.01, resend_floor=0.02)
    # nothing measured: a quarter of the timeout, so a bootstrap sends 3 copies
    assert rtt.resend_after("a") == 0.25
    rtt.sample("a", 0.03)  # srtt 0.03, rttvar 0.015
    assert rtt.timeout("a") == 0.25  # the floor for giving up
    assert rtt.resend_after("a") == pytest.approx(0.09)  # 0.03 + 4 * 0.015: no floor
    rtt.sample("lan", 0.0004)
    assert rtt.resend_after("lan") == 0.02  # the resend floor
    rtt.sample("far", 0.4)
    assert rtt.resend_after("far") == pytest.approx(0.5)  # half the timeout (the cap) at most
    with pytest.raises(ValueError, match="resend_floor"):
        RoundTrips(cap=1.0, floor=0.1, resend_floor=0.2)


async def test_lost_datagrams_cost_resends_not_a_miss() -> None:
    # A timeout of 5 s: without copies, the lost request would fail the ping.
    config = replace(TEST_CONFIG, rpc_timeout=5.0, rpc_timeout_floor=5.0, bootstrap_timeout=5.0)
    async with open_swarm(2, ManualClock(NOW), config=config, seed=3) as swarm:
        asker, live = swarm.nodes
        proto = live._server.proto
        sendto, receive = proto._sendto, proto.datagram_received
        lost: list[Kind] = []

        # ``live`` loses the first request of the asker's that it receives,
        # and its reply to the next one (as a lossy link would)
        def lossy_receive(data: bytes, addr: tuple[str, int]) -> None:
            if addr[1] == asker.port and not lost:
                lost.append(Kind.REQUEST)
                return
            receive(data, addr)

        def lossy_send(data: bytes, addr: tuple[str, int]) -> None:
            if addr[1] == asker.port and len(lost) == 1:
                lost.append(decode(data).kind)
                return
            sendto(data, addr)

        proto.datagram_received = lossy_receive  # type: ignore[method-assign]
        proto._sendto = lossy_send  # type: ignore[method-assign]
        table = asker._server.proto
        contact = Node(bytes(live.peer_id), live.host, live.port)

        async def ping() -> bool:
            ok, _ = await table.call_ping(contact)
            return bool(ok)

        # answered before the 5 s timeout, which the ping would have failed at
        # with its request lost and without copies
        with trio.fail_after(10):
            assert await asker._loop.call(ping)
        assert lost == [Kind.REQUEST, Kind.RESPONSE]
        assert table.resent_requests >= 2  # the ping was sent three times at least
        assert table.failed_requests == 0 and not table._missed
        assert live.peer_id in {c[0] for c in asker.contacts()}


def test_timeout_floor_is_validated() -> None:
    with pytest.raises(ConfigError, match="rpc_timeout_floor"):
        DHTConfig(rpc_timeout=0.5, rpc_timeout_floor=0.6)


async def test_operations_never_wait_for_dead_nodes() -> None:
    # Every timeout is 20 s, so any wait for a dead node outlasts the 15 s bound.
    config = replace(TEST_CONFIG, rpc_timeout=20.0, rpc_timeout_floor=20.0, bootstrap_timeout=20.0)
    clock = ManualClock(NOW)
    rng = random.Random(4)
    async with open_swarm(40, clock, config=config, seed=4) as swarm:
        for victim in rng.sample(swarm.nodes, 8):
            await swarm.stop(victim)
        live = swarm.nodes
        for k in range(6):
            writer, reader = rng.sample(live, 2)
            with trio.fail_after(15):
                assert await writer.store(f"churn{k}", k, NOW + 60)
                assert await reader.get(f"churn{k}") == DHTValue(k, NOW + 60)
        # None of those requests failed yet (it takes 20 s), yet every
        # operation finished: none waited for a dead node's answer.
        assert all(node.stats().failed_requests == 0 for node in live)
        assert sum(node.stats().sent_requests for node in live) > 0


class _Watch:
    """What a DHT node's table makes of one contact: each answer and miss it
    handles, with whether a confirming ping was in flight, and how often it
    removed the contact from its routing table."""

    def __init__(self, table: Any, node: Any) -> None:
        self.handled: list[tuple[bool, bool]] = []
        self.removals = 0
        self._changed = trio.Event()
        contact = (bytes(node.peer_id), node.host, node.port)
        handle, remove = table.handle_call_response, table.router.remove_contact

        def observed(result: Any, other: Node) -> Any:
            if other.id == contact[0]:
                self.handled.append((bool(result[0]), contact in table._missed))
                self._changed.set()
            return handle(result, other)

        def removed(other: Node) -> None:
            if other.id == contact[0]:
                self.removals += 1
                self._changed.set()
            remove(other)

        table.handle_call_response = observed
        table.router.remove_contact = removed

    def misses(self) -> int:
        return sum(not answered for answered, _ in self.handled)

    def confirmed(self) -> bool:
        """Answered a confirming ping."""
        return (True, True) in self.handled

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()
            self._changed = trio.Event()


async def test_a_missed_request_keeps_a_live_contact_and_a_dead_one_is_evicted() -> None:
    config = replace(TEST_CONFIG, rpc_timeout=2.0, rpc_timeout_floor=2.0, bootstrap_timeout=5.0)
    async with open_swarm(3, ManualClock(NOW), seed=7, config=config) as swarm:
        writer, live, dead = swarm.nodes
        # ``live`` loses its replies to ``writer`` (as a lossy link would)
        # until one of the writer's requests has missed, every copy of it
        proto = live._server.proto
        sendto = proto._sendto
        lost: list[object] = []
        table = writer._server.proto
        watch_live, watch_dead = _Watch(table, live), _Watch(table, dead)
        # replies may be MAC'd under the key ``live`` shares with ``writer``
        keys = table.sessions.verifying_key

        def lossy(data: bytes, addr: tuple[str, int]) -> None:
            to_writer = addr[1] == writer.port and not watch_live.misses()
            if to_writer and decode(data, mac_keys=keys).kind is Kind.RESPONSE:
                lost.append(addr)
                return
            sendto(data, addr)

        proto._sendto = lossy  # type: ignore[method-assign]
        await swarm.stop(dead)
        await writer.store("lossy", 1, NOW + 60)
        with trio.fail_after(30):
            await watch_live.until(watch_live.confirmed)
            await watch_dead.until(lambda: watch_dead.removals > 0)
        assert lost, "the store reached the live node and its replies were lost"
        assert watch_live.removals == 0  # one missed request and a confirming ping
        assert watch_dead.misses() >= 2  # missed the store and the ping
        contacts = {c[0] for c in writer.contacts()}
        assert live.peer_id in contacts and dead.peer_id not in contacts
        failed = {c[0] for c in table._failed}
        assert dead.peer_id in failed and live.peer_id not in failed
        assert await writer.get("lossy") == DHTValue(1, NOW + 60)


async def test_requests_lost_together_are_one_miss() -> None:
    """Two requests in flight together, both lost (a loss burst), cost their
    contact one confirming ping, not its place in the table: the second miss
    comes while the first one's ping is in flight."""
    config = replace(TEST_CONFIG, rpc_timeout=2.0, rpc_timeout_floor=2.0, bootstrap_timeout=5.0)
    async with open_swarm(2, ManualClock(NOW), seed=5, config=config) as swarm:
        asker, live = swarm.nodes
        proto = live._server.proto
        receive = proto.datagram_received
        dropped: list[bytes] = []

        def lossy_receive(data: bytes, addr: tuple[str, int]) -> None:
            if addr[1] == asker.port and _asks(data, "find_node"):
                dropped.append(data)  # every copy of both requests; pings get through
                return
            receive(data, addr)

        proto.datagram_received = lossy_receive  # type: ignore[method-assign]
        table = asker._server.proto
        watch = _Watch(table, live)
        contact = Node(bytes(live.peer_id), live.host, live.port)

        async def ask_twice() -> list[Any]:
            return list(
                await asyncio.gather(
                    table.call_find_node(contact, Node(b"a" * 32)),
                    table.call_find_node(contact, Node(b"b" * 32)),
                )
            )

        with trio.fail_after(30):
            assert [ok for ok, _ in await asker._loop.call(ask_twice)] == [False, False]
            await watch.until(lambda: watch.misses() == 2 and watch.handled[-1][0])
        assert len(dropped) >= 2
        assert watch.removals == 0 and watch.confirmed()
        assert live.peer_id in {c[0] for c in asker.contacts()}
        assert not table._failed and not table._missed


def _request(data: bytes) -> list[Any] | None:
    """A datagram's request body ``[method, args]``, None if it is none."""
    try:
        body = unpack(unpack(data)[4])
    except (ValueError, IndexError, TypeError):
        return None
    return body if isinstance(body, list) and len(body) == 2 else None


def _asks(data: bytes, method: str) -> bool:
    """Whether a datagram is a request for ``method``."""
    body = _request(data)
    return body is not None and body[0] == method


async def test_a_request_sent_again_fails_once_when_the_node_closes() -> None:
    """Each copy of a request is outstanding under its own message id; closing
    the protocol still fails the request once, not once per copy."""
    # a copy after 1.25 s (a quarter of the timeout), long before its deadline
    config = replace(TEST_CONFIG, rpc_timeout=5.0, rpc_timeout_floor=5.0, bootstrap_timeout=5.0)
    async with open_swarm(1, ManualClock(NOW), config=config) as swarm:
        node = swarm.nodes[0]
        proto = node._server.proto
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as silent:
            await silent.bind(("127.0.0.1", 0))  # receives, never answers
            replies: list[Any] = []
            await node._loop.run_sync(
                proto.request, silent.getsockname(), "ping", [], None, replies.append
            )
            for _ in range(2):  # the request and one copy of it
                await silent.recv(2048)
            assert proto.resent_requests >= 1 and len(proto._outstanding) >= 2
            await node._loop.run_sync(proto.close)
            assert replies == [(False, None)] and not proto._outstanding


def _first_page_request(data: bytes, dkey: bytes) -> bool:
    """Whether a datagram asks for the first page of ``dkey``'s records."""
    body = _request(data)
    return body is not None and body[0] == "find_value" and body[1] == [dkey]


async def test_a_late_answer_from_the_closest_node_is_read_whole() -> None:
    # A timeout of 5 s: the lost request is sent again long before it fails,
    # and the answer to the copy comes after the look-up counted it late.
    config = replace(TEST_CONFIG, rpc_timeout=5.0, rpc_timeout_floor=5.0, bootstrap_timeout=5.0)
    async with open_swarm(6, ManualClock(NOW), config=config, seed=3) as swarm:
        reader, *others = swarm.nodes
        dkey = key_id(encode_key("crowded"))
        holder = min(others, key=lambda n: int.from_bytes(bytes(n.peer_id)) ^ int.from_bytes(dkey))
        # the closest node alone holds the key (as just after a partition):
        # sixty sub-keys, several pages of a find_value reply
        for i in range(60):
            record = make_record(
                "crowded", {"i": i, "pad": "x" * 20}, NOW + 60, subkey=i, limits=config.limits
            )
            assert holder._server.storage.store(record)
        proto = holder._server.proto
        receive = proto.datagram_received
        lost: list[bytes] = []

        def lossy_receive(data: bytes, addr: tuple[str, int]) -> None:
            if addr[1] == reader.port and not lost and _first_page_request(data, dkey):
                lost.append(data)
                return
            receive(data, addr)

        proto.datagram_received = lossy_receive  # type: ignore[method-assign]
        with trio.fail_after(10):
            found = await reader.get("crowded")
        assert lost  # the holder's answer was late
        assert found is not None
        assert {k: v.value["i"] for k, v in found.value.items()} == {i: i for i in range(60)}
