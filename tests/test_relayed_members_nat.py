"""Peers behind real NATs announced through their relay (``netbed.Nat``,
``swarm._relay``, ``averaging._matchmaking``): they reduce parts of the
average like reachable peers, and move to another relay when theirs leaves.

Every peer runs in a namespace of its own with a user's defaults (``--host
0.0.0.0``, nothing announced), finds out by dial-back whether it is reachable,
and, if not, registers with a reachable peer by itself. Nobody is told who is
behind a NAT or who relays for whom. NAT behaviours covered: port-preserving
MASQUERADE with address-and-port-dependent filtering, and symmetric
(``--random-fully``); a relayed peer only dials out (to its relay), which both
allow. Its circuits are new TCP connections from the peer to the relay port.
A router that forgets idle TCP connections after seconds (``netbed``'s
``set_nat_tcp_timeout``): keepalives keep the registration. Hole punching
(``swarm._punch``): port-preserving routers that drop unsolicited packets
(``Nat(stealth=True)``) punch; a symmetric one does not, and the relay goes
on carrying the streams.

Rounds are slots of the shared system clock (every namespace runs on one
kernel): round ``r`` begins at ``r * PERIOD`` seconds of the epoch, so the
peers alive in a slot meet without talking about it first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
from cli_harness import CLIProcess, run_command
from netbed import Link, Nat, NetBed

#: argv: index, initial peer ("" for the founder), port. Identities come from
#: the index. Prints "relayed HOST" whenever its relay changes (hosts of the
#: public peers), then per round: "round R members=I,J,.. contributors=N
#: mine=SIZE relays=I:HOST,.." (the members' indices, the size of its own
#: part, and through which host each relayed member was announced).
PEER = """
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

async def watch_relay(peer, task_status):
    task_status.started()
    shown = None
    while True:
        now = None if peer.relayed_by is None else peer.relayed_by[1][0]
        if now != shown and now is not None:
            print("relayed", now, flush=True)
        shown = now
        await trio.sleep(0.1)

