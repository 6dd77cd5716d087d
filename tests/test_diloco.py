"""DiLoCo mode: the outer step's arithmetic, then real peers in one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import trio
import trio.testing
from async_trainer_harness import Snapshots, Together, held_clock, newcomer, train_together
from peer_harness import Peers
from trainer_harness import (
    FAST,
    TrainingPeer,
    join_run,
    training_config,
    training_peers,
)

from averaging import NONE
from swarm import ConfigError, ProtocolError
from trainer import AsyncCollaborativeOptimizer, CollaborativeOptimizer, DiLoCo
from trainer._diloco import OuterLoop


def test_config_is_validated() -> None:
    for bad in (
        {"local_steps": 0},
        {"outer_lr": 0.0},
        {"outer_lr": float("nan")},
        {"outer_momentum": 1.0},
        {"outer_momentum": 0.0, "nesterov": True},
    ):
        with pytest.raises(ConfigError):
            DiLoCo(**bad)  # type: ignore[arg-type]
    assert DiLoCo(outer_momentum=0.0, nesterov=False).outer_momentum == 0.0


def test_outer_steps_are_nesterov_sgd_on_the_pseudo_gradient() -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    loop = OuterLoop([param], DiLoCo(local_steps=3, outer_lr=0.5, outer_momentum=0.9))
    synced, momentum = torch.tensor([1.0, -2.0]), torch.zeros(2)
    for local in (torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0])):
        with torch.no_grad():
            param.add_(local)  # what the local steps did
        loop.compute_pseudo_gradients()
        delta = synced - param.detach()
        assert torch.equal(loop.deltas[0], delta)
        loop.outer_step()
        momentum = 0.9 * momentum + delta
        synced = synced - 0.5 * (delta + 0.9 * momentum)
        assert torch.allclose(param.detach(), synced)
        assert torch.allclose(loop.synced[0], synced)
        assert torch.allclose(loop.momentum()[0], momentum)
        assert loop.local_steps == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_synced_copy_on_the_host_steps_as_one_next_to_the_parameters(
    dtype: torch.dtype,
) -> None:
    """The previous behaviour as the reference: ``synced`` a copy next to the
    parameters, stepped there by SGD with Nesterov momentum."""
    torch.manual_seed(3)
    params = [
        torch.nn.Parameter(torch.randn(5).to(dtype)),
        torch.nn.Parameter(torch.randn(2, 3).to(dtype)),
    ]
    reference = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    loop = OuterLoop(params, DiLoCo(local_steps=2))
    for s, p in zip(loop.synced, params, strict=True):
        assert s.device.type == "cpu"
        assert s.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    for step in range(3):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape).to(dtype))  # what the local steps did
        loop.compute_pseudo_gradients()
        for delta, r, p in zip(loop.deltas, reference, params, strict=True):
            assert delta.dtype == torch.float32
            assert torch.equal(delta, (r - p.detach()).float())
        # what the all-reduce hands back: a host copy of the (averaged) deltas
        averaged = [d.clone() for d in loop.deltas]
        for r, d in zip(reference, averaged, strict=True):
            r.grad = d.to(dtype)
        outer.step()
        loop.outer_step(averaged if step % 2 else None)  # the host copy, or deltas
        for s, r, p in zip(loop.synced, reference, params, strict=True):
            assert torch.equal(s, r)
            assert torch.equal(p.detach(), r)
        for m, r in zip(loop.momentum(), reference, strict=True):
            assert torch.equal(m, outer.state[r]["momentum_buffer"])


def test_outer_state_round_trips_and_is_checked() -> None:
    a = torch.nn.Parameter(torch.ones(3))
    loop = OuterLoop([a], DiLoCo())
    with torch.no_grad():
        a.sub_(0.1)
    loop.compute_pseudo_gradients()
    loop.outer_step()
    other = OuterLoop([torch.nn.Parameter(a.detach().clone())], DiLoCo())
    other.load_state_dict(loop.state_dict())
    assert torch.equal(other.momentum()[0], loop.momentum()[0])
    assert torch.equal(other.synced[0], loop.synced[0])
    with pytest.raises(ProtocolError):
        other.load_state_dict({"momentum": [torch.zeros(4)]})
    with pytest.raises(ProtocolError):
        other.load_state_dict({"momentum": []})


DILOCO = replace(FAST, diloco=DiLoCo(local_steps=5))


def _snapshot(
    opt: CollaborativeOptimizer | AsyncCollaborativeOptimizer,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [p.detach().clone() for p in opt.params]
    momentum = [m.detach().clone() for m in opt.state_dict()["diloco"]["momentum"]]
    return params, momentum


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    return held_clock(monkeypatch)


@pytest.mark.parametrize("codec", [None, NONE], ids=["float16", "float32"])
async def test_peers_converge_and_agree_after_each_outer_step(
    clock: trio.testing.MockClock, codec: object
) -> None:
    """Three peers on virtual time take 8 outer steps of 5 local steps
    together: every pair holds identical parameters and outer momentum after
    each outer step, whichever codec carries the pseudo-gradients."""
    diloco = DiLoCo(local_steps=5) if codec is None else DiLoCo(local_steps=5, codec=NONE)
    together = await train_together(replace(FAST, diloco=diloco), epochs=8)
    together.assert_every_step_taken_together(8)
    assert min(together.local_steps.values()) >= 8 * 5
    assert min(together.accuracy.values()) >= 0.85, together.accuracy


async def test_a_newcomer_gets_the_synced_parameters_and_outer_momentum(
    clock: trio.testing.MockClock,
) -> None:
    """A fourth peer joins after outer step 3: it holds its donor's synced
    parameters and outer momentum of that step, and trains from them."""
    snapshots = Snapshots(_snapshot)
    joined: list[int] = []

    async def join(peers: Peers, together: Together) -> None:
        await together.reached[3].wait()
        async with newcomer(peers, DILOCO) as opt:
            assert opt.epoch >= 3 and opt.state_source is not None
            expected_params, expected_momentum = await snapshots.of(opt.epoch, opt.state_source)
            params, momentum = _snapshot(opt)
            assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
            # the synced parameters (what it would donate) are the ones it trains from
            synced = opt._strategy.shared_params()
            assert all(torch.equal(a, b) for a, b in zip(synced, params, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(momentum, expected_momentum, strict=True))
            assert any(m.abs().sum() > 0 for m in momentum)
            joined.append(opt.epoch)

    await train_together(DILOCO, epochs=10, on_step=snapshots.on_step, meanwhile=join)
    assert joined


def test_a_restarted_peer_resumes_the_outer_state_from_its_checkpoint(tmp_path: object) -> None:
    torch.set_num_threads(1)
    directory = f"{tmp_path}/checkpoints"
    saved: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    with training_peers(1) as (_, peers):
        config = training_config(
            0, max_epochs=3, min_peers=1, checkpoint_dir=directory, optimizer=DILOCO
        )
        first = TrainingPeer(peers[0], config)
        first.start(on_epoch=lambda opt, report: saved.append(_snapshot(opt)))
        assert first.join().epochs == 3
    with training_peers(1) as (_, peers):
        resumed = join_run(peers[0], DILOCO, seed=99, checkpoint_dir=directory)
        try:
            assert resumed.epoch == 3
            params, momentum = _snapshot(resumed)
            expected_params, expected_momentum = saved[-1]
            assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(momentum, expected_momentum, strict=True))
            assert any(m.abs().sum() > 0 for m in momentum)
        finally:
            resumed.close()
