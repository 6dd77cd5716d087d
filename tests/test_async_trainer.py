"""``AsyncCollaborativeOptimizer`` on virtual time (``async_trainer_harness``):
its tensor work off the event loop, weight-0 joins, the async API. Several
peers training together in each mode: test_trainer, test_diloco, test_ef21m."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trio
import trio.testing
from async_trainer_harness import held_clock
from peer_harness import open_peers, trio_wall_clock
from trainer_harness import FAST

from trainer import AsyncCollaborativeOptimizer, load_task


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    return held_clock(monkeypatch)


async def test_tensor_work_never_runs_on_the_trio_thread(
    clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The inner optimizer step, the gradient hook and the checkpoint capture of
    a global step all run in worker threads, never on the event loop's."""
    torch.manual_seed(0)
    task = load_task("digits")
    model, inner, _ = task.build(seed=0)
    batches = task.batches(0, 32)
    trio_thread = threading.get_ident()
    threads: dict[str, set[int]] = {"inner step": set(), "grad hook": set(), "capture": set()}

    def grad_hook(params: list[torch.nn.Parameter]) -> float:
        threads["grad hook"].add(threading.get_ident())
        return float(torch.stack([p.grad.norm() for p in params if p.grad is not None]).norm())

    inner.register_step_pre_hook(lambda *_: threads["inner step"].add(threading.get_ident()))
    # a checkpoint's capture reads the inner optimizer's state_dict
    inner.register_state_dict_pre_hook(lambda *_: threads["capture"].add(threading.get_ident()))
    async with (
        open_peers(1, seed=5, clock=trio_wall_clock) as peers,
        AsyncCollaborativeOptimizer.open(
            peers.alive[0],
            run_id="async-threads",
            params=model.parameters(),
            optimizer=inner,
            target_batch_size=64,
            batch_size_per_step=32,
            grad_hook=grad_hook,
            config=FAST,
            checkpoint_dir=tmp_path,
        ) as opt,
    ):
        for _ in range(20):  # bounded: a global step every two batches
            if opt.epoch >= 2:
                break
            loss, size = task.loss(model, next(batches))
            loss.backward()
            await opt.step(size, loss=loss.detach())
            opt.zero_grad()
        assert opt.epoch == 2
        assert opt.last_step is not None and opt.last_step.hook_result is not None
    assert all(threads.values()), threads  # each kind of work happened
    for kind, idents in threads.items():
        assert trio_thread not in idents, kind


@pytest.mark.parametrize("lossy", [False, True], ids=["tcp", "lossy-riding"])
async def test_a_peer_that_catches_up_joins_its_formed_group_with_weight_0(
    clock: trio.testing.MockClock, lossy: bool
) -> None:
    """Two peers found their epoch's group ahead of the step; one must catch up
    instead of averaging. It takes part in the round with weight 0: the other's
    round completes without waiting out a sender timeout, with the catching-up
    peer a member but not a contributor, and its own accumulators untouched.
    In a lossy run whose group re-synchronises, the weight-0 member brings
    as many values as the parameters that ride with the gradients."""
    torch.manual_seed(0)
    task = load_task("digits")
    batches = task.batches(0, 32)
    config = replace(FAST, lossy=True, state_averaging_interval=4) if lossy else FAST
    async with open_peers(2, seed=7, clock=trio_wall_clock) as peers:
        a_peer, b_peer = peers.alive
        models = [task.build(seed=0) for _ in range(2)]
        async with (
            AsyncCollaborativeOptimizer.open(
                a_peer, run_id="weight-0", params=models[0][0].parameters(),
                optimizer=models[0][1], target_batch_size=10_000,
                batch_size_per_step=32, config=config,
            ) as a,
            AsyncCollaborativeOptimizer.open(
                b_peer, run_id="weight-0", params=models[1][0].parameters(),
                optimizer=models[1][1], target_batch_size=10_000,
                batch_size_per_step=32, config=config,
            ) as b,
        ):  # fmt: skip
            for opt, (model, _, _) in zip((a, b), models, strict=True):
                loss, size = task.loss(model, next(batches))
                loss.backward()
                assert not await opt.step(size)  # far from the target: accumulated
                opt.zero_grad()
                if lossy:  # as measured on a lossy link: a re-synchronisation per epoch
                    assert opt._resync is not None
                    opt._resync.loss = 1.0
            b_before = [t.clone() for t in b._staging.host]
            await a._begin_matchmaking(0, 2)
            await b._begin_matchmaking(0, 2)
            for opt in (a, b):
                assert opt._prematch is not None
                await opt._prematch.done.wait()
                assert opt._prematch.group is not None
            await b._join_formed_group()
            started = trio.current_time()
            result = await a._finish_averaging(32.0, 2)
            assert trio.current_time() - started < FAST.averaging.allreduce.sender_timeout
            assert result.group is not None
            assert set(result.members) == {a_peer.peer_id, b_peer.peer_id}
            assert result.contributors == {a_peer.peer_id}
            assert result.group.resync is (True if lossy else None)
            # the parameters rode with the gradients (epoch 1 is no multiple of 4)
            assert (a._rode is not None and a._rode[0] == 1) is lossy
            joining = b._joining
            if joining is not None:
                await joining.wait()
            assert b._joining is None
            for x, y in zip(b._staging.host, b_before, strict=True):
                assert torch.equal(x, y)  # nothing of the round landed in b's own tensors