async def main():
    index, initial, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else (),
                        relay=RelayConfig(keepalive_interval=1.0))
    async with open_peer(Identity.from_seed(bytes([index + 1]) * 32), config) as peer:
        print("address", peer.address, flush=True)
        await peer.start_service(watch_relay, peer)
        tensor = torch.full((20_000,), float(index))
        averager = Averager(peer, [tensor], prefix="nat", config=CONFIG, grid=MoshpitGrid(1, 4))
        while True:
            now = time.time()
            r = int(now // PERIOD) + 1
            await trio.sleep(r * PERIOD - now)
            result = await averager.step(round=r)
            if result.group is None or result.allreduce is None:
                print("round", r, "none", result.reason, flush=True)
                continue
            members = result.group.members
            lo, hi = result.allreduce.part_bounds[result.group.local_index]
            relays = ",".join(f"{IDS[bytes(m.peer_id)]}:{m.relay[0]}" for m in members if m.relay)
            print("round", r, "members=" + ",".join(str(IDS[bytes(m.peer_id)]) for m in members),
                  f"contributors={len(result.contributors)}", f"mine={hi - lo}",
                  f"relays={relays}", flush=True)

trio.run(main)
"""
PORT = 7000
#: Seconds per round: more than a step can take (matchmaking's bound, 5 s,
#: and the all-reduce's deadline, 4 s).
PERIOD = 10.0
PEER = PEER.replace("{PERIOD}", str(PERIOD))
#: Rounds checked: every one of them must hold every peer's data.
ROUNDS = 2


@asynccontextmanager
async def _peers(bed: NetBed, stack: AsyncExitStack) -> AsyncIterator[list[CLIProcess]]:
    founder = f"{bed.addresses[0]}:{PORT}"
    peers: list[CLIProcess] = []
    for i in range(len(bed.links)):
        argv = [sys.executable, "-c", PEER, str(i), founder if i else "", str(PORT)]
        peers.append(await stack.enter_async_context(run_command(*bed.exec(i, argv))))
        await peers[i].read_line_containing("address", timeout=60)
    yield peers


def _parse(line: str) -> dict[str, str]:
    return dict(field.split("=", 1) for field in line.split()[2:] if "=" in field)


def _next_round() -> int:
    """The first round that begins at least a whole round from now: every
    peer's record from then on says what it says now."""
    return int(time.time() // PERIOD) + 2


async def _rounds(peer: CLIProcess, first: int, count: int) -> list[str]:
    """The lines of rounds ``first`` to ``first + count - 1`` of ``peer``
    (each peer prints every round it steps, in order)."""
    lines: list[str] = []
    while len(lines) < count:
        line = await peer.read_line_containing("round ", timeout=60)
        number = int(line.split()[1])
        if number >= first:
            assert number == first + len(lines), (first, lines, line)
            lines.append(line)
    return lines


@pytest.mark.slow
async def test_natted_peers_are_announced_through_their_relay_and_reduce_parts() -> None:
    """One public peer, two behind NATs (one symmetric): the NATed peers are
    announced through the public one and reduce parts of their own; every
    round once all three are in has all three peers' data."""
    with NetBed([Link()] * 3, nats=[None, Nat(), Nat(symmetric=True)]) as bed:
        async with AsyncExitStack() as stack, _peers(bed, stack) as peers:
            for i in (1, 2):
                line = await peers[i].read_line_containing("relayed", timeout=60)
                assert line == f"relayed {bed.addresses[0]}", line
            first = _next_round()
            for i, peer in enumerate(peers):
                for line in await _rounds(peer, first, ROUNDS):
                    fields = _parse(line)
                    assert fields.get("members") == "0,1,2", line
                    assert fields["contributors"] == "3", line
                    host = bed.addresses[0]
                    assert fields["relays"] in (f"1:{host},2:{host}", f"2:{host},1:{host}"), line
                    if i:  # behind a NAT, and reducing a part
                        assert int(fields["mine"]) > 0, line


@pytest.mark.slow
async def test_a_natted_peer_whose_relay_leaves_is_announced_through_another() -> None:
    """Two public peers and one behind a NAT: the NATed peer registers with
    one of them; that one is killed; the NATed peer registers with the other
    by itself, is announced through it, and keeps reducing its part."""
    with NetBed([Link()] * 3, nats=[None, None, Nat()]) as bed:
        async with AsyncExitStack() as stack, _peers(bed, stack) as peers:
            line = await peers[2].read_line_containing("relayed", timeout=60)
            relay = bed.addresses.index(line.split()[1])
            other = 1 - relay
            (line,) = await _rounds(peers[other], _next_round(), 1)
            assert _parse(line).get("members") == "0,1,2", line
            assert _parse(line)["relays"] == f"2:{bed.addresses[relay]}", line
            peers[relay].process.kill()
            line = await peers[2].read_line_containing("relayed", timeout=60)
            assert line == f"relayed {bed.addresses[other]}", line
            first = _next_round()
            members = ",".join(str(i) for i in sorted((other, 2)))
            for i in (other, 2):
                for line in await _rounds(peers[i], first, ROUNDS):
                    fields = _parse(line)
                    assert fields.get("members") == members, line
                    assert fields["contributors"] == "2", line
                    assert fields["relays"] == f"2:{bed.addresses[other]}", line
                    assert int(fields["mine"]) > 0, line


#: argv: index (0: the public relay, 1: behind the NAT), initial peer, port,
#: the relay's keepalive interval. The relay waits until the NATed peer
#: registered, lets the registration sit idle for IDLE seconds, then calls
#: the NATed peer through itself and prints whether that worked.
IDLE_PEER = """
import sys, trio
from swarm import Identity, PeerConfig, RelayConfig, SwarmError, open_peer

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(2)]

async def who(stream):
    await stream.receive()
    await stream.send(b"here")

async def main():
    index, initial, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    keepalive = float(sys.argv[4])
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else (),
                        relay=RelayConfig(keepalive_interval=keepalive))
    async with open_peer(IDS[index], config) as peer:
        peer.connections.set_handler("who", who)
        print("address", peer.address, flush=True)
        if index == 1:
            await peer.relay_found.wait()
            print("relayed", flush=True)
            await trio.sleep_forever()
        for _ in range(600):
            if peer.relay.relayed_peers:
                break
            await trio.sleep(0.1)
        print("registered", flush=True)
        await trio.sleep(IDLE)
        target = IDS[1].peer_id
        peer.connections.set_relay_route(target, peer.endpoint)
        try:
            answer = await peer.connections.call(target, ("10.0.0.1", 1), "who", "?", timeout=10)
            print("call", answer.decode(), flush=True)
        except SwarmError as e:
            print("call failed", type(e).__name__, e, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""
#: The router forgets an idle TCP connection after this many seconds, as home
#: routers do (after minutes; Linux's default is five days).
NAT_TCP_TIMEOUT = 4
IDLE = 3 * NAT_TCP_TIMEOUT
IDLE_PEER = IDLE_PEER.replace("IDLE", str(IDLE))


@pytest.mark.slow
@pytest.mark.parametrize(("keepalive", "reached"), [(1.0, True), (60.0, False)])
async def test_keepalives_keep_a_registration_through_a_nat_that_forgets_idle_connections(
    keepalive: float, reached: bool
) -> None:
    """A registration that sits idle for three times the router's TCP
    timeout still carries a circuit with keepalives more frequent than the
    timeout; with rarer ones (the control) the router forgot it."""
    with NetBed([Link()] * 2, nats=[None, Nat()]) as bed:
        bed.set_nat_tcp_timeout(1, NAT_TCP_TIMEOUT)
        founder = f"{bed.addresses[0]}:{PORT}"
        async with AsyncExitStack() as stack:
            peers: list[CLIProcess] = []
            for i in range(2):
                argv = [sys.executable, "-c", IDLE_PEER, str(i), founder if i else "", str(PORT)]
                argv.append(str(keepalive))
                peers.append(await stack.enter_async_context(run_command(*bed.exec(i, argv))))
                await peers[i].read_line_containing("address", timeout=60)
            await peers[1].read_line_containing("relayed", timeout=60)
            await peers[0].read_line_containing("registered", timeout=60)
            line = await peers[0].read_line_containing("call", timeout=IDLE + 60)
            assert (line == "call here") is reached, line


#: argv: index (0: public relay, 1 and 2 behind NATs), initial peer, port.
#: Peer 1 calls peer 2 through the relay, punches a direct connection to it,
#: calls again, says "ready", waits until its relay is gone, calls again.
PUNCH_PEER = """
import sys, trio
from swarm import Identity, PeerConfig, PunchError, SwarmError, open_peer

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]

async def who(stream):
    await stream.receive()
    await stream.send(b"here")

async def call(peer, label):
    try:
        target = IDS[2].peer_id
        answer = await peer.connections.call(target, ("10.0.0.1", 1), "who", "?", timeout=10)
        print(label, answer.decode(), flush=True)
    except SwarmError as e:
        print(label, "failed", type(e).__name__, e, flush=True)

async def main():
    index, initial, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    config = PeerConfig(host="0.0.0.0", port=port, initial_peers=(initial,) if initial else ())
    async with open_peer(IDS[index], config) as peer:
        peer.connections.set_handler("who", who)
        print("address", peer.address, flush=True)
        if index == 0:
            await trio.sleep_forever()
        await peer.relay_found.wait()
        print("relayed", flush=True)
        if index == 2:
            await trio.sleep_forever()
        # both are relayed by peer 0, at the same circuit address
        peer.connections.set_relay_route(IDS[2].peer_id, peer.relayed_by[1])
        await call(peer, "through the relay:")
        try:
            await peer.punch(IDS[2].peer_id, ("10.0.0.1", 1))
            print("punched", flush=True)
        except PunchError as e:
            print("punch failed", e, flush=True)
        await call(peer, "after the punch:")
        print("ready", flush=True)
        for _ in range(600):
            if peer.relayed_by is None:
                break
            await trio.sleep(0.1)
        await call(peer, "after the relay left:")
        await trio.sleep_forever()

trio.run(main)
"""


@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [False, True], ids=["port-preserving", "symmetric"])
async def test_natted_peers_punch_a_connection_that_outlives_their_relay(
    symmetric: bool,
) -> None:
    """Two peers behind NATs that reach each other through a public relay
    punch a direct connection (TCP simultaneous open coordinated over the
    relay's circuit), which still carries their streams after the relay
    left. Behind a symmetric NAT the punch fails, and the relay still
    carries their streams (until it leaves)."""
    nats = [None, Nat(stealth=True), Nat(symmetric=symmetric, stealth=True)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        founder = f"{bed.addresses[0]}:{PORT}"
        async with AsyncExitStack() as stack:
            peers: dict[int, CLIProcess] = {}
            for i in (0, 2, 1):  # peer 2 relayed before peer 1 calls it
                argv = [sys.executable, "-c", PUNCH_PEER, str(i), founder if i else "", str(PORT)]
                peers[i] = await stack.enter_async_context(run_command(*bed.exec(i, argv)))
                await peers[i].read_line_containing("address", timeout=60)
                if i:
                    await peers[i].read_line_containing("relayed", timeout=60)
            line = await peers[1].read_line_containing("through the relay:", timeout=60)
            assert line == "through the relay: here", line
            line = await peers[1].read_line_containing("punch", timeout=60)
            assert line.startswith("punch failed" if symmetric else "punched"), line
            line = await peers[1].read_line_containing("after the punch:", timeout=60)
            assert line == "after the punch: here", line
            await peers[1].read_line_containing("ready", timeout=60)
            peers[0].process.kill()
            line = await peers[1].read_line_containing("after the relay left:", timeout=90)
            if symmetric:
                assert line.startswith("after the relay left: failed"), line
            else:
                assert line == "after the relay left: here", line
