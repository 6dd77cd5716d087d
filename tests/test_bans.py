"""Local bans: growth, cap, expiry and forgetting (pure), and their wiring into
the connection layer and the DHT (real sockets on 127.0.0.1)."""

from __future__ import annotations

from contextlib import suppress

import pytest
import torch
import trio
from kademlia.node import Node

from averaging import AllReduceConfig, AllReduceResult, Group, GroupMember, all_reduce
from averaging._allreduce import serve_allreduce
from dht import DHTConfig, open_dht_node, owner_marker
from dht._records import Record, make_record
from swarm import ConfigError, Identity, ManualClock, PeerUnreachableError, Stream
from swarm._bans import BanConfig, BanList
from swarm._connections import open_connections
from swarm._handshake import Handshake
from swarm._peer import PeerConfig, open_peer


def test_first_offence_bans_for_the_base_period_then_expires() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=50.0), clock=clock)
    assert not bans.is_banned("a")
    assert bans.offend("a", "bad frame") == 10.0
    assert bans.is_banned("a") and not bans.is_banned("b")
    assert bans.reason("a") == "bad frame"
    clock.advance(9.999)
    assert bans.is_banned("a")
    clock.advance(0.001)
    assert not bans.is_banned("a")
    assert bans.reason("a") is None
    assert bans.remaining("a") == 0.0


def test_repeated_offences_double_the_ban_up_to_the_cap() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=1000.0), clock=clock)
    periods = []
    for _ in range(6):
        periods.append(bans.offend("a", "again"))
        clock.advance(bans.remaining("a"))  # serve the ban, then offend again
        assert not bans.is_banned("a")
    assert periods == [10.0, 20.0, 40.0, 80.0, 100.0, 100.0]
    assert bans.offences("a") == 6


def test_good_behaviour_is_forgiven_after_forget_after() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0, forget_after=50.0), clock=clock)
    bans.offend("a", "x")
    bans.offend("a", "x")  # 20 s from now
    clock.advance(20.0 + 49.0)
    assert bans.offences("a") == 2
    assert bans.offend("a", "x") == 40.0  # still remembered
    clock.advance(40.0 + 50.0)
    assert bans.offences("a") == 0
    assert bans.offend("a", "x") == 10.0  # a fresh start


def test_an_offence_during_a_ban_extends_it_from_now() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=100.0), clock=clock)
    bans.offend("a", "x")
    clock.advance(5.0)
    bans.offend("a", "x")
    assert bans.remaining("a") == 20.0


def test_memory_is_bounded() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=10.0, cap=10.0, forget_after=0.0, max_entries=100), clock=clock)
    for i in range(1000):
        clock.advance(0.01)
        bans.offend(i, "flood")
    assert len(bans) <= 100
    assert bans.is_banned(999)  # the newest are kept


def test_base_zero_disables_banning() -> None:
    bans = BanList(BanConfig(base=0.0), clock=ManualClock())
    assert bans.offend("a", "x") == 0.0
    assert not bans.is_banned("a")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": -1.0},
        {"base": 10.0, "cap": 5.0},
        {"forget_after": float("inf")},
        {"max_entries": 0},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BanConfig(**kwargs)  # type: ignore[arg-type]


# -- wiring: real sockets on 127.0.0.1; the ban lists run on a ManualClock ------

A = Identity.from_seed(b"a" * 32)
B = Identity.from_seed(b"b" * 32)
HOST = "127.0.0.1"


async def echo(stream: Stream) -> None:
    await stream.send(await stream.receive())


async def _garbage_after_handshake(identity: Identity, port: int) -> None:
    """Dial ``port``, complete a real handshake as ``identity`` (proving its
    id), then send bytes that do not authenticate; return once the listener
    has closed the connection."""
    sock = await trio.open_tcp_stream(HOST, port)
    with sock.socket:
        handshake = Handshake(identity, initiator=True)
        out = handshake.start()
        while not handshake.complete:
            await sock.send_all(out)
            out = handshake.receive_data(await sock.receive_some(4096))
        await sock.send_all(out + bytes(range(64)))
        with trio.fail_after(10), suppress(trio.BrokenResourceError):
            while await sock.receive_some(4096):
                pass


