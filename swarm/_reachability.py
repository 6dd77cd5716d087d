"""Whether other peers can reach this one, found out by asking them to dial back.

A peer listening on a wildcard address announces the address ``_announce``
guesses. Behind a home router's NAT that guess is a private address that
nobody outside can dial, and a peer that others cannot dial must not lead a
group or reduce a part: every round would wait for it in vain. So a joining
peer does not trust the guess: it asks a few peers of the swarm to dial it back.

Dial-back (stream ``DIAL_BACK``, one request, one reply; ``serve_dial_back``):

- request ``[port]``: the port this peer listens on (TCP and UDP, one port).
- the helper dials back the IP address it sees the request come from (the
  NAT's public address, behind one) at that port, twice: TCP on a new
  connection whose handshake must prove the requester's peer id
  (``Connections.check_dial``), and a DHT ping over UDP that the requester's
  node must answer. It dials no other address, so nobody can make it dial a
  third party (libp2p's AutoNAT has the same rule). At most
  ``max_dial_backs`` run at once; beyond that, and when
  ``ReachabilityConfig.serve`` is off, it refuses.
- reply ``["ok", host, port, tcp, udp]``: the address the helper saw the
  request come from (host, and the source port of that connection) and
  whether each dial-back got through; or ``["refused", reason]``.

The verdict (``decide``, pure): REACHABLE when a majority of the helpers that
answered got through on TCP *and* UDP; then the address they reached (the
host they saw) is the one to announce (a home router that forwards the port
makes the peer reachable at its public address). Otherwise UNREACHABLE: the
peer becomes a client (``PeerConfig.client_mode``'s behaviour: it trains and
averages, connecting out only; its DHT node turns client). With no answer at
all the verdict is UNCHECKED and the peer keeps its guess, as before.

Until its verdict a joining peer's DHT node is a client that answers pings
only (``AsyncPeer.check_reachability``): nobody keeps an unreachable node as a
contact, which would cost each of them a timeout before they dropped it. A
peer found reachable (or UNCHECKED) turns full and bootstraps again to be known.

Why TCP decides, and UDP alone does not: the requester's DHT socket has
already sent datagrams to the helper's port, so a NAT that keeps that mapping
lets the helper's ping back in through it (conntrack matches the reply
direction), although a third peer's datagram would be dropped. TCP is dialed
from a new ephemeral port toward the listening port, which no earlier
connection mapped, so it gets through only if anyone could.

``Reachability`` is also what a peer tells the swarm (its progress record's
``reachability``; ``swarm status``): CLIENT when configured so
(``--client-mode``), UNCHECKED when nothing was asked (``--announce`` given,
a specific ``--host``, or the swarm's first peer).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import trio

from ._address import Address
from ._connections import Connections, Stream
from ._errors import ConfigError, ProtocolError, SwarmError
from ._identity import PeerID
from ._wire import expect_int, expect_str

log = logging.getLogger(__name__)

#: Stream name of the dial-back request.
DIAL_BACK = "swarm.reachability.dial-back"


class Reachability(enum.Enum):
    """Whether other peers can open connections to a peer (module docstring)."""

    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"
    CLIENT = "client"
    UNCHECKED = "unchecked"


@dataclass(frozen=True)
class ReachabilityConfig:
    """When a peer checks its reachability, and how it helps others check theirs.

    ``check``: ``"auto"`` checks when the peer listens on a wildcard host,
    announces no address of its own choosing, is not a client, and joins an
    existing swarm (the CLI's defaults); ``"always"`` whenever it joins;
    ``"never"``. ``helpers`` peers are asked at once; each dial-back (TCP and
    UDP) gets ``dial_timeout`` seconds. ``recheck_interval`` (seconds, 0 = never)
    is how often a peer whose guessed address may change looks whether it did,
    and checks again if so. ``serve`` off refuses to dial others back;
    ``max_dial_backs`` bounds the dial-backs served at once.
    """

    check: str = "auto"
    helpers: int = 3
    dial_timeout: float = 3.0
    recheck_interval: float = 60.0
    serve: bool = True
    max_dial_backs: int = 8

    def __post_init__(self) -> None:
        if self.check not in ("auto", "always", "never"):
            raise ConfigError(f"reachability check {self.check!r} must be auto, always or never")
        if not 1 <= self.helpers <= 16:
            raise ConfigError(f"reachability helpers={self.helpers} must be in 1-16")
        if not (math.isfinite(self.dial_timeout) and self.dial_timeout > 0):
            raise ConfigError(f"reachability dial_timeout={self.dial_timeout} must be positive")
        if not (math.isfinite(self.recheck_interval) and self.recheck_interval >= 0):
            raise ConfigError(
                f"reachability recheck_interval={self.recheck_interval} must be >= 0 (0: never)"
            )
        if self.max_dial_backs < 1:
            raise ConfigError(f"reachability max_dial_backs={self.max_dial_backs} must be >= 1")

    @property
    def call_timeout(self) -> float:
        """How long a requester waits for a reply: both dial-backs, and a margin."""
        return 2 * self.dial_timeout + 2.0


class DialBack(NamedTuple):
    """One helper's reply: the address it saw, and which dial-backs got through."""

    host: str
    port: int
    tcp: bool
    udp: bool


class Verdict(NamedTuple):
    """What a check found: ``host`` is the address to announce when REACHABLE,
    else the one the helpers saw (the NAT's, behind one; None with no answer)."""

    reachability: Reachability
    host: str | None
    answers: int


def encode_reply(reply: DialBack) -> list[Any]:
    return ["ok", reply.host, reply.port, reply.tcp, reply.udp]


def decode_reply(message: Any) -> DialBack:
    """A helper's reply; raises ``ProtocolError`` if malformed or a refusal."""
    if not isinstance(message, list) or not message:
        raise ProtocolError("a dial-back reply is a non-empty list")
    if message[0] == "refused" and len(message) == 2:
        raise ProtocolError(f"dial-back refused: {expect_str(message[1], 'reason', max_size=200)}")
    if message[0] != "ok" or len(message) != 5:
        raise ProtocolError("a dial-back reply is ['ok', host, port, tcp, udp]")
    host = expect_str(message[1], "observed host", max_size=64)
    port = expect_int(message[2], "observed port", lo=0, hi=65535)
    if not isinstance(message[3], bool) or not isinstance(message[4], bool):
        raise ProtocolError("dial-back results tcp and udp are booleans")
    return DialBack(host, port, message[3], message[4])


def decide(replies: Sequence[DialBack]) -> Verdict:
    """The verdict on the replies of the helpers that answered (module docstring)."""
    if not replies:
        return Verdict(Reachability.UNCHECKED, None, 0)
    through = [r for r in replies if r.tcp and r.udp]
    if 2 * len(through) > len(replies):
        host = Counter(r.host for r in through).most_common(1)[0][0]
        return Verdict(Reachability.REACHABLE, host, len(replies))
    host = Counter(r.host for r in replies).most_common(1)[0][0]
    return Verdict(Reachability.UNREACHABLE, host, len(replies))


class DHTPinger(Protocol):
    """What dial-backs need of the DHT node (``dht.DHTNode`` is one)."""

    async def ping(self, address: Address) -> PeerID | None: ...

    def contacts(self) -> list[tuple[PeerID, str, int]]: ...


def serve_dial_back(connections: Connections, dht: DHTPinger, config: ReachabilityConfig) -> None:
    """Answer other peers' dial-back requests on ``connections`` (module docstring)."""
    running = trio.CapacityLimiter(config.max_dial_backs)

    async def handle(stream: Stream) -> None:
        request = await stream.receive()
        if not isinstance(request, list) or len(request) != 1:
            raise ProtocolError("a dial-back request is [port]")
        port = expect_int(request[0], "port", lo=1, hi=65535)
        host, seen_port = stream.remote_address
        if not config.serve:
            await stream.send(["refused", "this peer does not dial others back"])
            return
        try:
            running.acquire_nowait()
        except trio.WouldBlock:
            await stream.send(["refused", f"{config.max_dial_backs} dial-backs running"])
            return
        try:
            tcp, udp = await dial_back(connections, dht, stream.remote, (host, port), config)
        finally:
            running.release()
        await stream.send(encode_reply(DialBack(host, seen_port, tcp, udp)))

    connections.set_handler(DIAL_BACK, handle)


async def dial_back(
    connections: Connections,
    dht: DHTPinger,
    peer_id: PeerID,
    address: Address,
    config: ReachabilityConfig,
) -> tuple[bool, bool]:
    """Whether ``peer_id`` answers at ``address`` over TCP and over UDP (its DHT
    node), each tried for at most ``config.dial_timeout`` seconds, both at once."""
    results = {"tcp": False, "udp": False}

    async def tcp() -> None:
        with trio.move_on_after(config.dial_timeout):
            try:
                await connections.check_dial(peer_id, address)
            except SwarmError as e:  # per-peer boundary: any failure means not reached
                log.debug("dial-back TCP to %s at %s failed: %s", peer_id.short(), address, e)
            else:
                results["tcp"] = True

    async def udp() -> None:
        with trio.move_on_after(config.dial_timeout):
            try:
                answered = await dht.ping(address)
            except SwarmError as e:  # per-peer boundary
                log.debug("dial-back UDP to %s at %s failed: %s", peer_id.short(), address, e)
            else:
                results["udp"] = answered == peer_id

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tcp)
        nursery.start_soon(udp)
    return results["tcp"], results["udp"]