async def test_a_peer_every_other_peer_stepped_past_stops_waiting_for_a_group(
    clock: trio.testing.MockClock,
) -> None:
    """A peer late for its epoch's group (the others reached the target and
    stepped without it) gives up the group as soon as a reading shows nobody
    else at that epoch, instead of waiting out the matchmaking bound for a
    group that can no longer form; a peer whose partner is still at its
    epoch waits the bound as before."""
    torch.manual_seed(0)
    task = load_task("digits")
    batches = task.batches(0, 32)
    bound = FAST.averaging.matchmaking.bound
    async with open_peers(2, seed=7, clock=trio_wall_clock) as peers:
        a_peer, b_peer = peers.alive
        models = [task.build(seed=0) for _ in range(2)]
        async with (
            AsyncCollaborativeOptimizer.open(
                a_peer, run_id="passed-by", params=models[0][0].parameters(),
                optimizer=models[0][1], target_batch_size=64,
                batch_size_per_step=32, config=FAST,
            ) as a,
            AsyncCollaborativeOptimizer.open(
                b_peer, run_id="passed-by", params=models[1][0].parameters(),
                optimizer=models[1][1], target_batch_size=64,
                batch_size_per_step=32, config=FAST,
            ) as b,
        ):  # fmt: skip
            assert await a.wait_for_peers(2, timeout=30.0)
            assert await b.wait_for_peers(2, timeout=30.0)

            async def batch(opt: AsyncCollaborativeOptimizer, model: torch.nn.Module) -> bool:
                loss, size = task.loss(model, next(batches))
                loss.backward()
                stepped = await opt.step(size)
                opt.zero_grad()
                return stepped

            # b computes nothing (a peer that is downloading the state, say);
            # a reaches the target and waits the bound for b, which is at its
            # epoch still
            await b._refresh_now(time.monotonic(), force=True)
            for _ in range(8):  # bounded: 64 samples, more with b's estimated rate
                if await batch(a, models[0][0]):
                    break
            assert a.epoch == 1 and a.last_step is not None
            a_result = a.last_step.averaging
            assert a_result is not None and a_result.reason == "no group formed in time"
            await a._refresh_now(time.monotonic(), force=True)  # a's record at epoch 1
            # b now averages its epoch, which nobody else is at any more
            started = trio.current_time()
            result = await b._finish_averaging(32.0, 2)
            assert result.group is None
            assert result.reason == "every other peer stepped past this epoch"
            assert trio.current_time() - started < bound / 2
            assert b._prematch is None
