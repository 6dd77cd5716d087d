"""Two peers on CUDA in float32, bfloat16 and float16 with GradScaler, and
over the lossy data plane: every contributor counted, identical parameters, a
newcomer's download with buffers, a checkpoint resume, and the staging layer's
pinned, asynchronous copies."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from trainer_harness import FAST, training_peers

from averaging import HostStaging, float32_accumulators
from swarm import Peer
from trainer import CollaborativeConfig, CollaborativeOptimizer, load_task
from trainer._drift import lost_fraction

EPOCHS = 3


def _net(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # drawn on the CPU: the same on every GPU model
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    return model.to(device=device, dtype=dtype)


def _train(
    peer: Peer,
    i: int,
    model: torch.nn.Module,
    amp: bool,
    out: dict[int, Any],
    device: torch.device,
    config: CollaborativeConfig = FAST,
) -> None:
    dtype = next(model.parameters()).dtype
    opt = CollaborativeOptimizer(
        peer,
        run_id=f"gpu-{dtype}-{amp}-{config.lossy}",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        target_batch_size=128,
        batch_size_per_step=32,
        config=config,
    )
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    steps: dict[int, Any] = {}
    try:
        assert opt.wait_for_peers(2, 30.0)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(256, 16, generator=g).to(device)
        y = torch.randint(0, 4, (256,), generator=g).to(device)
        for n in range(400):
            if opt.epoch >= EPOCHS:
                break
            b = slice(32 * (n % 8), 32 * (n % 8 + 1))
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(model(x[b].to(dtype)).float(), y[b])
            scaler.scale(loss).backward()
            epoch = opt.epoch
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if opt.epoch > epoch:
                step = opt.last_step
                assert step is not None and step.averaging is not None
                averaged = step.averaging
                assert averaged.allreduce is not None and averaged.group is not None
                steps[opt.epoch] = (
                    frozenset(averaged.members),
                    step.contributors,
                    [t.detach().cpu().clone() for t in model.state_dict().values()],
                    lost_fraction(averaged.allreduce, len(averaged.group.senders())),
                )
        assert all(p.device == device for p in model.parameters())
    finally:
        out[i] = steps
        opt.close()


@pytest.mark.parametrize(
    ("dtype", "amp"), [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
)
def test_two_cuda_peers_average_with_every_contributor(
    cuda: torch.device, dtype: torch.dtype, amp: bool
) -> None:
    models = [_net(dtype, cuda) for _ in range(2)]
    out, everyone = _train_two(models, amp, cuda, FAST)
    for epoch in range(1, EPOCHS + 1):
        for i in range(2):
            members, contributors, _, _ = out[i][epoch]
            assert contributors == members == everyone, (epoch, i)
        _assert_same_parameters(models[0], out[0][epoch][2], out[1][epoch][2], epoch)


def test_two_cuda_peers_average_over_the_lossy_data_plane(cuda: torch.device) -> None:
    """The lossy data plane stages CUDA gradients through the same host copies:
    both peers in every group, and where no datagram was lost (loopback, two
    peers) the parameters agree exactly."""
    models = [_net(torch.float32, cuda) for _ in range(2)]
    lossy = replace(FAST, lossy=True, state_averaging_interval=2)
    out, everyone = _train_two(models, False, cuda, lossy)
    whole = 0
    for epoch in range(1, EPOCHS + 1):
        assert all(out[i][epoch][0] == everyone for i in range(2)), epoch
        if out[0][epoch][3] == out[1][epoch][3] == 0.0 and all(
            out[i][epoch][1] == everyone for i in range(2)
        ):
            _assert_same_parameters(models[0], out[0][epoch][2], out[1][epoch][2], epoch)
            whole += 1
        else:
            break  # after a lost piece the models may differ until re-synchronised
    assert whole >= 1, "no lossy step on loopback averaged everything"


def _train_two(
    models: list[torch.nn.Module], amp: bool, device: torch.device, config: CollaborativeConfig
) -> tuple[dict[int, Any], frozenset[bytes]]:
    """Train ``models`` on two peers in threads; each peer's record per epoch."""
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    with training_peers(2) as (_, peers):

        def run(i: int) -> None:
            try:
                _train(peers[i], i, models[i], amp, out, device, config)
            except BaseException as e:  # re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    if errors:
        raise errors[0]
    return out, frozenset(p.peer_id for p in peers)


