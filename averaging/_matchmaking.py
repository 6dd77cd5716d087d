"""Leader-based matchmaking: who averages with whom this round.

The DHT only finds candidates; a leader decides the group, so every member
agrees on the same ordered member list and group id (DESIGN.md, "Matchmaking
is leader-based").

One round, for one peer and its group key (the Moshpit key of this round):

1. It announces itself under the key: a signed sub-key (``owner_marker``) whose
   value says where to dial it and by when, as a leader, it will close its group
   (``join_by``, now + ``matchmaking_time``), and the upload and download rates
   its link was measured to move (``_link_meter``), which the group's parts
   follow (``_partition.part_weights``). Records and members without rates
   (peers that declared their bandwidth, or measured nothing yet, or predate
   the rates) are the shorter lists they always were, and still parse.
2. As a *leader* it admits followers until the group is full or ``join_by``
   passes, then, with at least ``min_group_size`` members, tells every follower
   the group on the stream the follower opened. Just before, it reads the key
   once more: where the peers under it outside the group are too few for a
   group of their own (a key one peer over the target group size: a grid
   line's overflow), it redirects the followers they lack to the most senior
   of its juniors among them (``Matchmaker._spare``), so nobody is left alone.
   That costs one DHT read per group formed. A group that filled before
   ``join_by`` without being told it holds every peer expected then waits up
   to ``poll_interval`` for a peer beyond it: one that asks in that time is
   turned away as before, but the leader reads the key again and hands it a
   member (``Matchmaker._hand_over``).
3. At the same time, as a *follower*, it asks the candidates more senior than
   itself to take it, most senior first. Seniority is ``(join_by, peer_id)``: a
   total order all peers see alike in the DHT, so nobody asks a junior and no
   cycle of peers waiting for each other can form. When a senior accepts, the
   peer stops leading and redirects its own followers to that senior, so small
   groups merge into the senior's.

A follower that leaves before the group forms is dropped (its stream closes);
one that dies after is handled by the all-reduce's fault tolerance. A leader
that dies breaks its followers' streams; they go back to step 3 within the
same bound. Everything ends within ``matchmaking_time + 2 * request_timeout``:
peers that found no group by then get ``None`` and keep their values.

Client-mode peers accept no connections: they never lead, only follow (any
non-client candidate, seniors first). A peer behind a NAT that holds a relay
registration (``swarm._relay``) is no client: its records and member entries
name the relay, and every peer that reads one dials that member through the
relay from then on (``Connections.set_relay_route``), so it leads, follows and
reduces a part like anyone else.

Wire messages on the stream ``mm.<prefix>`` (msgpack), follower -> leader:
``["join", key, member]``; leader -> follower: ``["accepted"]``,
``["refused", reason]`` (final for this round), ``["busy", reason]`` (ask again
soon: the leader has not begun this round yet) or ``["redirect", candidate]``;
after ``accepted``,
one of ``["group", group_id, [member, ...], gathered(, resync)]``, ``["disband", reason]``
or ``["redirect", candidate]``. ``gathered`` is the leader's view of how long
the group took to gather: seconds from its lobby opening to its last member's
admission (``Group.gathered``; a group message of a leader that predates it
has 3 items). It is the leader's because only the leader sees every member
arrive: a follower that came last measures almost nothing from its own start,
and a window sized from that closes before the late peers come. ``resync``
(a bool, optional) is the leader's decision that the group re-synchronises
its state right after the round (``Group.resync``): one decision for the
group, where each member deciding from its own measurements left some in
state rounds that nobody joined. The
follower's peer id is the one its connection proved, never a field of the
message.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from dht import DHTValue, owner_marker
from swarm import ConfigError, PeerID, ProtocolError, SwarmError
from swarm._wire import expect_bytes, expect_float, expect_int, expect_list, expect_str

from ._group import MAX_GROUP_SIZE, Group, GroupMember, MemberMode

#: the peers a round waits for (this one included): how many, or which. A
#: count closes a lobby at that many members, whoever they are; ids close it
#: once those peers are in, so a member the caller did not count (a peer that
#: just caught up) never takes the place of one it did
Expected = int | frozenset[PeerID]

log = logging.getLogger(__name__)

_GROUP_ID_DOMAIN = b"swarm.moshpit.group.v1\x00"
#: A redirect may point to a leader that redirects again; follow a few hops only.
MAX_REDIRECTS = 4
#: ``_join``'s answer for "ask this leader again a little later".
_RETRY = object()


@dataclass(frozen=True)
class MatchmakingConfig:
    """Group sizes and the timing of one matchmaking round (seconds)."""

    target_group_size: int = 16
    min_group_size: int = 2
    #: how long a leader gathers followers before it closes its group
    matchmaking_time: float = 5.0
    #: how long one join request may take (dial, ask, answer)
    request_timeout: float = 2.0
    #: how often a peer without a leader re-reads the candidates in the DHT
    poll_interval: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.min_group_size <= self.target_group_size <= MAX_GROUP_SIZE:
            raise ConfigError(
                f"need 1 <= min_group_size ({self.min_group_size}) <= target_group_size "
                f"({self.target_group_size}) <= {MAX_GROUP_SIZE}"
            )
        for name in ("matchmaking_time", "request_timeout", "poll_interval"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value} must be a positive number of seconds")
        if self.poll_interval > self.matchmaking_time:
            raise ConfigError(
                f"poll_interval ({self.poll_interval}s) must not exceed matchmaking_time "
                f"({self.matchmaking_time}s), or a peer may never look for a leader in time"
            )

    @property
    def bound(self) -> float:
        """The longest matchmaking can take: a leader's wait plus a join and an answer."""
        return self.matchmaking_time + 2 * self.request_timeout


