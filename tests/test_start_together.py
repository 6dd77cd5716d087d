"""Peers that wait for each other start together: the first round holds them all.

The peer that starts a run waits in ``wait_for_peers``; the last to join finds
everyone there and starts at once. It fills the first target batch alone and
opens the first round, which stays open for one matchmaking window: a waiter
that notices the run is complete later than that misses the round, falls
behind and downloads the state instead of training from the first step.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
from trainer_harness import FAST, TrainingPeer, training_config, training_peers

from swarm import PeerID
from trainer import CollaborativeOptimizer

#: A progress interval far longer than the matchmaking window (1.5 s): a waiter
#: that polled only once per interval would be late for the first round.
SLOW_PROGRESS = replace(FAST, progress_interval=5.0, progress_ttl=30.0)


def test_the_first_peer_is_in_the_first_round_with_the_peer_it_waited_for() -> None:
    torch.set_num_threads(1)
    contributors: dict[int, list[frozenset[PeerID]]] = {0: [], 1: []}
    optimizers: dict[int, CollaborativeOptimizer] = {}
    first_waits = threading.Event()

    def on_start(i: int):  # type: ignore[no-untyped-def]
        def started(opt: CollaborativeOptimizer) -> None:
            optimizers[i] = opt
            if i == 0:
                first_waits.set()

        return started

    def on_epoch(i: int):  # type: ignore[no-untyped-def]
        def record(opt: CollaborativeOptimizer, report: object) -> None:
            assert opt.last_step is not None
            contributors[i].append(opt.last_step.contributors)

        return record

    with training_peers(2) as (_, peers):
        configs = [
            training_config(
                i, min_peers=2, max_epochs=3, target_batch_size=64, optimizer=SLOW_PROGRESS
            )
            for i in range(2)
        ]
        first = TrainingPeer(peers[0], configs[0])
        first.start(on_epoch=on_epoch(0), on_start=on_start(0))
        # the second joins once the first is in the run (it downloads its state)
        assert first_waits.wait(60.0)
        second = TrainingPeer(peers[1], configs[1])
        second.start(on_epoch=on_epoch(1), on_start=on_start(1))
        reports = [first.join(), second.join()]

    both = frozenset(p.peer_id for p in peers)
    for i, report in enumerate(reports):
        assert report.epochs == 3
        # every global step, the first included, averaged both peers' data
        assert contributors[i] == [both, both, both], (i, contributors[i])
    # the first peer trained from the start: it never downloaded anyone's state
    assert optimizers[0].state_source is None
    assert optimizers[1].state_source == peers[0].peer_id
