"""Collaborative training in one process: three (then four) peers train digits."""

from __future__ import annotations

import threading

import torch
from trainer_harness import TrainingPeer, training_config, training_peers

from trainer import CollaborativeOptimizer


def _fingerprint(opt: CollaborativeOptimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in opt.params]


def _whole_group(opt: CollaborativeOptimizer) -> bool:
    """Did the last global step average every chunk over every member?"""
    step = opt.last_step
    if step is None or step.averaging is None or step.averaging.allreduce is None:
        return False
    result = step.averaging.allreduce
    everyone = frozenset(range(len(step.averaging.members)))
    return all(chunk == everyone for part in result.contributors for chunk in part if part)


def test_three_peers_train_digits_together() -> None:
    torch.set_num_threads(1)
    params: dict[int, dict[int, list[torch.Tensor]]] = {}
    groups: dict[int, dict[int, tuple[bytes, ...]]] = {}
    samples: dict[int, dict[int, int]] = {}
    lock = threading.Lock()

    def recorder(i: int):  # type: ignore[no-untyped-def]
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            step = opt.last_step
            assert step is not None
            with lock:
                samples.setdefault(step.epoch, {})[i] = step.samples
                if _whole_group(opt) and step.averaging is not None:
                    params.setdefault(opt.epoch, {})[i] = _fingerprint(opt)
                    groups.setdefault(opt.epoch, {})[i] = step.averaging.members

        return on_epoch

    with training_peers(3) as (_, peers):
        trainers = [TrainingPeer(p, training_config(i, max_epochs=25)) for i, p in enumerate(peers)]
        for i, t in enumerate(trainers):
            t.start(on_epoch=recorder(i))
        reports = [t.join() for t in trainers]

    for report in reports:
        assert report.epochs == 25
        assert report.metrics["accuracy"] >= 0.90, report.metrics
    # every global step consumed at least the target batch, summed over the peers
    for epoch, by_peer in samples.items():
        if len(by_peer) == 3:
            assert sum(by_peer.values()) >= 192, (epoch, by_peer)
    # peers that averaged every chunk together hold identical parameters
    compared = 0
    for epoch, by_peer in params.items():
        for i, j in [(0, 1), (0, 2), (1, 2)]:
            if i in by_peer and j in by_peer and groups[epoch][i] == groups[epoch][j]:
                for a, b in zip(by_peer[i], by_peer[j], strict=True):
                    assert torch.equal(a, b), f"epoch {epoch}: peers {i} and {j} differ"
                compared += 1
    assert compared >= 20
