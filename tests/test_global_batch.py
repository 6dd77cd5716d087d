"""A global step averages the target batch: the rules of ``trainer._global_batch``,
and four peers training together."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from trainer_harness import TrainingPeer, training_config, training_peers

from swarm import Identity, PeerID, ProtocolError
from trainer import CollaborativeOptimizer, PeerProgress, others_progress
from trainer._progress import RateMeter

ME, A, B, C = (Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 5))


def _record(peer: PeerID, epoch: int, samples: int, rate: float, time: float) -> PeerProgress:
    return PeerProgress(peer, epoch, samples, rate, time)


def test_the_others_are_extrapolated_at_their_rates_and_mine_counted_exactly() -> None:
    records = [
        _record(ME, 3, 500, 1000.0, 100.0),  # mine: the optimizer's exact count is used
        _record(A, 3, 64, 100.0, 99.5),
        _record(B, 3, 32, 200.0, 99.9),
    ]
    others = others_progress(records, me=ME, epoch=3, now=100.0, stale_after=30.0, horizon=1.0)
    assert others.samples == pytest.approx(64 + 50 + 32 + 20)
    assert others.rate == pytest.approx(300.0)
    # 0.25 s later: A is extrapolated for its last 0.5 s of horizon, B for 0.9 s
    assert others.total(10, 0.25) == pytest.approx(166 + 300 * 0.25 + 10)


def test_a_record_older_than_the_horizon_is_not_extrapolated_further() -> None:
    # A died 5 s ago with a high rate: its samples count, its rate only for the horizon
    records = [_record(A, 0, 100, 1000.0, 95.0), _record(B, 0, 10, 10.0, 100.0)]
    others = others_progress(records, me=ME, epoch=0, now=100.0, stale_after=30.0, horizon=0.5)
    assert others.samples == pytest.approx(100 + 500 + 10)
    assert others.rate == pytest.approx(10.0)
    assert others.total(0, 10.0) == pytest.approx(610 + 10 * 0.5)


def test_a_peer_that_stopped_adding_counts_exactly_what_it_has() -> None:
    # it is averaging this epoch: its count is final, whatever its rate
    stopped = PeerProgress(A, 2, 96, 500.0, 99.0, stopped=True)
    others = others_progress([stopped], me=ME, epoch=2, now=100.0, stale_after=30.0, horizon=1.0)
    assert others.total(0, 5.0, prior=100.0) == 96


def test_other_epochs_and_stale_records_are_left_out() -> None:
    records = [
        _record(A, 0, 1000, 10.0, 100.0),  # two epochs behind: catching up
        _record(B, 3, 1000, 10.0, 100.0),  # ahead: the optimizer catches up instead
        _record(C, 2, 1000, 10.0, 60.0),  # silent for 40 s: presumed gone
    ]
    others = others_progress(records, me=ME, epoch=2, now=100.0, stale_after=30.0, horizon=1.0)
    assert others.samples == 0 and others.rate == 0
    assert others.total(7, 3.0) == 7


def test_time_before_the_reading_or_a_record_from_the_future_adds_nothing() -> None:
    others = others_progress(
        [_record(A, 0, 5, 100.0, 101.0)], me=ME, epoch=0, now=100.0, stale_after=30.0, horizon=1.0
    )
    assert others.samples == 5
    assert others.total(0, -1.0) == 5
    assert others.total(0, 0.5) == pytest.approx(55)


def test_each_global_step_of_four_peers_averages_the_target_batch() -> None:
    """The promise, end to end: summed over the peers that took it, a global
    step holds the target batch give or take one local batch per peer (it held
    2 to 12 times the target while peers decided on readings of reported counts)."""
    torch.set_num_threads(1)
    peers_count, target, batch = 4, 256, 32
    samples: dict[int, dict[int, int]] = {}
    sizes: dict[int, dict[int, int]] = {}
    lock = threading.Lock()

    def recorder(i: int) -> Callable[[CollaborativeOptimizer, object], None]:
        def on_epoch(opt: CollaborativeOptimizer, report: object) -> None:
            step = opt.last_step
            assert step is not None
            with lock:
                samples.setdefault(step.epoch, {})[i] = step.samples
                members = 0 if step.averaging is None else len(step.averaging.members)
                sizes.setdefault(step.epoch, {})[i] = members

        return on_epoch

    with training_peers(peers_count) as (_, peers):
        trainers = [
            TrainingPeer(
                p,
                training_config(
                    i, target_batch_size=target, batch_size=batch, max_epochs=12, min_peers=4
                ),
            )
            for i, p in enumerate(peers)
        ]
        for i, t in enumerate(trainers):
            t.start(on_epoch=recorder(i))
        for t in trainers:
            t.join()

    # the steps every peer took in one group of all of them (the first, which
    # the last peer to start may miss, and any a slow peer missed, aside):
    # there, each peer stopped adding on its own estimate of the others
    whole = [
        epoch
        for epoch, by_peer in sizes.items()
        if len(by_peer) == peers_count and all(n == peers_count for n in by_peer.values())
    ]
    assert len(whole) >= 4, sizes
    # Each peer stops on an estimate of the others (their records and rates,
    # on the wall clock of a loaded machine): a step that followed a late
    # reading may miss the band, so the promise is checked on the median step,
    # and no step may hold what deciding on reported counts gave (2 to 12
    # times the target in this test).
    slack = peers_count * batch
    totals = sorted(sum(samples[epoch].values()) for epoch in whole)
    median = totals[len(totals) // 2]
    assert target - slack <= median <= target + slack, (totals, samples)
    assert totals[-1] <= 2.5 * target, (totals, samples)


def test_the_rate_others_extrapolate_counts_the_time_between_steps_not_the_round() -> None:
    rate = RateMeter(alpha=1.0)  # the latest batch only, to read each rule alone
    rate.update(10.0, 64)
    rate.update(10.1, 64)
    assert rate.rate == pytest.approx(640.0)  # a batch of 64 every 0.1 s
    rate.pause()  # averaging: the round's 2 s are not this peer's compute
    rate.resume(12.1)  # the step is over: the inner step, an evaluation, data
    rate.update(12.5, 64)
    # the others extrapolate this peer from the round's end: the 0.4 s before
    # its first batch are time per sample as they see it
    assert rate.rate == pytest.approx(160.0)


def test_a_group_mate_whose_round_began_counts_exactly_its_announced_weight() -> None:
    # A's record is a refresh old and still adding; its all-reduce stream
    # already said it began the round with 96 samples. C began too, unread.
    records = [_record(A, 5, 64, 1000.0, 100.0), _record(B, 5, 32, 1000.0, 100.0)]
    others = others_progress(records, me=ME, epoch=5, now=100.0, stale_after=30.0, horizon=1.0)
    settled = others.settled({A: 96.0, C: 40.0})
    # A and C exactly, no more; B still extrapolated at its rate
    assert settled.total(0, 0.05) == pytest.approx(96 + 40 + 32 + 50)
    assert settled.rate == pytest.approx(1000.0)
    assert others.settled({}) is others


def test_the_rate_is_samples_over_seconds_not_a_mean_of_batch_rates() -> None:
    rate = RateMeter(alpha=0.5)
    now = 0.0
    rate.update(now, 32)
    for seconds in (0.001, 0.010, 0.001, 0.010):
        now += seconds
        rate.update(now, 32)
    # the averaged batch: (((32+32)/2+32)/2+32)/2 samples over the same
    # average of the seconds; the mean of the batch rates would be 3x this
    assert rate.rate == pytest.approx(32 / ((((0.001 + 0.010) / 2 + 0.001) / 2 + 0.010) / 2))
    assert rate.rate < 32 / 0.003


def test_a_peer_of_unmeasured_rate_counts_at_the_askers_rate() -> None:
    # the first step: A has not measured its rate yet; B averages (stopped)
    records = [_record(A, 0, 32, 0.0, 100.0), _record(B, 0, 64, 0.0, 100.0)]
    records[1] = PeerProgress(B, 0, 64, 0.0, 100.0, stopped=True)
    others = others_progress(records, me=ME, epoch=0, now=100.0, stale_after=30.0, horizon=1.0)
    assert others.total(16, 0.5, prior=100.0) == pytest.approx(32 + 64 + 50 + 16)


def test_a_peer_one_epoch_behind_counts_toward_the_next_at_its_rate() -> None:
    # both finish epoch 4's step (B's record was published before it stopped)
    finishing = PeerProgress(A, 4, 300, 200.0, 99.5, stopped=True)
    not_yet_stopped = _record(B, 4, 300, 100.0, 100.0)
    silent = _record(C, 4, 300, 100.0, 90.0)  # too old to be a live peer's
    others = others_progress(
        [finishing, not_yet_stopped, silent],
        me=ME,
        epoch=5,
        now=100.0,
        stale_after=30.0,
        horizon=1.0,
    )
    assert others.samples == 0
    assert others.total(0, 0.5) == pytest.approx(150.0)


def test_a_peer_still_adding_counts_for_at_least_one_micro_batch() -> None:
    # the start of epoch 5: A and B finish epoch 4's round, C began epoch 5
    # but has not published a batch yet; none has computed anything of epoch 5
    finishing = PeerProgress(A, 4, 96, 1000.0, 100.0, stopped=True, batch=24)
    unpublished = PeerProgress(B, 4, 96, 1000.0, 100.0, stopped=True)  # an older peer: no batch
    began = PeerProgress(C, 5, 0, 1000.0, 100.0, batch=40)
    others = others_progress(
        [finishing, unpublished, began], me=ME, epoch=5, now=100.0, stale_after=30.0, horizon=1.0
    )
    # each adds at least its own batch (B the asking peer's, 32) before it can stop
    assert others.total(32, 0.0, prior_batch=32) == 24 + 32 + 40 + 32
    # extrapolation past the floor counts as before
    assert others.total(32, 0.1, prior_batch=32) == pytest.approx(3 * 100.0 + 32)


def test_no_floor_for_a_peer_that_stopped_or_went_quiet() -> None:
    stopped = PeerProgress(A, 5, 0, 1000.0, 100.0, stopped=True, batch=32)
    quiet = PeerProgress(B, 5, 0, 10.0, 98.0, batch=32)  # older than the horizon
    others = others_progress(
        [stopped, quiet], me=ME, epoch=5, now=100.0, stale_after=30.0, horizon=1.0
    )
    # the quiet one: its rate for the horizon (10 samples), not a batch it may never add
    assert others.total(0, 0.5, prior_batch=32) == pytest.approx(10.0)


def test_the_micro_batch_travels_in_the_record_and_older_records_parse() -> None:
    record = PeerProgress(A, 3, 64, 10.0, 1.0, batch=32)
    assert PeerProgress.from_value(A, record.to_value()) == record
    older = {k: v for k, v in record.to_value().items() if k != "batch"}
    assert PeerProgress.from_value(A, older).batch == 0
    with pytest.raises(ProtocolError):
        PeerProgress.from_value(A, {**record.to_value(), "batch": -1})
