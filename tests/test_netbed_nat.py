"""The NAT of the test bed (``netbed.Nat``) behaves like a home router.

Checked with plain sockets in the bed's namespaces (no swarm code): a peer
behind a NAT can open connections out, and the other side sees the router's
address; nobody outside can open a connection in, neither to the peer's
private address nor to the router's; the port-preserving NAT gives one public
port per LAN socket whoever it talks to, the symmetric one a new port per
destination; and everything the bed made is gone after it, also when the
block raised.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from netbed import Link, Nat, NetBed, _namespaces

#: Listens on TCP and UDP port 5000 and prints the source of each arrival
#: (``tcp HOST PORT`` / ``udp HOST PORT``), until killed.
ECHO_SOURCES = """
import select, socket, sys
tcp = socket.socket(); tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("0.0.0.0", 5000)); tcp.listen()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("0.0.0.0", 5000))
print("ready", flush=True)
while True:
    readable, _, _ = select.select([tcp, udp], [], [])
    if tcp in readable:
        conn, (host, port) = tcp.accept()
        print("tcp", host, port, flush=True)
        conn.close()
    if udp in readable:
        _, (host, port) = udp.recvfrom(100)
        print("udp", host, port, flush=True)
"""

#: Connects by TCP to argv[1]:5000; exits 0 if that worked, 3 if not.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 5000), timeout=2).close()
except OSError:
    sys.exit(3)
"""

#: From one UDP socket bound to port 6000, sends one datagram to each argv host's port 5000.
SEND_FROM_ONE_SOCKET = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 6000))
for host in sys.argv[1:]:
    s.sendto(b"hello", (host, 5000))
"""


def _connect(bed: NetBed, peer: int, host: str) -> int:
    return subprocess.run(
        bed.exec(peer, [sys.executable, "-c", CONNECT, host]), timeout=30, check=False
    ).returncode


def _listen(bed: NetBed, peer: int) -> subprocess.Popen[bytes]:
    listener = bed.popen(peer, [sys.executable, "-c", ECHO_SOURCES], stdout=subprocess.PIPE)
    assert listener.stdout is not None
    assert listener.stdout.readline() == b"ready\n"
    return listener


def _arrivals(listener: subprocess.Popen[bytes], count: int) -> list[tuple[str, str, int]]:
    assert listener.stdout is not None
    found = []
    for _ in range(count):
        kind, host, port = listener.stdout.readline().decode().split()
        found.append((kind, host, int(port)))
    return found


@pytest.mark.parametrize("symmetric", [False, True], ids=["port-preserving", "symmetric"])
def test_a_natted_peer_connects_out_and_nobody_connects_in(symmetric: bool) -> None:
    with NetBed([Link(), Link()], nats=[None, Nat(symmetric=symmetric)]) as bed:
        assert bed.addresses[0] == bed.public_addresses[0]
        assert bed.addresses[1] != bed.public_addresses[1]
        public = _listen(bed, 0)
        assert _connect(bed, 1, bed.addresses[0]) == 0
        [(kind, host, _)] = _arrivals(public, 1)
        assert (kind, host) == ("tcp", bed.public_addresses[1])  # the router's address
        _listen(bed, 1)
        for target in (bed.addresses[1], bed.public_addresses[1]):
            assert _connect(bed, 0, target) == 3, target


@pytest.mark.parametrize("symmetric", [False, True], ids=["port-preserving", "symmetric"])
def test_mappings_per_destination(symmetric: bool) -> None:
    """One LAN socket sends to two public peers: the port-preserving NAT shows
    both its port 6000, the symmetric one two ports (neither 6000 in general)."""
    nats: list[Nat | None] = [None, None, Nat(symmetric=symmetric)]
    with NetBed([Link()] * 3, nats=nats) as bed:
        listeners = [_listen(bed, 0), _listen(bed, 1)]
        subprocess.run(
            bed.exec(2, [sys.executable, "-c", SEND_FROM_ONE_SOCKET, *bed.addresses[:2]]),
            timeout=30,
            check=True,
        )
        seen = [_arrivals(listener, 1)[0] for listener in listeners]
    assert all(kind == "udp" and host == bed.public_addresses[2] for kind, host, _ in seen)
    ports = {port for _, _, port in seen}
    if symmetric:
        assert len(ports) == 2, seen
    else:
        assert ports == {6000}, seen


def test_the_bed_removes_routers_and_homes_also_when_the_block_raises() -> None:
    bed = NetBed([Link(), Link()], nats=[Nat(), Nat(symmetric=True)])
    with pytest.raises(RuntimeError, match="boom"), bed:
        made = {*bed.peer_ns, *(ns for ns in bed.router_ns if ns is not None)}
        assert made <= set(_namespaces())
        assert len(made) == 4
        raise RuntimeError("boom")
    assert not [ns for ns in _namespaces() if ns.startswith(bed.tag)]


def test_one_nat_per_peer() -> None:
    with pytest.raises(ValueError, match="one per peer"):
        NetBed([Link(), Link()], nats=[Nat()])