def _assert_same_parameters(
    model: torch.nn.Module, a: list[torch.Tensor], b: list[torch.Tensor], epoch: int
) -> None:
    """Parameters and buffers agree (the running statistics are averaged only
    by state averaging; the parameters at every step)."""
    names = list(model.state_dict())
    for name, x, y in zip(names, a, b, strict=True):
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(x, y), (epoch, name)


def test_a_cuda_newcomer_downloads_parameters_and_buffers(cuda: torch.device) -> None:
    task = load_task("digits-cnn")
    with training_peers(2) as (_, (first, second)):
        donor_model, donor_inner, _ = task.build(seed=0, device=cuda)
        donor_model.train()
        donor_model(torch.rand(8, 64, device=cuda))  # running statistics move off their defaults
        kwargs: dict[str, Any] = dict(
            run_id="gpu-newcomer", target_batch_size=64, batch_size_per_step=8, config=FAST
        )
        with CollaborativeOptimizer(first, model=donor_model, optimizer=donor_inner, **kwargs):
            model, inner, _ = task.build(seed=1, device=cuda)
            with CollaborativeOptimizer(second, model=model, optimizer=inner, **kwargs) as opt:
                assert opt.state_source == first.peer_id
                for (name, a), b in zip(
                    donor_model.state_dict().items(), model.state_dict().values(), strict=True
                ):
                    assert b.device.type == "cuda" and torch.equal(a, b), name


def test_a_cuda_peer_resumes_from_its_checkpoint(cuda: torch.device, tmp_path: Path) -> None:
    task = load_task("digits-cnn")
    kwargs: dict[str, Any] = dict(
        run_id="gpu-resume",
        target_batch_size=16,
        batch_size_per_step=16,
        config=FAST,
        checkpoint_dir=tmp_path,
        load_state=False,
    )
    with training_peers(1) as (_, (peer,)):
        model, inner, _ = task.build(seed=0, device=cuda, dtype=torch.bfloat16)
        opt = CollaborativeOptimizer(peer, model=model, optimizer=inner, **kwargs)
        batches = task.batches(0, 16)
        for _ in range(200):
            if opt.epoch >= 2:
                break
            loss, size = task.loss(model, next(batches))
            loss.backward()
            opt.step(size, loss=loss.detach())
            opt.zero_grad()
        opt.close()
        saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        again, inner2, _ = task.build(seed=5, device=cuda, dtype=torch.bfloat16)
        resumed = CollaborativeOptimizer(peer, model=again, optimizer=inner2, **kwargs)
        assert resumed.epoch == 2
        for name, value in again.state_dict().items():
            assert torch.equal(value.cpu(), saved[name]), name
        resumed.close()


def test_staging_copies_cuda_tensors_through_pinned_memory(cuda: torch.device) -> None:
    params = [torch.randn(1000, 10, device=cuda, dtype=torch.bfloat16), torch.randn(7, device=cuda)]
    accs = float32_accumulators(params)
    assert all(a.device == cuda and a.dtype == torch.float32 for a in accs)
    staging = HostStaging(accs)
    assert staging.copies and staging.pinned
    stream = torch.cuda.Stream(cuda)
    with torch.cuda.stream(stream):  # the user's own stream is respected
        for a, p in zip(accs, params, strict=True):
            a.add_(p, alpha=2)
        host = staging.to_host()
        for h, p in zip(host, params, strict=True):
            assert torch.equal(h, (2 * p.float()).cpu())
            h.mul_(0.5)
        staging.from_host()
        for a, p in zip(accs, params, strict=True):
            assert torch.equal(a, p.float())