# -- pure decisions --------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A peer's announcement under a group key: where it is, until when it leads."""

    member: GroupMember
    join_by: float

    @property
    def peer_id(self) -> PeerID:
        return self.member.peer_id

    def seniority(self) -> tuple[float, bytes]:
        return (self.join_by, bytes(self.peer_id))

    def to_wire(self) -> list[Any]:
        """``[peer_id, host, port, bandwidth, mode, join_by]``, then the measured
        ``upload, download`` and the relay if there are any (``member_to_wire``)."""
        wire = member_to_wire(self.member)
        return [*wire[:5], self.join_by, *wire[5:]]

    @classmethod
    def from_wire(cls, obj: Any) -> Candidate:
        """Decode ``to_wire``'s list (6 items, 8 with measured rates, 9 with a
        relay); raises ``ProtocolError`` if malformed."""
        fields = _expect_fields(obj, "candidate", 6)
        member = member_from_wire([*fields[:5], *fields[6:]])
        return cls(member, expect_float(fields[5], "candidate join_by"))


def expect_message(obj: Any, what: str) -> list[Any]:
    """A matchmaking message: a non-empty list whose first item names its kind."""
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise ProtocolError(f"{what}: expected [kind, ...]")
    return obj


def _expect_fields(obj: Any, what: str, length: int) -> list[Any]:
    """A list of ``length`` items, of ``length + 2`` when it ends with the
    measured rates (records of peers that measure none, or predate
    measuring, have none), or of ``length + 3`` when a relay follows them."""
    if isinstance(obj, list) and len(obj) in (length + 2, length + 3):
        return obj
    return expect_list(obj, length, what)


def _tail(member: GroupMember) -> list[Any]:
    """What follows the fixed fields on the wire: the measured rates if any
    were measured, then ``[relay_host, relay_port]`` if the member is reached
    through a relay (with rates, 0 for none, before it). A member that
    measures nothing and needs no relay is on the wire as before both existed."""
    if member.relay is not None:
        return [member.upload, member.download, [*member.relay]]
    if member.upload == 0 and member.download == 0:
        return []
    return [member.upload, member.download]


def member_to_wire(member: GroupMember) -> list[Any]:
    """``[peer_id, host, port, bandwidth, mode]``, then ``upload, download``
    (bytes per second) if the member measured its link, then ``[relay_host,
    relay_port]`` if others reach it through a relay (``_tail``)."""
    return [
        bytes(member.peer_id),
        member.host,
        member.port,
        member.bandwidth,
        member.mode.value,
        *_tail(member),
    ]


def _relay_from_wire(obj: Any) -> tuple[str, int]:
    host, port = expect_list(obj, 2, "member relay")
    return (
        expect_str(host, "member relay host", max_size=64),
        expect_int(port, "member relay port", lo=1, hi=65535),
    )


