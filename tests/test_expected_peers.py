"""Which peers a round waits for: not a peer that went silent."""

from __future__ import annotations

from swarm import Identity
from trainer._optimizer import expected_peers
from trainer._progress import PeerProgress


def _record(seed: int, epoch: int, time: float) -> PeerProgress:
    return PeerProgress(Identity.from_seed(bytes([seed]) * 32).peer_id, epoch, 0, 10.0, time)


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
    assert expected_peers(records, **kw) == 3  # type: ignore[arg-type]
    assert expected_peers([], **kw) == 1  # type: ignore[arg-type]