def pick_helpers(
    contacts: Sequence[tuple[PeerID, str, int]],
    me: PeerID,
    initial_peers: Sequence[Address],
    count: int,
) -> list[tuple[PeerID, Address]]:
    """Up to ``count`` contacts to ask, the initial peers first (the user named
    them, so they are most likely reachable), then the others in table order."""
    others = [(pid, (host, port)) for pid, host, port in contacts if pid != me]
    initial = set(initial_peers)
    ordered = [c for c in others if c[1] in initial] + [c for c in others if c[1] not in initial]
    return ordered[:count]


async def check_reachability(
    connections: Connections,
    dht: DHTPinger,
    me: PeerID,
    port: int,
    initial_peers: Sequence[Address],
    config: ReachabilityConfig,
) -> Verdict:
    """Ask up to ``config.helpers`` contacts of ``dht`` at once to dial this peer
    back at ``port``; the verdict on their answers (``decide``).

    A helper that fails, refuses, or does not answer within
    ``config.call_timeout`` is not counted; so this returns within about that
    time and raises nothing but ``trio.Cancelled`` (on cancellation nothing is
    decided).
    """
    helpers = pick_helpers(dht.contacts(), me, initial_peers, config.helpers)
    replies: list[DialBack] = []

    async def ask(peer_id: PeerID, address: Address) -> None:
        try:
            reply = await connections.call(
                peer_id, address, DIAL_BACK, [port], timeout=config.call_timeout
            )
            replies.append(decode_reply(reply))
        except SwarmError as e:  # per-peer boundary: this helper does not count
            log.debug("dial-back by %s failed: %s", peer_id.short(), e)

    async with trio.open_nursery() as nursery:
        for peer_id, address in helpers:
            nursery.start_soon(ask, peer_id, address)
    verdict = decide(replies)
    log.info(
        "reachability: %s (%d of %d asked answered; seen as %s)",
        verdict.reachability.value,
        verdict.answers,
        len(helpers),
        verdict.host,
    )
    return verdict
