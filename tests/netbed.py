"""A test bed of emulated home links: N peer network namespaces on one bridge.

    with NetBed([Link("20mbit"), Link("20mbit", loss=0.01), ...]) as bed:
        subprocess.run(bed.exec(0, ["swarm", "train", ...]))

    # peers 2 and 3 each behind a home router of their own
    with NetBed([Link()] * 4, nats=[None, None, Nat(), Nat(symmetric=True)]) as bed:
        ...

Layout (every name is unique to this bed, ``<tag>`` = ``swnb<pid>x<random hex>``,
followed by ``-<label>`` if the bed has one, to tell whose beds are whose on
a shared machine):

- namespace ``<tag>-br`` holds bridge ``br0`` and one veth end ``v<i>`` per
  peer. The bridge lives in its own namespace, not the root one, and no
  namespace of the bed has a default route or any link outside the bed:
  nothing can route out of it.
- namespace ``<tag>-p<i>`` is peer i: loopback plus ``eth0`` (the other veth
  end) with address ``10.77.0.<i+1>/24``.
- a peer with a ``Nat`` (``nats[i]``) sits behind a home router of its own:
  namespace ``<tag>-r<i>`` holds ``wan0`` (on the bridge, with the public
  address ``10.77.0.<i+1>/24``) and ``lan0`` (``10.78.<i>.1/24``); the peer's
  ``eth0`` has the private address ``10.78.<i>.2/24`` and a default route via
  the router. The router forwards with ``iptables -t nat -A POSTROUTING -o
  wan0 -j MASQUERADE`` and a FORWARD chain whose policy is DROP and that
  admits only what the LAN sent and the replies to it (conntrack
  ESTABLISHED,RELATED): nobody outside can open a connection to the peer.
  ``bed.addresses[i]`` is the address the peer's own interface has (what it
  would announce), ``bed.public_addresses[i]`` the one others see its packets
  come from (the router's, for a NATed peer).
- ``tc qdisc tbf`` on ``eth0`` (a NATed peer: the router's ``wan0``) caps
  peer i's upload and on ``v<i>`` its download (``Link.up``/``Link.down``,
  tc rate syntax such as ``20mbit``).
- ``Link.loss`` drops packets at random on that link in both directions
  (``iptables -m statistic --mode random``): on arrival in peer i's namespace,
  and, for what peer i sends, on arrival in every other peer's namespace. The
  dropped packets have crossed the link first, as lost packets do.

The kernel here has tbf but no netem: there is no added latency.

NAT behaviours (RFC 4787 terms). ``Nat()``: Linux MASQUERADE keeps a LAN
socket's source port when it is free, so its mapping is endpoint-independent
in practice (one public port per LAN socket, whoever it talks to); its
filtering is address-and-port-dependent (conntrack admits only packets from
the exact address and port the LAN socket sent to): a "port-restricted cone",
the most common home router. ``Nat(symmetric=True)`` adds ``--random-fully``:
every new destination gets a fresh random public port (endpoint-dependent
mapping), as on symmetric and carrier-grade NATs. A packet from outside
that no LAN connection asked for, to a port of the router itself, is refused
(a TCP reset, an ICMP error), as Linux does with no firewall;
``Nat(stealth=True)`` drops it silently instead, as most home routers'
firewalls do (OpenWrt's wan zone, "stealth mode"). Hole punching needs the
latter here: the routers sit next to each other on one bridge, so one side's
SYN reaches the other's router before that one has sent its own, and a reset
then ends the attempt (across the internet the SYNs would cross in flight).

Teardown kills every process started with ``popen`` (its whole process group)
and deletes every namespace of the bed, which destroys its links; it runs on
any exit, exceptions included. A bed whose creating process died (a crashed
run) is removed by the next ``NetBed`` (names carry the creator's pid). Needs
root, ``ip`` and ``tc``; ``iptables`` only for loss (installed with apt-get
when missing).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

#: Every namespace of every bed starts with this.
PREFIX = "swnb"
SUBNET = "10.77.0"
#: A NATed peer i's home network is ``10.78.<i>.0/24``.
HOME_SUBNET = "10.78"
#: What a bed's ``label`` may be: part of every namespace name of the bed.
_LABEL = re.compile(r"[a-z0-9-]{0,16}")


@dataclass(frozen=True)
class Nat:
    """A home router in front of one peer (module docstring: NAT behaviours).

    ``symmetric``: endpoint-dependent mapping (a new public port per
    destination) instead of the port-preserving, endpoint-independent one.
    """

    symmetric: bool = False
    #: drop unsolicited packets to the router's own ports instead of refusing them
    stealth: bool = False


@dataclass(frozen=True)
class Link:
    """One peer's link: upload and download caps (tc rates, None = unshaped),
    random loss in [0, 1) each way."""

    up: str | None = None
    down: str | None = None
    loss: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss={self.loss} must be in [0, 1)")
        for rate in (self.up, self.down):
            if rate is not None:
                rate_bits(rate)


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``100mbit``, ``1.5gbit``, ``800kbit``."""
    text = rate.strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            try:
                value = float(text[: -len(suffix)])
            except ValueError:
                break
            if value > 0:
                return value * scale
            break
    raise ValueError(f"rate {rate!r} is not a positive tc rate such as 100mbit")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose creating process is gone; returns them."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        pid_text = name[len(PREFIX) :].split("x", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
            removed.append(name)
    return removed