def member_from_wire(obj: Any) -> GroupMember:
    """Decode a group member (5 items, 7 with measured rates, 8 with a relay
    after them); raises ``ProtocolError`` if malformed."""
    fields = _expect_fields(obj, "member", 5)
    peer_id, host, port, bandwidth, mode = fields[:5]
    upload, download = fields[5:7] or (0.0, 0.0)
    relay = _relay_from_wire(fields[7]) if len(fields) == 8 else None
    try:
        return GroupMember(
            PeerID(expect_bytes(peer_id, "member peer id", size=20)),
            expect_str(host, "member host", max_size=64),
            expect_int(port, "member port", lo=1, hi=65535),
            expect_float(bandwidth, "member bandwidth"),
            MemberMode(expect_str(mode, "member mode", max_size=8)),
            expect_float(upload, "member upload"),
            expect_float(download, "member download"),
            relay,
        )
    except (ValueError, ConfigError) as e:
        raise ProtocolError(f"bad member: {e}") from e


def announcement(member: GroupMember, join_by: float) -> list[Any]:
    """The DHT value a peer stores under its group key (its sub-key names it):
    ``[host, port, bandwidth, mode, join_by]``, then the measured ``upload,
    download`` if there are any, then the relay if it has one (``_tail``)."""
    return [
        member.host,
        member.port,
        member.bandwidth,
        member.mode.value,
        join_by,
        *_tail(member),
    ]


def parse_candidates(found: DHTValue | None, me: PeerID) -> list[Candidate]:
    """The valid announcements under a group key, other than ``me``'s.

    The DHT verified each sub-key's signature, so the peer id named by the
    sub-key is the peer that wrote the announcement. Malformed entries are
    skipped.
    """
    if found is None or not isinstance(found.value, dict):
        return []
    candidates = []
    for subkey, entry in found.value.items():
        if not isinstance(subkey, str) or not subkey.startswith("[owner:"):
            continue
        try:
            peer_id = PeerID.from_hex(subkey[len("[owner:") : -1])
            fields = _expect_fields(entry.value, "announcement", 5)
            member = member_from_wire([bytes(peer_id), *fields[:4], *fields[5:]])
            candidates.append(Candidate(member, expect_float(fields[4], "join_by")))
        except (ProtocolError, ValueError) as e:
            log.debug("skipping announcement %s: %s", subkey, e)
    return [c for c in candidates if c.peer_id != me]


def leaders_to_try(candidates: list[Candidate], me: Candidate) -> list[Candidate]:
    """Whom ``me`` should ask to lead it, in order.

    Client-mode candidates cannot lead. A peer that can lead asks only its
    seniors (so nobody waits on a junior); a client-mode peer never leads, so it
    asks every candidate, seniors first.
    """
    leaders = sorted(
        (c for c in candidates if c.member.mode is not MemberMode.CLIENT), key=Candidate.seniority
    )
    if me.member.mode is MemberMode.CLIENT:
        return leaders
    return [c for c in leaders if c.seniority() < me.seniority()]


def group_id_for(key: str, members: list[GroupMember]) -> bytes:
    """The group id: a hash of the key and the member ids, so a leader cannot
    choose it freely (the Moshpit placement of the next round depends on it)."""
    digest = hashlib.sha256(_GROUP_ID_DOMAIN + key.encode())
    for peer_id in sorted(bytes(m.peer_id) for m in members):
        digest.update(peer_id)
    return digest.digest()[:16]


def order_members(members: list[GroupMember]) -> tuple[GroupMember, ...]:
    return tuple(sorted(members, key=lambda m: bytes(m.peer_id)))


def _gathered_from_wire(tail: list[Any]) -> float | None:
    """The optional last item of a group message: the leader's gathering time,
    None if absent. Raises ``ProtocolError`` unless it is a finite number >= 0.
    No upper bound: the leader's window may be longer than this peer's (each
    adapts its own), and whoever uses it clamps it to its configured bounds."""
    if not tail:
        return None
    gathered = expect_float(tail[0], "group gathered")
    if gathered < 0:
        raise ProtocolError(f"group gathered {gathered} is negative")
    return gathered


def _resync_from_wire(tail: list[Any]) -> bool | None:
    """The optional item after ``gathered``: the leader's ``Group.resync``,
    None if absent. Raises ``ProtocolError`` unless it is a bool."""
    if not tail:
        return None
    if not isinstance(tail[0], bool):
        raise ProtocolError(f"group resync must be a bool, got {type(tail[0]).__name__}")
    return tail[0]


