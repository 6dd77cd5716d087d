"""Automatic hole punching behind real NATs (``netbed.Nat``, ``swarm._punch``).

Three peers, each in a namespace of its own with a user's defaults (``--host
0.0.0.0``, nothing announced): peer 0 is public, peers 1 and 2 sit behind
routers that drop unsolicited packets (``Nat(stealth=True)``), find out by
dial-back that nobody can reach them and register with peer 0 as their
relay. Nobody asks for a punch: each NATed peer calls the other through the
relay, and ``AutoPunch`` punches a direct connection in the background,
which the pool prefers to the relay from then on. NAT behaviours covered:
port-preserving MASQUERADE (the punch succeeds) and symmetric
(``--random-fully``: it fails, is counted, and the relay goes on).
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
from cli_harness import CLIProcess, run_command
from netbed import Link, Nat, NetBed

#: argv: index, initial peer ("" for the founder), port, the public host of
#: the other NATed peer. A NATed peer calls the other through their relay
#: until it holds three punched connections to it (``PunchConfig``) or a
#: punch failed, prints "punch S F" (successes and failures), then calls
#: again ("through the punch: ...") and prints "dht punch S F" (its DHT
#: punches, which follow its first TCP punch). Without a TCP punch, peer 1
#: tries a DHT punch by hand ("dht punch by hand: ...") and then stores and
#: reads a record ("dht still works: ..."). Once its relay is gone, peer 1 calls
#: peer 2 ("after the relay left: ..."), then calls it until a call fails,
#: waits until no connection from peer 2's host is left, leaves
#: ``open_peer`` and prints "stopped cleanly": an error of the punched
#: connections that reached the peer's nursery would make ``open_peer``
#: raise instead.
PEER = """
import sys, trio
from swarm import Identity, PeerConfig, PunchError, SwarmError, open_peer
from swarm._punch import punch_dht

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]

async def who(stream):
    await stream.receive()
    await stream.send(b"here")

async def call(peer, other, label):
    try:
        answer = await peer.connections.call(other, ("10.0.0.1", 1), "who", "?", timeout=10)
        print(label, answer.decode(), flush=True)
        return True
    except SwarmError as e:
        print(label, "failed", type(e).__name__, e, flush=True)
        return False

async def main():
    index, initial, port, other_host = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else ())
    async with open_peer(IDS[index], config) as peer:
        peer.connections.set_handler("who", who)
        print("address", peer.address, flush=True)
        if index == 0:
            await trio.sleep_forever()
        await peer.relay_found.wait()
        print("relayed", flush=True)
        other = IDS[3 - index].peer_id
        # both are relayed by peer 0, at the same circuit address
        peer.connections.set_relay_route(other, peer.relayed_by[1])
        auto = peer.auto_punch
        while peer.connections.punched_count(other) < 3 and auto.failures == 0:
            await call(peer, other, "through the relay:")
            await trio.sleep(0.2)
        print("punch", auto.successes, auto.failures, flush=True)
        await call(peer, other, "through the punch:")
        print("dht punch", auto.dht_successes, auto.dht_failures, flush=True)
        if index == 1 and auto.successes == 0:  # no TCP punch, so no DHT one: try it by hand
            try:
                await punch_dht(peer.connections, peer.dht, other, ("10.0.0.1", 1),
                                peer.observed_host)
                print("dht punch by hand: punched", flush=True)
            except PunchError as e:
                print("dht punch by hand: failed", e, flush=True)
            stored = await peer.dht.store("after", "punch", peer.dht.now() + 60)
            found = await peer.dht.get("after")
            print("dht still works:", stored and found is not None and found.value == "punch",
                  flush=True)
        if index == 2:
            await trio.sleep_forever()
        while peer.relayed_by is not None:
            await trio.sleep(0.1)
        await call(peer, other, "after the relay left:")
        while await call(peer, other, "after the peer left:"):
            await trio.sleep(0.2)
        while peer.connections.inbound_count(other_host):
            await trio.sleep(0.1)
    print("stopped cleanly", flush=True)

