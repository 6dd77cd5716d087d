"""Which peers a round waits for: not a peer that went silent, and a peer
nobody counted never takes the place of one that was."""

from __future__ import annotations

from averaging import GroupMember, MatchmakingConfig
from averaging._matchmaking import Lobby
from swarm import Identity, PeerID
from trainer._optimizer import expected_peers
from trainer._progress import PeerProgress, SwarmProgress
from trainer._progress_tracker import Reading, awaited_peers


def _id(seed: int) -> PeerID:
    return Identity.from_seed(bytes([seed]) * 32).peer_id


def _record(seed: int, epoch: int, time: float) -> PeerProgress:
    return PeerProgress(_id(seed), epoch, 0, 10.0, time)


def test_a_round_waits_for_peers_at_its_epoch_and_for_live_ones_just_behind() -> None:
    now = 100.0
    records = [
        _record(1, 5, 99.9),  # at the epoch
        _record(2, 5, 80.0),  # at the epoch but silent for 20 s: dead, although not yet stale
        _record(7, 6, 99.0),  # ahead (it averaged without us): live, in the round
        _record(3, 4, 99.5),  # one behind, still publishing: finishing the last step
        _record(4, 4, 95.0),  # one behind and silent for 5 s: dead, not waited for
        _record(5, 3, 99.9),  # two behind: catching up, not in this round
        _record(6, 5, 60.0),  # stale: gone
    ]
    kw = dict(now=now, epoch=5, stale_after=30.0, fresh_within=2.5)
    assert awaited_peers(records, **kw) == {_id(1), _id(7), _id(3)}  # type: ignore[arg-type]
    assert expected_peers(records, **kw) == 3  # type: ignore[arg-type]
    assert expected_peers([], **kw) == 1  # type: ignore[arg-type]


def _member(seed: int) -> GroupMember:
    return GroupMember(_id(seed), "127.0.0.1", 1000 + seed)


async def test_a_lobby_that_awaits_peers_closes_only_when_they_are_in() -> None:
    # Peer 4 was two epochs behind when the leader read the swarm (so it was
    # not counted), then downloaded the state and joined this round first.
    config = MatchmakingConfig(target_group_size=16)
    awaited = frozenset({_id(1), _id(2), _id(3)})
    lobby = Lobby("key", _member(1), config, awaited)
    assert lobby.admit(_member(4))[0] == ["accepted"]
    assert lobby.admit(_member(2))[0] == ["accepted"]
    assert not lobby.full  # a count of 3 would close here, leaving peer 3 out
    assert lobby.admit(_member(3))[0] == ["accepted"]
    assert lobby.full
    group = lobby.form()
    assert group is not None
    assert {m.peer_id for m in group.members} == {_id(1), _id(2), _id(3), _id(4)}


async def test_a_lobby_given_a_count_closes_at_that_many_members_whoever_they_are() -> None:
    lobby = Lobby("key", _member(1), MatchmakingConfig(target_group_size=16), 3)
    lobby.admit(_member(4))
    assert not lobby.full
    lobby.admit(_member(2))
    assert lobby.full


async def test_the_target_group_size_closes_a_lobby_still_awaiting_peers() -> None:
    awaited = frozenset(_id(i) for i in range(1, 6))
    lobby = Lobby("key", _member(1), MatchmakingConfig(target_group_size=3), awaited)
    lobby.admit(_member(2))
    assert not lobby.full
    lobby.admit(_member(9))
    assert lobby.full
    assert lobby.admit(_member(3))[0] == ["refused", "group is full"]


def test_a_step_after_the_reading_expects_the_peers_that_had_reached_its_eve() -> None:
    """A peer whose reading is from before its last step ended takes the
    step by the peers the reading names for it (``awaited_next``; no read in
    the step's way); when the reading cannot name them, a fresh read must."""
    swarm = SwarmProgress(5, 0, 256, 100.0, 3, 3, 1.0)
    this, at_epoch, behind = {_id(1)}, {_id(1), _id(2)}, {_id(1), _id(2), _id(3)}

    def reading(awaited_next: frozenset[PeerID] | None) -> Reading:
        return Reading(swarm, 5, 32, 0.0, 3, frozenset(behind), awaited_next=awaited_next)

    assert reading(frozenset(at_epoch)).round_of(5) == behind  # its own epoch: as before
    assert reading(frozenset(at_epoch)).round_of(6) == at_epoch  # the step after it
    assert reading(frozenset(at_epoch)).round_of(7) is None  # a download jumped epochs
    assert reading(frozenset(this)).round_of(6) is None  # the others were all behind
    assert reading(None).round_of(6) is None  # the tree's totals name nobody