def validate_group(
    key: str,
    group_id: bytes,
    members: tuple[GroupMember, ...],
    me: PeerID,
    leader: PeerID,
    config: MatchmakingConfig,
    *,
    gathered: float | None = None,
    resync: bool | None = None,
) -> Group:
    """Check a group a leader announced; raises ``ProtocolError`` if it is not one
    this peer may accept. ``gathered`` and ``resync`` are the leader's
    ``Group.gathered`` and ``Group.resync``."""
    if not 1 <= len(members) <= config.target_group_size:
        raise ProtocolError(f"group of {len(members)} members, target {config.target_group_size}")
    ids = [m.peer_id for m in members]
    if me not in ids or leader not in ids:
        raise ProtocolError("the announced group lacks this peer or its leader")
    if list(members) != list(order_members(list(members))):
        raise ProtocolError("group members are not in canonical order")
    if group_id != group_id_for(key, list(members)):
        raise ProtocolError("group id does not match the key and members")
    try:
        return Group(group_id, members, ids.index(me), gathered=gathered, resync=resync)
    except ConfigError as e:
        raise ProtocolError(f"invalid group: {e}") from e


# -- the leader's side ----------------------------------------------------------


@dataclass(eq=False)
class _Slot:
    """A follower admitted by this peer as leader, waiting for the outcome."""

    member: GroupMember
    outcome: list[Any] | None = None
    ready: trio.Event = field(default_factory=trio.Event)

    def settle(self, outcome: list[Any] | None) -> None:
        if not self.ready.is_set():
            self.outcome = outcome
            self.ready.set()


class Lobby:
    """This peer as a leader for one key: the followers it admitted so far."""

    def __init__(
        self,
        key: str,
        me: GroupMember,
        config: MatchmakingConfig,
        expected: Expected | None = None,
        resync: bool | None = None,
    ) -> None:
        self.key = key
        #: sent to the followers with the group if this peer leads it (``Group.resync``)
        self.resync = resync
        self.me = me
        self.config = config
        #: close as soon as these peers are in (the caller knows who is
        #: looking), or as soon as this many members are; never more than the
        #: target group size
        self.awaited = expected if isinstance(expected, frozenset) else None
        count = len(expected) if isinstance(expected, frozenset) else expected
        self.expected_count = count or None
        self.capacity = min(config.target_group_size, count or config.target_group_size)
        self.slots: dict[PeerID, _Slot] = {}
        self.following: Candidate | None = None
        self.closed = False
        self.changed = trio.Event()
        #: set when a peer asked to join while the group was full: one beyond
        #: it, who may need a member handed over (``Matchmaker._hand_over``)
        self.turned_away = trio.Event()
        #: when the lobby opened, and when it admitted its latest member
        #: (trio time): ``form`` reports the span as ``Group.gathered``
        self.opened = trio.current_time()
        self.last_admitted = self.opened

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def full(self) -> bool:
        """Every awaited peer is in (or, given a count, that many members), or
        the target group size is reached."""
        members = len(self.slots) + 1
        if self.awaited is None or members >= self.config.target_group_size:
            return members >= self.capacity
        return all(p == self.me.peer_id or p in self.slots for p in self.awaited)

    @property
    def may_overflow(self) -> bool:
        """Whether peers beyond a full group may still come: the caller did
        not say how many look under this key, or said more than a group holds.
        A group of every peer expected waits for nobody."""
        return self.expected_count is None or self.expected_count > self.config.target_group_size

    def admit(self, member: GroupMember) -> tuple[list[Any], _Slot | None]:
        """Decide on a join request: the reply and, if admitted, its slot."""
        if self.closed:
            return ["refused", "this round's group is already formed"], None
        if self.following is not None:
            return ["redirect", self.following.to_wire()], None
        if self.me.mode is MemberMode.CLIENT:
            return ["refused", "a client-mode peer does not lead groups"], None
        if member.peer_id in self.slots:
            return ["refused", "already admitted"], None
        if len(self.slots) + 1 >= self.config.target_group_size:
            self.turned_away.set()
            return ["refused", "group is full"], None
        slot = self.slots[member.peer_id] = _Slot(member)
        self.last_admitted = trio.current_time()
        self._touch()
        return ["accepted"], slot

    def drop(self, slot: _Slot) -> None:
        """A follower left before the group formed."""
        if not self.closed and self.slots.get(slot.member.peer_id) is slot:
            del self.slots[slot.member.peer_id]
            self._touch()

    def follow(self, leader: Candidate) -> None:
        """This peer joined ``leader``: send its followers there."""
        self.following = leader
        for slot in self.slots.values():
            slot.settle(["redirect", leader.to_wire()])
        self.slots.clear()
        self._touch()

    def unfollow(self) -> None:
        self.following = None
        self._touch()

    def shed(self, count: int, to: Candidate) -> None:
        """Before closing: send the ``count`` followers admitted last to ``to``
        (``Matchmaker._spare``), who would otherwise be left without a group."""
        for peer_id in list(self.slots)[len(self.slots) - count :]:
            self.slots.pop(peer_id).settle(["redirect", to.to_wire()])
        self._touch()

    def form(self) -> Group | None:
        """Close the lobby; with enough members, tell every follower the group."""
        self.closed = True
        members = [self.me, *(s.member for s in self.slots.values())]
        if len(members) < max(2, self.config.min_group_size):
            self.disband("not enough peers for a group")
            return None
        ordered = order_members(members)
        group_id = group_id_for(self.key, list(ordered))
        wire = [member_to_wire(m) for m in ordered]
        gathered = self.last_admitted - self.opened
        message = ["group", group_id, wire, gathered]
        if self.resync is not None:
            message.append(self.resync)
        for slot in self.slots.values():
            slot.settle(message)
        return Group(
            group_id, ordered, ordered.index(self.me), gathered=gathered, resync=self.resync
        )

    def disband(self, reason: str) -> None:
        self.closed = True
        for slot in self.slots.values():
            slot.settle(["disband", reason])
        self.slots.clear()