trio.run(main)
"""
PORT = 7000


@asynccontextmanager
async def _peers(bed: NetBed) -> AsyncIterator[list[CLIProcess]]:
    founder = f"{bed.addresses[0]}:{PORT}"
    async with AsyncExitStack() as stack:
        peers: list[CLIProcess] = []
        for i in range(3):
            other = bed.public_addresses[3 - i] if i else ""
            argv = [sys.executable, "-c", PEER, str(i), founder if i else "", str(PORT), other]
            peers.append(await stack.enter_async_context(run_command(*bed.exec(i, argv))))
            await peers[i].read_line_containing("address", timeout=60)
        for i in (1, 2):
            await peers[i].read_line_containing("relayed", timeout=60)
        yield peers


@pytest.mark.slow
async def test_natted_peers_punch_by_themselves_and_survive_the_other_leaving() -> None:
    """Behind port-preserving NATs both peers punch by themselves, the pool
    uses the punched connection (it still carries calls once the relay is
    gone), and killing the other peer, which closes every punched connection
    from the remote side, leaves the peer running: it stops cleanly."""
    nats = [None, Nat(stealth=True), Nat(stealth=True)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        async with _peers(bed) as peers:
            for i in (1, 2):
                line = await peers[i].read_line_containing("punch ", timeout=60)
                assert line == "punch 3 0", line
                line = await peers[i].read_line_containing("through the punch:", timeout=30)
                assert line == "through the punch: here", line
                line = await peers[i].read_line_containing("dht punch", timeout=30)
                assert line == "dht punch 1 0", line
            peers[0].process.kill()
            line = await peers[1].read_line_containing("after the relay left:", timeout=30)
            assert line == "after the relay left: here", line
            peers[2].process.kill()
            line = await peers[1].read_line_containing("after the peer left:", timeout=30)
            while line == "after the peer left: here":  # until it notices
                line = await peers[1].read_line_containing("after the peer left:", timeout=30)
            line = await peers[1].read_line_containing("stopped", timeout=60)
            assert line == "stopped cleanly", line
            assert await peers[1].finish(timeout=30) == 0


@pytest.mark.slow
async def test_behind_a_symmetric_nat_a_punch_fails_and_the_relay_carries_on() -> None:
    """A symmetric NAT maps each destination to a new port: the automatic
    punch fails, is counted, and the relay still carries the calls; a DHT
    punch fails too, and the DHT works through the public node as before."""
    nats = [None, Nat(stealth=True), Nat(symmetric=True, stealth=True)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        async with _peers(bed) as peers:
            for i in (1, 2):
                line = await peers[i].read_line_containing("punch ", timeout=60)
                assert line == "punch 0 1", line
                line = await peers[i].read_line_containing("through the punch:", timeout=30)
                assert line == "through the punch: here", line
                line = await peers[i].read_line_containing("dht punch", timeout=30)
                assert line == "dht punch 0 0", line
            line = await peers[1].read_line_containing("dht punch by hand:", timeout=30)
            assert line.startswith("dht punch by hand: failed no DHT ping got through"), line
            line = await peers[1].read_line_containing("dht still works:", timeout=30)
            assert line == "dht still works: True", line


#: argv: index, initial peer ("" for the founder), port. Averages a tensor
#: of its index every round (round ``r`` begins at ``r * PERIOD`` s of the
#: shared clock) and prints "round R members=I,J,.. contributors=N
#: punched=I,J,.. dht=S" (the members' indices, whom it holds punched
#: connections with, and its DHT punches that succeeded), or "round R none".
AVERAGING_PEER = """
import sys, time, torch, trio
from averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig, MoshpitGrid
from swarm import Identity, PeerConfig, RelayConfig, open_peer