def ensure_iptables() -> str:
    """The path of ``iptables``, installing the Debian package if it is missing."""
    found = shutil.which("iptables")
    if found is None:
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "iptables"],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        found = shutil.which("iptables")
    if found is None:
        raise RuntimeError("iptables is needed for packet loss: apt-get install iptables")
    return found


def _shape(namespace: str, device: str, rate: str) -> None:
    bits = rate_bits(rate)
    # burst: at least 10 ms of traffic (tbf needs >= rate / HZ) and 2 frames;
    # the queue holds 50 ms, a home router's buffer.
    burst = max(3200, int(bits / 8 / 100))
    _run(
        "ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
        "tbf", "rate", rate, "burst", str(burst), "latency", "50ms",
    )  # fmt: skip


class NetBed:
    """N peer namespaces on a bridge, shaped per ``links`` (module docstring).

    A context manager: entering builds it (``subprocess.CalledProcessError``
    if a command fails, after removing what was built), exiting tears it down.
    """

    def __init__(
        self,
        links: Sequence[Link],
        nats: Sequence[Nat | None] | None = None,
        *,
        label: str = "",
    ) -> None:
        if not 1 <= len(links) <= 200:
            raise ValueError("a bed has 1 to 200 peers")
        if not _LABEL.fullmatch(label):
            raise ValueError(f"label={label!r}: at most 16 of a-z, 0-9 and '-'")
        self.links = tuple(links)
        self.nats: tuple[Nat | None, ...] = (
            (None,) * len(links) if nats is None else tuple(nats)
        )
        if len(self.nats) != len(self.links):
            raise ValueError(f"{len(self.nats)} nats for {len(self.links)} links: one per peer")
        # the pid marks whose bed it is (remove_stale_beds); the random part
        # keeps a later process that got the same pid from colliding with it
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}" + (f"-{label}" if label else "")
        self.bridge_ns = f"{self.tag}-br"
        self.peer_ns = [f"{self.tag}-p{i}" for i in range(len(links))]
        self.router_ns = [
            None if nat is None else f"{self.tag}-r{i}" for i, nat in enumerate(self.nats)
        ]
        self.public_addresses = [f"{SUBNET}.{i + 1}" for i in range(len(links))]
        self.addresses = [
            public if nat is None else f"{HOME_SUBNET}.{i}.2"
            for i, (nat, public) in enumerate(zip(self.nats, self.public_addresses, strict=True))
        ]
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> NetBed:
        remove_stale_beds()
        try:
            self._build()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._teardown()

    def _build(self) -> None:
        if any(link.loss for link in self.links) or any(self.nats):
            ensure_iptables()
        br = self.bridge_ns
        _run("ip", "netns", "add", br)
        _run("ip", "-n", br, "link", "set", "lo", "up")
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.peer_ns):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            router, nat = self.router_ns[i], self.nats[i]
            # the namespace on the public bridge, and its interface there
            wan_ns, wan = (ns, "eth0") if router is None else (router, "wan0")
            if router is not None:
                _run("ip", "netns", "add", router)
                _run("ip", "-n", router, "link", "set", "lo", "up")
            _run("ip", "-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", wan,
                 "netns", wan_ns)  # fmt: skip
            _run("ip", "-n", br, "link", "set", f"v{i}", "master", "br0")
            _run("ip", "-n", br, "link", "set", f"v{i}", "up")
            _run("ip", "-n", wan_ns, "addr", "add", f"{self.public_addresses[i]}/24", "dev", wan)
            _run("ip", "-n", wan_ns, "link", "set", wan, "up")
            if router is not None and nat is not None:
                self._build_router(i, router, ns, nat)
            link = self.links[i]
            if link.up is not None:
                _shape(wan_ns, wan, link.up)
            if link.down is not None:
                _shape(br, f"v{i}", link.down)
        for i, link in enumerate(self.links):
            if link.loss:
                self.add_loss(i, link.loss)

    def _build_router(self, i: int, router: str, peer_ns: str, nat: Nat) -> None:
        """Peer i's home: its ``eth0`` on the router's LAN, the router NATing."""
        lan = f"{HOME_SUBNET}.{i}"
        _run("ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
             "netns", peer_ns)  # fmt: skip
        _run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0")
        _run("ip", "-n", router, "link", "set", "lan0", "up")
        _run("ip", "-n", peer_ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
        _run("ip", "-n", peer_ns, "link", "set", "eth0", "up")
        _run("ip", "-n", peer_ns, "route", "add", "default", "via", f"{lan}.1")
        in_router = ("ip", "netns", "exec", router)
        _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        masquerade = ["-j", "MASQUERADE", *(["--random-fully"] if nat.symmetric else [])]
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", *masquerade)
        # a home router: the LAN may start anything, the outside only answer
        _run(*in_router, "iptables", "-P", "FORWARD", "DROP")
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT")
        _run(*in_router, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate",
             "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        if nat.stealth:
            _run(*in_router, "iptables", "-A", "INPUT", "-i", "wan0", "-m", "conntrack",
                 "--ctstate", "NEW,INVALID", "-j", "DROP")  # fmt: skip

    def forward_port(self, peer: int, port: int) -> None:
        """From now on, NATed peer ``peer``'s router forwards TCP and UDP ``port``
        of its public address to the peer (what a user sets up on a home router,
        or UPnP does): the peer is reachable at ``public_addresses[peer]:port``."""
        router = self.router_ns[peer]
        if router is None:
            raise ValueError(f"peer {peer} is not behind a NAT")
        in_router = ("ip", "netns", "exec", router)
        for protocol in ("tcp", "udp"):
            _run(*in_router, "iptables", "-t", "nat", "-A", "PREROUTING", "-i", "wan0",
                 "-p", protocol, "--dport", str(port),
                 "-j", "DNAT", "--to-destination", f"{self.addresses[peer]}:{port}")  # fmt: skip
            _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0",
                 "-p", protocol, "--dport", str(port), "-j", "ACCEPT")  # fmt: skip

    def set_nat_tcp_timeout(self, peer: int, seconds: int) -> None:
        """From now on, NATed peer ``peer``'s router forgets an established TCP
        connection idle for ``seconds`` (conntrack's timeout in the router's
        namespace; Linux's default is five days, home routers' minutes): the
        outside's packets on it are then dropped or refused."""
        router = self.router_ns[peer]
        if router is None:
            raise ValueError(f"peer {peer} is not behind a NAT")
        _run("ip", "netns", "exec", router, "sysctl", "-qw",
             f"net.netfilter.nf_conntrack_tcp_timeout_established={seconds}")  # fmt: skip

    def add_loss(self, peer: int, probability: float) -> None:
        """From now on, drop packets of peer ``peer``'s link at random, each way
        (on top of any loss it has)."""
        self.drop_arriving(peer, probability)
        for j in range(len(self.peer_ns)):
            if j != peer:
                self.drop_arriving(j, probability, source=self.public_addresses[peer])

    def drop_arriving(self, peer: int, probability: float, *, source: str | None = None) -> None:
        """From now on, drop packets arriving at peer ``peer`` (from ``source``
        only, if given) at random. On every peer of a bed, it is a loss rate
        of ``probability`` on every path."""
        if not 0 < probability < 1:
            raise ValueError(f"probability={probability} must be in (0, 1)")
        ensure_iptables()
        match = [] if source is None else ["-s", source]
        drop = ["-m", "statistic", "--mode", "random", "--probability", f"{probability}",
                "-j", "DROP"]  # fmt: skip
        _run("ip", "netns", "exec", self.peer_ns[peer], "iptables", "-A", "INPUT", *match, *drop)

    def exec(self, peer: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside peer ``peer``'s namespace."""
        return ["ip", "netns", "exec", self.peer_ns[peer], *argv]

    def popen(self, peer: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` in peer ``peer``'s namespace, in a process group of its
        own; the bed kills and reaps it on exit if it still runs."""
        process: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            self.exec(peer, argv), start_new_session=True, **kwargs
        )
        self._processes.append(process)
        return process

    def _teardown(self) -> None:
        for process in self._processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        present = set(_namespaces())
        routers = [ns for ns in self.router_ns if ns is not None]
        for ns in [*self.peer_ns, *routers, self.bridge_ns]:
            if ns in present:
                subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