class Network(Protocol):
    """What matchmaking needs from a peer (see ``swarm.AsyncPeer``)."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def dht(self) -> Any: ...

    @property
    def connections(self) -> Any: ...


class Matchmaker:
    """Finds groups for one averager (one ``prefix``) of one peer.

    ``find_group`` runs one round at a time; ``handle`` serves other peers' join
    requests (registered as the connection handler ``mm.<prefix>``).
    """

    def __init__(self, peer: Network, prefix: str, config: MatchmakingConfig) -> None:
        self.peer = peer
        self.prefix = prefix
        self.config = config
        self.stream_name = f"mm.{prefix}"
        self._lobby: Lobby | None = None
        self._lobby_opened = trio.Event()
        #: the leader this peer is asking to take it, until it answers
        self._asking: PeerID | None = None

    # serving

    async def handle(self, stream: Any) -> None:
        """Serve one join request (the connection handler of ``mm.<prefix>``)."""
        request: Any = None
        with trio.move_on_after(self.config.request_timeout):
            request = await stream.receive()
        try:
            kind, key, member_wire = expect_list(request, 3, "join request")
            if kind != "join":
                raise ProtocolError(f"unexpected matchmaking message {kind!r}")
            key = expect_str(key, "group key", max_size=256)
            member = member_from_wire(member_wire)
        except ProtocolError as e:
            log.debug("bad join request from %s: %s", stream.remote.short(), e)
            return
        if member.peer_id != stream.remote:
            await stream.send(["refused", "member peer id differs from the connection's"])
            return
        self._learn_routes([member])
        lobby = self._lobby
        if lobby is None or lobby.key != key:
            # it may simply not have begun this round yet: the follower retries
            await stream.send(["busy", "not looking for a group under this key"])
            return
        if self._asking == member.peer_id and bytes(self.peer.peer_id) > bytes(member.peer_id):
            # two peers asking each other at once (one sent by a leader's
            # ``_spare``, the other asking its senior): if both accepted, each
            # would follow the other and both end alone; one side waits
            await stream.send(["busy", "asking that peer to take this one"])
            return
        reply, slot = lobby.admit(member)
        await stream.send(reply)
        if slot is None:
            return
        async with trio.open_nursery() as nursery:

            async def watch_departure() -> None:
                # The follower sends nothing more; EOF or a broken stream means it left.
                with suppress(SwarmError, trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.receive()
                lobby.drop(slot)
                slot.settle(None)

            nursery.start_soon(watch_departure)
            await slot.ready.wait()
            nursery.cancel_scope.cancel()
        if slot.outcome is not None:
            with trio.move_on_after(self.config.request_timeout):
                await stream.send(slot.outcome)

    def _learn_routes(self, members: Iterable[GroupMember]) -> None:
        """Dial each member as its latest entry says: through the relay it
        names, or directly (which also forgets a relay it no longer uses)."""
        for member in members:
            if member.peer_id != self.peer.peer_id:
                self.peer.connections.set_relay_route(member.peer_id, member.relay)

    # looking for a group

    async def find_group(
        self,
        key: str,
        me: GroupMember,
        *,
        expected: Expected | None = None,
        resync: bool | None = None,
    ) -> Group | None:
        """Form or join a group under ``key``; None if none formed in time.

        ``expected`` is how many peers (this one included) the caller knows to
        be looking under this key, or which: a leader closes its group as soon
        as that many (those) are in, instead of waiting out
        ``matchmaking_time``; members it was not told of join too, up to the
        target group size, but never fill an awaited peer's place. Returns within
        ``config.bound`` seconds. ``resync`` is sent to the followers if this
        peer leads (``Group.resync``); as a follower it gets the leader's.
        Cancellation disbands this peer's followers (they look elsewhere) and
        propagates.
        """
        lobby = Lobby(key, me, self.config, expected, resync)
        join_by = self.peer.dht.now() + self.config.matchmaking_time
        me_candidate = Candidate(me, join_by)
        outcome: list[Group | None] = []
        done = trio.Event()

        def finish(group: Group | None) -> None:
            if not done.is_set():
                outcome.append(group)
                done.set()

        with self._serving(lobby), trio.move_on_after(self.config.bound):
            try:
                async with trio.open_nursery() as nursery:
                    if me.mode is not MemberMode.CLIENT:
                        # the lobby is open while the announcement spreads
                        nursery.start_soon(self._announce, key, me, join_by)
                        nursery.start_soon(self._lead, lobby, me_candidate, finish)
                    nursery.start_soon(self._seek, lobby, me_candidate, finish)
                    await done.wait()
                    nursery.cancel_scope.cancel()
            finally:
                if not lobby.closed:
                    lobby.disband("the leader stopped looking")
        return outcome[0] if outcome else None

    async def wait_lobby(self) -> Lobby:
        """Wait until this peer looks for a group; its lobby (for observers and tests)."""
        while self._lobby is None:
            await self._lobby_opened.wait()
        return self._lobby

    @contextmanager
    def _serving(self, lobby: Lobby) -> Iterator[None]:
        self._lobby = lobby
        self._lobby_opened.set()
        self._lobby_opened = trio.Event()
        try:
            yield
        finally:
            self._lobby = None

    async def _announce(self, key: str, me: GroupMember, join_by: float) -> None:
        expiration = join_by + 2 * self.config.request_timeout
        try:
            await self.peer.dht.store(
                key, announcement(me, join_by), expiration, subkey=owner_marker(self.peer.peer_id)
            )
        except SwarmError as e:
            log.warning("could not announce under %s: %s", key, e)

    async def _lead(self, lobby: Lobby, me: Candidate, finish: Any) -> None:
        """Close the lobby when it is full or at ``join_by``; form the group if
        it has enough members. While this peer's own join to a senior is
        accepted, its lobby is the senior's: wait for that to resolve."""
        deadline = trio.current_time() + self.config.matchmaking_time
        while True:
            with trio.move_on_at(deadline):
                while not lobby.full or lobby.following is not None:
                    await lobby.changed.wait()
            if lobby.following is not None:
                await lobby.changed.wait()
                continue
            await self._hand_over(lobby, me, deadline)
            if lobby.following is not None:
                continue  # it joined a senior meanwhile: its followers went there
            group = lobby.form()
            if group is not None:
                finish(group)
            return

    async def _hand_over(self, lobby: Lobby, me: Candidate, deadline: float) -> None:
        """Before closing the lobby, hand a member to a peer that would be left
        alone (``_spare``), and if the group filled before ``deadline`` while
        more peers than a group holds may look under the key, wait up to
        ``poll_interval`` (never past ``deadline``) for one beyond it.

        A full group closes early; a peer of its key that begins the round a
        moment later, or whose first read of the key came before this peer's
        announcement and so sleeps a poll, found the group formed and averaged
        with nobody (a grid line of 17, issue 19's scale run at 1,024 peers).
        Its announcement may not be readable yet either, so the read before
        closing misses it. Its join request is the sign that it exists: the
        full lobby turns it away (``Lobby.turned_away``) and reads the key again,
        where the asker's announcement now is, then hands it a member. A poll
        is the longest a seeking peer sleeps between reads, so any peer that
        is already looking asks within it; a later one is not waited for.
        Meanwhile this peer's own search for seniors goes on: a late peer
        that is senior to it (a shorter window) asks nobody, but this peer
        finds it and takes its group there. The cost: at most one read per
        peer turned away, and a group of exactly the target size forms up to
        a poll later (never past ``deadline``, which the smaller groups of a
        grid wait out anyway). Only a group that filled early and was not
        told it holds every expected peer waits: a lobby that reached
        ``deadline`` closes as before, and a caller's count that fits in one
        group (``Lobby.may_overflow``) still closes it at once.

        A lobby that holds every peer the caller expects, in one group, closes
        without ``_spare``'s read: nobody the caller knows of is left over,
        and the read, a round trip (more where a datagram is lost) between
        the last member's arrival and the group message, was on every step's
        path in a swarm that fits one group. A newcomer the caller did not
        count yet, whose announcement the read would have found before its
        join request came, averages alone for that round, as one that comes
        after the close always did; the next round counts it.
        """
        if lobby.full and not lobby.may_overflow:
            return
        if await self._spare(lobby, me) or not lobby.full:
            return
        grace_end = min(deadline, trio.current_time() + self.config.poll_interval)
        while lobby.following is None:
            with trio.move_on_at(grace_end):
                await lobby.turned_away.wait()
            if not lobby.turned_away.is_set():
                return
            lobby.turned_away = trio.Event()
            if await self._spare(lobby, me):
                return

    async def _spare(self, lobby: Lobby, me: Candidate) -> bool:
        """Before closing the lobby, read the key once more: if the peers under
        it outside this group are too few for a group of their own (one peer
        beyond a full group: a grid line one over the target size), redirect
        the followers they lack to the most senior of them that is junior to
        this peer, as long as this group keeps enough members and that peer's
        lobby is open long enough for them to join and closes while they still
        wait: they are junior to this peer, so they wait at least two request
        timeouts past its ``join_by``. Without this the one left over averaged
        with nobody, round after round. Only a junior: a senior that did not
        take this peer (which asked it) is dead, closed or full. The read is
        bounded by half a request timeout: the followers wait that long past
        ``join_by`` for their group. Returns whether it handed members over."""
        need = max(2, self.config.min_group_size)
        if len(lobby.slots) < need:
            return False  # nothing to give without falling below a group
        found: DHTValue | None = None
        with trio.move_on_after(self.config.request_timeout / 2):
            try:
                found = await self.peer.dht.get(lobby.key)
            except SwarmError as e:
                log.debug("reading %s before closing failed: %s", lobby.key, e)
        inside = {lobby.me.peer_id, *lobby.slots}
        outside = [c for c in parse_candidates(found, self.peer.peer_id) if c.peer_id not in inside]
        give = need - len(outside)
        members = len(lobby.slots) + 1
        if not outside or give <= 0 or members - give < need or lobby.closed:
            return False
        open_until = self.peer.dht.now() + self.config.request_timeout / 2
        leaders = [
            c
            for c in outside
            if c.member.mode is not MemberMode.CLIENT
            and open_until < c.join_by <= me.join_by + self.config.request_timeout
            and c.seniority() > me.seniority()
        ]
        if not leaders or lobby.following is not None:
            return False
        lobby.shed(give, min(leaders, key=Candidate.seniority))
        return True

    async def _seek(self, lobby: Lobby, me: Candidate, finish: Any) -> None:
        """Ask seniors to lead this peer until one forms a group with it.

        A leader that refused, disbanded or died is not asked again this round;
        one that was busy or unreachable for a moment is asked again after
        ``poll_interval`` (peers begin a round a little apart, and under load a
        request can time out). The lobby is read again after an eighth of
        ``poll_interval``, doubling to ``poll_interval``; meanwhile, a record
        stored under the key at this node (an announcement the DHT brought
        here: in a swarm of at most k peers, every one) is read at once, from
        this node's storage: a peer that read the lobby just before its leader
        announced itself joins when the announcement arrives, not a pause
        and a read later (at 10% packet loss a read may also wait for a
        resent request).

        The first look is at this node's storage too, before any read: the
        last peer of a step to begin looking, whose leader announced itself
        while it was still computing, finds the announcement already here
        and joins at once, a DHT round trip sooner, on the path of every
        step (the leader waits for that peer). Where storage holds no
        senior (a larger swarm, or the leader not announced yet), the
        network is read at once, as before.
        """
        final: set[PeerID] = set()
        retry_at: dict[PeerID, float] = {}
        # The first reads come quickly, then every ``poll_interval``: a peer
        # that read the lobby just before its leader announced itself slept a
        # whole interval, and a step of 30 ms took 550 (two digits peers).
        pause = self.config.poll_interval / 8
        next_read = -math.inf
        looked_here = False
        while True:
            network = looked_here and trio.current_time() >= next_read
            looked_here = True
            try:
                if network:
                    found = await self.peer.dht.get(lobby.key)
                else:  # the first look, or woken by a record that arrived here
                    found = self.peer.dht.get_local(lobby.key)
            except SwarmError as e:
                log.debug("reading %s failed: %s", lobby.key, e)
                found = None
            now = trio.current_time()
            candidates = parse_candidates(found, self.peer.peer_id)
            self._learn_routes(c.member for c in candidates)
            queue = [
                c
                for c in leaders_to_try(candidates, me)
                if c.peer_id not in final and retry_at.get(c.peer_id, -math.inf) <= now
            ]
            hops = 0
            while queue:
                leader = queue.pop(0)
                result = await self._join(lobby, leader)
                if isinstance(result, Group):
                    finish(result)
                    return
                if result is _RETRY:
                    retry_at[leader.peer_id] = trio.current_time() + self.config.poll_interval
                    continue
                final.add(leader.peer_id)
                if isinstance(result, Candidate) and hops < MAX_REDIRECTS:
                    hops += 1
                    if result.peer_id != self.peer.peer_id:
                        final.discard(result.peer_id)
                        queue.insert(0, result)
            if network:
                next_read = trio.current_time() + pause
                pause = min(2 * pause, self.config.poll_interval)
            with trio.move_on_at(next_read):
                await self.peer.dht.wait_for_store(lobby.key)

    def _redirected(self, wire: Any) -> Candidate:
        candidate = Candidate.from_wire(wire)
        self._learn_routes([candidate.member])
        return candidate

    async def _join(self, lobby: Lobby, leader: Candidate) -> Group | Candidate | object | None:
        """Ask ``leader`` to take us: the group it formed, a redirect, ``_RETRY``
        (busy or unreachable before it accepted us: ask again later) or None."""
        accepted = False
        self._asking = leader.peer_id
        try:
            with trio.fail_after(self.config.bound):
                address = (leader.member.host, leader.member.port)
                async with self.peer.connections.open_stream(
                    leader.peer_id, address, self.stream_name
                ) as stream:
                    with trio.fail_after(self.config.request_timeout):
                        await stream.send(["join", lobby.key, member_to_wire(lobby.me)])
                        reply = expect_message(await stream.receive(), "join reply")
                    if reply[0] == "redirect":
                        return self._redirected(reply[1])
                    if reply[0] == "busy":
                        return _RETRY
                    if reply[0] != "accepted" or lobby.closed:
                        log.debug("%s refused: %s", leader.peer_id.short(), reply[1:])
                        return None
                    accepted = True
                    self._asking = None
                    lobby.follow(leader)
                    wait = max(0.0, leader.join_by - self.peer.dht.now())
                    with trio.fail_after(wait + self.config.request_timeout):
                        outcome = expect_message(await stream.receive(), "join outcome")
            if outcome[0] == "group" and len(outcome) in (3, 4, 5):
                group_id, members_wire = outcome[1:3]
                if not isinstance(members_wire, list):
                    raise ProtocolError("group members must be a list")
                group = validate_group(
                    lobby.key,
                    expect_bytes(group_id, "group id", max_size=64),
                    tuple(member_from_wire(m) for m in members_wire),
                    self.peer.peer_id,
                    leader.peer_id,
                    self.config,
                    gathered=_gathered_from_wire(outcome[3:4]),
                    resync=_resync_from_wire(outcome[4:]),
                )
                self._learn_routes(group.members)
                return group
            if outcome[0] == "redirect" and len(outcome) == 2:
                return self._redirected(outcome[1])
            log.debug("%s disbanded: %s", leader.peer_id.short(), outcome[1:])
            return None
        except (SwarmError, trio.TooSlowError, IndexError) as e:
            # per-peer boundary: this leader failed us; the caller tries another
            log.debug("joining %s failed: %s", leader.peer_id.short(), e)
            return None if accepted else _RETRY
        finally:
            self._asking = None
            if accepted and lobby.following is leader:
                lobby.unfollow()
