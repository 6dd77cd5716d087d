"""The DHT over real UDP on 127.0.0.1: many nodes in one process.

Expiration is driven by a shared ManualClock, never by sleeping.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import trio
import trio.testing
from dht_harness import TEST_CONFIG, open_swarm
from kademlia.node import Node

from dht import DHTConfig, DHTNode, DHTValue, open_dht_node, owner_marker
from dht._protocol import _MAX_RESENDS
from dht._records import Record, make_record
from swarm import (
    BootstrapError,
    ClosedError,
    ConfigError,
    Identity,
    ManualClock,
    PeerID,
    RecordRejectedError,
    RejectReason,
)

NOW = 1_700_000_000.0
SWARM_SIZE = 50


async def _get_everywhere(nodes: list, key: str, **kwargs: object) -> list[DHTValue | None]:
    # All nodes share one process and one core here: a bounded number of
    # concurrent look-ups keeps the simulation from starving its own RPC timers.
    results: list[DHTValue | None] = [None] * len(nodes)
    limiter = trio.CapacityLimiter(4)

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await nodes[i].get(key, **kwargs)

    async with trio.open_nursery() as nursery:
        for i in range(len(nodes)):
            nursery.start_soon(one, i)
    return results


async def test_record_stored_anywhere_is_read_everywhere() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(SWARM_SIZE, clock) as swarm:
        rng = random.Random(1)
        for k in range(3):
            writer = rng.choice(swarm.nodes)
            assert await writer.store(f"key{k}", {"k": k, "blob": b"\x00" * 100}, NOW + 60)
            results = await _get_everywhere(swarm.nodes, f"key{k}")
            assert all(
                r is not None and r.value == {"k": k, "blob": b"\x00" * 100} for r in results
            ), results
            assert {r.expiration_time for r in results if r} == {NOW + 60}


async def test_a_store_here_wakes_a_waiter_and_the_local_read_has_it() -> None:
    """``wait_for_store`` returns when a record under its key arrives at this
    node from another; ``get_local`` reads this node's storage alone, with no
    network; a waiter that gave up leaves nothing behind."""
    clock = ManualClock(NOW)
    async with open_swarm(3, clock) as swarm:
        writer, reader, _ = swarm.nodes
        assert reader.get_local("lobby") is None
        with trio.move_on_after(0.05):
            await reader.wait_for_store("lobby")  # nothing comes: gives up
        assert not reader._stored
        async with trio.open_nursery() as nursery:
            woken = trio.Event()

            async def wait() -> None:
                await reader.wait_for_store("lobby")
                woken.set()

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            # a swarm under k nodes: the writer's store reaches every one
            assert await writer.store("lobby", "me", NOW + 60, subkey="a")
            with trio.fail_after(10):
                await woken.wait()
        local = reader.get_local("lobby")
        assert local is not None and local.value["a"].value == "me"
        assert reader.get_local("another key") is None


async def test_ten_writers_subkeys_merge() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(SWARM_SIZE, clock, seed=2) as swarm:
        writers = swarm.nodes[5:15]
        for i, node in enumerate(writers):
            subkey = owner_marker(node.peer_id)
            assert await node.store("run.progress", {"epoch": i}, NOW + 30 + i, subkey=subkey)
        expected = {owner_marker(n.peer_id): {"epoch": i} for i, n in enumerate(writers)}
        for result in await _get_everywhere(swarm.nodes, "run.progress"):
            assert result is not None
            assert {k: v.value for k, v in result.value.items()} == expected
            assert result.expiration_time == NOW + 39


async def test_a_store_to_a_few_replicas_reaches_the_closest_and_every_reader() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(SWARM_SIZE, clock, seed=3) as swarm:
        writers = swarm.nodes[:10]
        for i, node in enumerate(writers):
            subkey = owner_marker(node.peer_id)
            assert await node.store("few", i, NOW + 30, subkey=subkey, replicas=4)
        # the 4 closest to the key (as everyone knows all 50 nodes), and each
        # writer that is closer than its own 4th closest contact, hold copies
        target = Node(make_record("few", 0, NOW + 1, limits=TEST_CONFIG.limits).key_id)
        by_distance = sorted(swarm.nodes, key=lambda n: Node(n.peer_id).distance_to(target))
        holders = [n for n in swarm.nodes if n.stored_key_count()]
        assert set(by_distance[:4]) <= set(holders)
        assert len(holders) < 20  # not the k = 20 closest
        expected = {owner_marker(n.peer_id): i for i, n in enumerate(writers)}
        for result in await _get_everywhere(swarm.nodes, "few"):
            assert result is not None
            assert {k: v.value for k, v in result.value.items()} == expected
        with pytest.raises(ValueError, match="at least 1"):
            await writers[0].store("few", 0, NOW + 30, replicas=0)


async def test_later_expiration_wins_and_latest_sees_it() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(20, clock, seed=3) as swarm:
        a, b = swarm.nodes[3], swarm.nodes[11]
        await a.store("k", "old", NOW + 100)
        await b.store("k", "new", NOW + 200)
        assert not await a.store("k", "older", NOW + 50)  # every holder keeps "new"
        for result in await _get_everywhere(swarm.nodes, "k", latest=True):
            assert result == DHTValue("new", NOW + 200)


async def test_records_expire_by_the_injected_clock() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(20, clock, seed=4) as swarm:
        node = swarm.nodes[7]
        await node.store("short", 1, NOW + 10)
        await node.store("long", 2, NOW + 1000)
        await node.store("mixed", "a", NOW + 10, subkey="a")
        await node.store("mixed", "b", NOW + 1000, subkey="b")
        assert (await swarm.nodes[0].get("short")) == DHTValue(1, NOW + 10)
        clock.advance(10)
        for result in await _get_everywhere(swarm.nodes, "short"):
            assert result is None
        mixed = await swarm.nodes[1].get("mixed")
        assert mixed is not None and list(mixed.value) == ["b"]
        assert (await swarm.nodes[2].get("long")) == DHTValue(2, NOW + 1000)
        assert sum(n.stored_key_count() for n in swarm.nodes) > 0
        clock.advance(1000)
        assert sum(n.stored_key_count() for n in swarm.nodes) == 0


async def test_writer_side_rejections_are_typed() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(5, clock) as swarm:
        node, other = swarm.nodes[0], swarm.nodes[1]
        cases = [
            (dict(key="k", value=b"x" * 10_000, expiration_time=NOW + 10), RejectReason.OVERSIZED),
            (dict(key="k", value=1, expiration_time=NOW - 1), RejectReason.EXPIRED),
            (dict(key="k", value=1, expiration_time=NOW + 10**7), RejectReason.TOO_FAR_IN_FUTURE),
            (
                dict(
                    key="k", value=1, expiration_time=NOW + 10, subkey=owner_marker(other.peer_id)
                ),
                RejectReason.NOT_OWNER,
            ),
        ]
        for kwargs, reason in cases:
            with pytest.raises(RecordRejectedError) as e:
                await node.store(**kwargs)  # type: ignore[arg-type]
            assert e.value.reason is reason
        assert sum(n.stored_key_count() for n in swarm.nodes) == 0


async def test_storing_nodes_and_readers_reject_forged_records() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(SWARM_SIZE, clock, seed=5) as swarm:
        victim = swarm.nodes[10]
        key = f"run.progress{owner_marker(victim.peer_id)}"
        await victim.store(key, "honest", NOW + 100)
        honest = await swarm.nodes[0].get(key, latest=True)
        assert honest == DHTValue("honest", NOW + 100)

        # A malicious writer sends forged records straight to every node's store RPC.
        mallory = Identity.from_seed(b"M" * 32)
        genuine = make_record(
            key, "honest", NOW + 100, signer=victim.identity, limits=TEST_CONFIG.limits
        )
        forged = [
            Record(
                genuine.key,
                None,
                b"\xa4evil",
                NOW + 500,
                mallory.public_key,
                mallory.sign(Record(genuine.key, None, b"\xa4evil", NOW + 500).signing_payload()),
            ),
            Record(
                genuine.key, None, genuine.value, NOW + 500, genuine.public_key, genuine.signature
            ),  # replay with a new expiration
            Record(b"x" * 300, None, b"\x01", NOW + 10),  # oversized key
            Record(b"far", None, b"\x01", NOW + 10**7),  # far-future expiration
        ]
        attacker = swarm.nodes[1]
        proto = attacker._server.proto
        from kademlia.node import Node

        async def send_all() -> list[bool]:
            outcomes = []
            for target in swarm.nodes:
                node = Node(target.peer_id, "127.0.0.1", target.port)
                for record in forged:
                    ok, kept = await proto.call_store(node, record)
                    outcomes.append(bool(ok and kept))
            return outcomes

        assert not any(await attacker._loop.call(send_all))
        for result in await _get_everywhere(swarm.nodes, key, latest=True):
            assert result == DHTValue("honest", NOW + 100)
        assert await swarm.nodes[3].get("far") is None

        # A compromised storing node serves a forged record from its storage:
        # readers verify and drop it.
        bad_node = swarm.nodes[20]
        entry_key = genuine.key_id
        from dht._storage import _Entry

        bad_node._server.storage._entries[entry_key] = _Entry({None: forged[0]})
        for result in await _get_everywhere(swarm.nodes, key, latest=True):
            assert result == DHTValue("honest", NOW + 100)


async def test_records_survive_30_percent_of_nodes_stopping() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(SWARM_SIZE, clock, seed=6) as swarm:
        rng = random.Random(6)
        keys = [f"survivor{i}" for i in range(8)]
        for i, key in enumerate(keys):
            assert await rng.choice(swarm.nodes).store(key, i, NOW + 600)
        victims = rng.sample(swarm.nodes, int(0.3 * SWARM_SIZE))
        for victim in victims:
            await swarm.stop(victim)
        survivors = swarm.nodes
        assert len(survivors) == SWARM_SIZE - len(victims)
        # Each survivor reads every key at once, so the RPC timeouts spent on
        # stopped nodes overlap instead of adding up.
        found: dict[tuple[int, str], DHTValue | None] = {}
        limiter = trio.CapacityLimiter(8)

        async def read(n: int, key: str) -> None:
            async with limiter:
                found[n, key] = await survivors[n].get(key)

        async with trio.open_nursery() as nursery:
            for n in range(len(survivors)):
                for key in keys:
                    nursery.start_soon(read, n, key)
        for (_, key), result in found.items():
            assert result == DHTValue(keys.index(key), NOW + 600), key


async def test_restart_with_same_identity_keeps_node_id(tmp_path: os.PathLike[str]) -> None:
    clock = ManualClock(NOW)
    path = os.path.join(str(tmp_path), "peer.key")
    async with open_swarm(10, clock, seed=7) as swarm:
        first = await swarm.add(Identity.load_or_create(path))
        first_id, port = first.peer_id, first.port
        await first.store("before", 1, NOW + 100)
        await swarm.stop(first)
        again = await swarm.add(Identity.load_or_create(path), port=port)
        assert again.peer_id == first_id
        assert await again.get("before") == DHTValue(1, NOW + 100)
        assert await swarm.nodes[0].get("before", latest=True) == DHTValue(1, NOW + 100)


async def test_bootstrap_errors() -> None:
    # An unreachable bootstrap address: no node listens on this freshly freed port.
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    dead_port = sock.getsockname()[1]
    sock.close()
    config = DHTConfig(rpc_timeout=0.3, bootstrap_timeout=2.0)
    with pytest.raises(BootstrapError, match="no initial peer answered"):
        async with open_dht_node(initial_peers=[f"127.0.0.1:{dead_port}"], config=config):
            pass
    with pytest.raises(ConfigError, match="HOST:PORT"):
        async with open_dht_node(initial_peers=["not-an-address"], config=config):
            pass


async def test_bootstrap_pings_again_until_an_initial_peer_answers() -> None:
    # The initial peer starts only after several RPC timeouts have passed (a
    # busy machine, a lost datagram): the newcomer keeps asking until
    # bootstrap_timeout, and joins.
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    config = DHTConfig(rpc_timeout=0.2, bootstrap_timeout=5.0)
    late_start = trio.Event()

    async def initial_peer_comes_late() -> None:
        await trio.sleep(1.0)  # five RPC timeouts
        async with open_dht_node(Identity.from_seed(b"L" * 32), port=port, config=config):
            late_start.set()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initial_peer_comes_late)
        async with open_dht_node(initial_peers=[f"127.0.0.1:{port}"], config=config) as node:
            assert late_start.is_set()
            assert Identity.from_seed(b"L" * 32).peer_id in {c[0] for c in node.contacts()}
        nursery.cancel_scope.cancel()


async def test_dead_bootstrap_peer_does_not_matter_once_joined() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(12, clock, seed=8) as swarm:
        bootstrap = swarm.nodes[0]
        late = await swarm.add()
        await swarm.stop(bootstrap)
        await late.store("after", "ok", NOW + 50)
        for result in await _get_everywhere(swarm.nodes, "after"):
            assert result == DHTValue("ok", NOW + 50)


async def test_bootstrap_succeeds_when_the_initial_peer_answers_but_its_contacts_are_dead() -> None:
    # The initial peer lists 20 contacts that never answer (frozen or gone
    # processes): crawling through them outlasts bootstrap_timeout, but the
    # initial peer did answer, so joining must succeed.
    config = DHTConfig(rpc_timeout=0.2, bootstrap_timeout=0.4)
    silent = [trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) for _ in range(20)]
    try:
        async with open_dht_node(Identity.from_seed(b"S" * 32), config=config) as seed_node:
            for i, sock in enumerate(silent):
                await sock.bind(("127.0.0.1", 0))
                contact = Identity.from_seed(bytes([i]) * 32).peer_id
                seed_node._server.proto.router.add_contact(
                    Node(bytes(contact), "127.0.0.1", sock.getsockname()[1])
                )
            async with open_dht_node(initial_peers=[seed_node.address], config=config) as late:
                assert seed_node.peer_id in {c[0] for c in late.contacts()}
    finally:
        for sock in silent:
            sock.close()


async def test_a_client_node_reads_and_writes_but_is_never_kept_as_a_contact() -> None:
    clock = ManualClock(NOW)
    async with open_swarm(8, clock, seed=9) as swarm:
        await swarm.nodes[5].store("from-server", "s", NOW + 50)
        client_config = replace(TEST_CONFIG, client_mode=True)
        async with open_dht_node(
            initial_peers=[swarm.nodes[0].address], config=client_config, clock=clock
        ) as client:
            assert await client.store("from-client", "c", NOW + 50)
            assert await client.get("from-server") == DHTValue("s", NOW + 50)
            for result in await _get_everywhere(swarm.nodes, "from-client"):
                assert result == DHTValue("c", NOW + 50)
            assert client.stored_key_count() == 0  # nobody would ask it
            # It answers no request: a ping times out (and by then, any ping-back
            # that its own requests had caused would long have added it).
            server = swarm.nodes[0]
            answer = await server._loop.call(
                server._server.proto.ping_address, (client.host, client.port)
            )
            assert answer is None  # every copy of the ping was ignored
            assert 1 <= client._server.proto.ignored_requests <= 1 + _MAX_RESENDS
            for node in swarm.nodes:
                assert client.peer_id not in {c[0] for c in node.contacts()}


async def test_two_client_nodes_that_punch_at_once_answer_and_keep_each_other() -> None:
    """Two client nodes (behind NATs, in life) that punch towards each other
    at the same moment (``DHTNode.punch``) answer each other's requests and
    keep each other as contacts, so they read and write records with no
    full node left; to nobody else do they answer. On loopback no NAT drops
    the first pings: ``test_punch_nat`` punches through real ones."""
    clock = ManualClock(NOW)
    client_config = replace(TEST_CONFIG, client_mode=True)
    async with (
        open_dht_node(config=client_config, clock=clock) as a,
        open_dht_node(config=client_config, clock=clock) as b,
        open_dht_node(config=TEST_CONFIG, clock=clock) as other,
    ):
        results: dict[str, bool] = {}

        async def punch(name: str, node: DHTNode, to: DHTNode) -> None:
            results[name] = await node.punch((to.host, to.port), to.peer_id, timeout=5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(punch, "a", a, b)
            nursery.start_soon(punch, "b", b, a)
        assert results == {"a": True, "b": True}
        assert {c[0] for c in a.contacts()} == {b.peer_id}
        assert {c[0] for c in b.contacts()} == {a.peer_id}
        assert await a.store("punched", "a", NOW + 50)
        assert await b.get("punched") == DHTValue("a", NOW + 50)
        assert await other.ping((a.host, a.port)) is None  # still a client to the rest


async def test_a_punch_the_other_node_does_not_take_part_in_fails_and_changes_nothing() -> None:
    clock = ManualClock(NOW)
    client_config = replace(TEST_CONFIG, client_mode=True)
    async with (
        open_dht_node(config=client_config, clock=clock) as a,
        open_dht_node(config=client_config, clock=clock) as b,
    ):
        assert not await a.punch((b.host, b.port), b.peer_id, timeout=1)
        assert a.contacts() == [] and b.contacts() == []
        # a answers b no more than before
        assert await b.ping((a.host, a.port)) is None


async def test_a_call_in_flight_when_its_node_closes_raises_closed_error() -> None:
    """A punch still waiting for answers when its node closes (a peer that
    finishes while serving another's punch request) fails with ``ClosedError``,
    which the connection's handler boundary catches, not with asyncio's
    ``CancelledError``, which no ``except Exception`` does and which once
    crashed a peer at the end of its run."""
    clock = ManualClock(NOW)
    client_config = replace(TEST_CONFIG, client_mode=True)
    outcome: list[BaseException | bool] = []
    b_open = trio.Event()
    a_done = trio.Event()
    b_address: list[tuple[tuple[str, int], PeerID]] = []

    async def punch(node: DHTNode, started: trio.Event) -> None:
        started.set()
        try:
            outcome.append(await node.punch(*b_address[0], timeout=30))
        except BaseException as e:
            outcome.append(e)

    async def run_a() -> None:
        await b_open.wait()
        # a's own asyncio loop (not b's), which closes with a, as a peer's does
        async with (
            trio.open_nursery() as nursery,
            open_dht_node(config=client_config, clock=clock) as a,
        ):
            started = trio.Event()
            nursery.start_soon(punch, a, started)
            # the punch now waits on a's asyncio loop (b answers nothing): it
            # went on into the call before the event woke this task
            await started.wait()
        a_done.set()

    async def run_b() -> None:
        async with open_dht_node(config=client_config, clock=clock) as b:
            b_address.append(((b.host, b.port), b.peer_id))
            b_open.set()
            await a_done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_b)
        nursery.start_soon(run_a)
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome


async def test_a_client_left_without_contacts_joins_again_through_its_initial_peer() -> None:
    """A client (a peer behind a NAT) whose one contact left a request and
    the confirming ping unanswered (busy: here it answers nothing for a
    moment) drops it and has no contact left; nobody adds a client back. Its next read joins again
    through its initial peer instead of reading nothing for good."""
    clock = ManualClock(NOW)
    client = replace(TEST_CONFIG, client_mode=True)
    async with open_dht_node(config=TEST_CONFIG, clock=clock) as full:
        initial = [(full.host, full.port)]
        async with (
            open_dht_node(config=client, clock=clock, initial_peers=initial) as a,
            open_dht_node(config=client, clock=clock, initial_peers=initial) as b,
        ):
            assert await a.store("k", "v", NOW + 60)
            full.set_client_mode(True)  # answers nothing
            assert await b.get("k") is None
            for _ in range(200):  # its confirming ping goes unanswered too: dropped
                if not b.contacts():
                    break
                await trio.sleep(0.05)
            assert b.contacts() == []
            full.set_client_mode(False)
            assert await b.get("k") == DHTValue("v", NOW + 60)
            assert [c[0] for c in b.contacts()] == [full.peer_id]


def test_config_validation_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="bootstrap_timeout"):
        DHTConfig(rpc_timeout=5, bootstrap_timeout=1)