async def test_connection_protocol_error_bans_the_proven_peer_both_ways() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=30.0, cap=120.0), clock=clock)
    async with open_connections(A, bans=bans) as a, open_connections(B) as b:
        a.set_handler("echo", echo)
        b.set_handler("echo", echo)
        assert await b.call(A.peer_id, (HOST, a.port), "echo", 1, timeout=5) == 1

        await _garbage_after_handshake(B, a.port)
        assert bans.is_banned(B.peer_id) and bans.remaining(B.peer_id) == 30.0
        assert "authentication" in (bans.reason(B.peer_id) or "")
        # Inbound: b still proves who it is, and is refused right after.
        with pytest.raises(PeerUnreachableError):
            await b.call(A.peer_id, (HOST, a.port), "echo", 2, timeout=5)
        # Outbound: a does not even dial it.
        with pytest.raises(PeerUnreachableError, match="banned"):
            await a.call(B.peer_id, (HOST, b.port), "echo", 3, timeout=5)

        clock.advance(30.0)  # the ban expires
        assert await b.call(A.peer_id, (HOST, a.port), "echo", 4, timeout=5) == 4
        assert await a.call(B.peer_id, (HOST, b.port), "echo", 5, timeout=5) == 5

        await _garbage_after_handshake(B, a.port)  # a repeat offence: twice as long
        assert bans.remaining(B.peer_id) == 60.0


async def test_a_failure_before_the_remote_proved_its_id_bans_nobody() -> None:
    bans = BanList(clock=ManualClock())
    async with open_connections(A, bans=bans) as a:
        sock = await trio.open_tcp_stream(HOST, a.port)
        with sock.socket:
            await sock.send_all(b"\x00\x10" + bytes(16))  # not a handshake message
            with trio.fail_after(10), suppress(trio.BrokenResourceError):
                while await sock.receive_some(4096):
                    pass
    assert len(bans) == 0


async def test_nan_in_an_allreduce_part_bans_its_sender() -> None:
    clock = ManualClock(0.0)
    bans = [BanList(clock=clock), BanList(clock=clock)]
    async with (
        open_connections(A, bans=bans[0]) as a,
        open_connections(B, bans=bans[1]) as b,
    ):
        nets = [a, b]
        for net in nets:
            serve_allreduce(net)
        members = tuple(GroupMember(net.peer_id, HOST, net.port) for net in nets)
        tensors = [torch.ones(200), torch.zeros(200)]
        tensors[0][150] = float("nan")  # in part 1, which b reduces
        config = AllReduceConfig(sender_timeout=2.0, reducer_timeout=4.0, round_timeout=15.0)
        results: dict[int, AllReduceResult] = {}

        async def member(i: int) -> None:
            group = Group(b"g", members, i)
            results[i] = await all_reduce(nets[i], group, [tensors[i]], config=config)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(member, i)
    assert results[1].failed_senders == {0}
    assert bans[1].is_banned(A.peer_id) and "NaN" in (bans[1].reason(A.peer_id) or "")
    assert not bans[0].is_banned(B.peer_id)
    assert torch.isfinite(tensors[1]).all() and torch.isfinite(tensors[0][:100]).all()


async def test_dht_drops_datagrams_of_a_node_that_sent_a_forged_record() -> None:
    clock = ManualClock(0.0)
    bans = BanList(BanConfig(base=30.0), clock=clock)
    config = DHTConfig(rpc_timeout=0.5, bootstrap_timeout=1.0)
    async with (
        open_dht_node(A, config=config, bans=bans) as honest,
        open_dht_node(B, config=config) as forger,
    ):
        target = Node(A.peer_id, HOST, honest.port)
        now = honest.now()
        genuine = make_record(
            f"k{owner_marker(A.peer_id)}", "mine", now + 60, signer=A, limits=config.limits
        )
        forged_unsigned = Record(genuine.key, None, b"\xa4evil", now + 60)
        forged = Record(
            genuine.key,
            None,
            b"\xa4evil",
            now + 60,
            B.public_key,
            B.sign(forged_unsigned.signing_payload()),
        )
        proto = forger._server.proto

        async def ping() -> bool:
            ok, _ = await proto.call_ping(target)
            return bool(ok)

        assert await forger._loop.call(ping)
        ok, kept = await forger._loop.call(proto.call_store, target, forged)
        assert ok and not kept  # refused, and the forger is banned
        assert bans.is_banned(B.peer_id) and "forged" in (bans.reason(B.peer_id) or "")
        dropped = honest.dropped_datagrams
        assert not await forger._loop.call(ping)  # no reply while banned
        # the ping, and maybe already the forger's ping to confirm the miss
        assert honest.dropped_datagrams > dropped
        clock.advance(30.0)
        assert await forger._loop.call(ping)
        # A banned address is dropped too, whatever id its datagrams prove.
        bans.offend((HOST, forger.port), "banned by address")
        assert not await forger._loop.call(ping)


async def test_a_peer_shares_one_ban_list_between_connections_and_dht() -> None:
    async with open_peer(A, PeerConfig(bans=BanConfig(base=5.0))) as peer:
        assert peer.dht.bans is peer.connections.bans
        assert peer.connections.bans.config.base == 5.0
        peer.connections.report_offence(B.peer_id, "test")
        assert peer.dht.bans.is_banned(B.peer_id)