PERIOD = {PERIOD}
IDS = {bytes(Identity.from_seed(bytes([i + 1]) * 32).peer_id): i for i in range(8)}
CONFIG = AveragerConfig(
    matchmaking=MatchmakingConfig(target_group_size=4, min_group_size=2, matchmaking_time=2.0,
                                  request_timeout=1.5, poll_interval=0.2),
    allreduce=AllReduceConfig(sender_timeout=2.0, reducer_timeout=3.0, round_timeout=4.0),
)

def indices(peer_ids):
    return ",".join(str(i) for i in sorted(IDS[bytes(p)] for p in peer_ids))

async def main():
    index, initial, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else (),
                        relay=RelayConfig(keepalive_interval=1.0))
    async with open_peer(Identity.from_seed(bytes([index + 1]) * 32), config) as peer:
        print("address", peer.address, flush=True)
        tensor = torch.full((20_000,), float(index))
        averager = Averager(peer, [tensor], prefix="nat", config=CONFIG, grid=MoshpitGrid(1, 4))
        while True:
            now = time.time()
            r = int(now // PERIOD) + 1
            await trio.sleep(r * PERIOD - now)
            result = await averager.step(round=r)
            punched = indices(peer.connections.punched_peers())
            state = f"punched={punched} dht={peer.auto_punch.dht_successes}"
            if result.group is None or result.allreduce is None:
                print("round", r, "none", state, result.reason, flush=True)
                continue
            members = indices(m.peer_id for m in result.group.members)
            print("round", r, "members=" + members,
                  f"contributors={len(result.contributors)}", state, flush=True)

trio.run(main)
"""
PERIOD = 10.0
AVERAGING_PEER = AVERAGING_PEER.replace("{PERIOD}", str(PERIOD))


def _fields(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in line.split()[2:] if "=" in field)


async def _round_lines(peer: CLIProcess, first: int, count: int) -> list[str]:
    """The lines of rounds ``first`` to ``first + count - 1`` of ``peer``."""
    lines: list[str] = []
    while len(lines) < count:
        line = await peer.read_line_containing("round ", timeout=60)
        number = int(line.split()[1])
        if number >= first:
            assert number == first + len(lines), (first, lines, line)
            lines.append(line)
    return lines


@pytest.mark.slow
async def test_natted_peers_keep_averaging_after_the_only_public_peer_leaves() -> None:
    """One public peer, three behind port-preserving NATs: the three average
    through relays on the public one and punch, by themselves, direct TCP
    connections and DHT paths to each other; once the public peer is killed
    they keep averaging among themselves, every peer's data in every round
    that begins a whole round after the kill (the round it cuts short may
    lose the public peer's part, and its members wait out their deadlines)."""
    nats = [None, Nat(stealth=True), Nat(stealth=True), Nat(stealth=True)]
    with NetBed([Link()] * 4, nats=nats) as bed:
        founder = f"{bed.addresses[0]}:{PORT}"
        async with AsyncExitStack() as stack:
            peers: list[CLIProcess] = []
            for i in range(4):
                argv = [
                    sys.executable,
                    "-c",
                    AVERAGING_PEER,
                    str(i),
                    founder if i else "",
                    str(PORT),
                ]
                peers.append(await stack.enter_async_context(run_command(*bed.exec(i, argv))))
                await peers[i].read_line_containing("address", timeout=60)
            # until every NATed peer holds punched connections and DHT paths to the others
            for i in (1, 2, 3):
                others = ",".join(str(j) for j in (1, 2, 3) if j != i)
                while True:
                    fields = _fields(await peers[i].read_line_containing("round ", timeout=60))
                    if others in fields["punched"] and int(fields["dht"]) >= 2:
                        break
            peers[0].process.kill()
            first = int(time.time() // PERIOD) + 2
            for i in (1, 2, 3):
                for line in await _round_lines(peers[i], first, 2):
                    fields = _fields(line)
                    assert fields.get("members") == "1,2,3", line
                    assert fields["contributors"] == "3", line
