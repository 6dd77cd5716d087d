"""A lossy run's re-synchronisations ride with the gradients (``trainer._drift``):
where the group re-synchronises at an epoch that is not a multiple of
``state_averaging_interval``, the parameters and buffers are averaged in the
gradient round itself, and only the multiples run a state round (the
optimizer's moments too). Real peers on 127.0.0.1, real training threads."""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import replace

import pytest
import torch
from trainer_harness import FAST, TrainingPeer, training_config, training_peers, whole_group

from trainer import CollaborativeOptimizer

_ROUND = re.compile(r"epoch (\d+): averaged (gradients and parameters|gradients|parameters) ")


def test_parameters_ride_with_the_gradients_between_whole_state_rounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two peers start from different weights, so equal parameters after a
    global step come from a re-synchronisation. The measured loss is set
    high (nothing is lost on 127.0.0.1), which puts the run on a
    re-synchronisation after every epoch: epochs 1-3 and 5-6 average the
    parameters in their gradient round, epoch 4 (a multiple of 4) in a state
    round of the whole state, and no other state round runs."""
    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="trainer")
    caplog.set_level(logging.INFO, logger="averaging")
    config = replace(FAST, state_averaging_interval=4, lossy=True)
    params: dict[int, dict[int, list[torch.Tensor]]] = {}
    stagings: dict[int, set[int]] = {0: set(), 1: set()}
    lock = threading.Lock()

    def recorder(i: int):  # type: ignore[no-untyped-def]
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            with lock:
                if opt._riding_staging is not None:
                    stagings[i].add(id(opt._riding_staging))
                if whole_group(opt):
                    params.setdefault(opt.epoch, {})[i] = [p.detach().clone() for p in opt.params]

        return on_epoch

    def lossy_link(opt: CollaborativeOptimizer) -> None:
        # what a link losing most pieces would have measured: the estimate
        # decays by 0.9 a loopback round, so it stays above the 0.3 that
        # shortens the period to one epoch (``ResyncSchedule``) for the run
        assert opt._resync is not None
        opt._resync.loss = 1.0

    with training_peers(2) as (_, peers):
        trainers = [
            TrainingPeer(
                p,
                training_config(i, max_epochs=6, model_seed=i, min_peers=2, optimizer=config),
            )
            for i, p in enumerate(peers)
        ]
        for i, t in enumerate(trainers):
            t.start(on_epoch=recorder(i), on_start=lossy_link)
        reports = [t.join() for t in trainers]
    assert all(r.epochs == 6 for r in reports)

    logged: dict[str, set[int]] = {}
    for record in caplog.records:
        match = _ROUND.search(record.getMessage())
        if match and record.name == "trainer._optimizer":
            logged.setdefault(match[2], set()).add(int(match[1]))
    # gradient rounds are logged at the epoch they began, state rounds at
    # the epoch they followed: the rounds of epochs 0-2 and 4-5 carried the
    # parameters of epochs 1-3 and 5-6
    assert logged.get("gradients and parameters") == {0, 1, 2, 4, 5}
    assert logged.get("gradients") == {3}
    assert logged.get("parameters") == {4}
    state_rounds = [r for r in caplog.records if "averaged parameters" in r.getMessage()]
    assert len(state_rounds) == 2  # epoch 4's, one a peer

    # one host copy of the parameters, built once and reused by every ride
    assert [len(ids) for ids in stagings.values()] == [1, 1]
    # before epoch 4's state round, only a ride can have made them equal
    both = {e: s for e, s in params.items() if len(s) == 2 and e < 4}
    assert both, "no global step before epoch 4 that both peers averaged whole"
    for epoch, by_peer in sorted(both.items()):
        for a, b in zip(by_peer[0], by_peer[1], strict=True):
            assert torch.equal(a, b), f"epoch {epoch}: the peers differ"
