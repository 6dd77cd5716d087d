"""bfloat16 and float16 models in a swarm, AMP's GradScaler, the gradient hook,
schedulers, unused parameters: the torch conventions users rely on."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from trainer_harness import FAST, training_peers

from swarm import Peer, PeerID
from trainer import CollaborativeOptimizer

EPOCHS = 3


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(dtype)


def _train(
    peer: Peer, i: int, model: torch.nn.Module, out: dict[int, Any], count: int
) -> None:
    dtype = next(model.parameters()).dtype
    opt = CollaborativeOptimizer(
        peer,
        run_id=f"mixed-{str(dtype)[6:]}",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        target_batch_size=96,
        batch_size_per_step=16,
        config=FAST,
    )
    steps: dict[int, tuple[bytes | None, frozenset[PeerID], frozenset[PeerID], list[Any]]] = {}
    try:
        assert opt.wait_for_peers(count, 30.0)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(256, 16, generator=g).to(dtype)
        y = torch.randint(0, 4, (256,), generator=g)
        for n in range(400):  # bounded: a few global steps need far fewer
            if opt.epoch >= EPOCHS:
                break
            b = slice(16 * (n % 16), 16 * (n % 16 + 1))
            loss = F.cross_entropy(model(x[b]).float(), y[b])
            loss.backward()
            if opt.step(loss=loss):  # the loss as a tensor, read lazily
                step = opt.last_step
                assert step is not None
                avg = step.averaging
                steps[opt.epoch] = (
                    None if avg is None else avg.group_id,
                    frozenset(avg.members) if avg is not None else frozenset(),
                    step.contributors,
                    [p.detach().clone() for p in model.parameters()],
                )
            opt.zero_grad()
        assert all(p.dtype == dtype for p in model.parameters())
        assert opt.loss is not None
    finally:
        out[i] = steps
        opt.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_trains_in_a_swarm_with_every_contributor_counted(
    dtype: torch.dtype,
) -> None:
    torch.set_num_threads(1)
    count = 3
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    with training_peers(count) as (_, peers):

        # built here: torch's global RNG is shared by the threads
        models = [_model(dtype) for _ in range(count)]

        def run(i: int) -> None:
            try:
                _train(peers[i], i, models[i], out, count)
            except BaseException as e:  # re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    everyone = frozenset(p.peer_id for p in peers)
    averaged = 0
    for i in range(count):
        for _epoch, (group, members, contributors, _params) in out[i].items():
            if group is not None:
                averaged += 1
                # every member's data is in the average: none was left out
                assert contributors == members, (members, contributors)
    assert averaged >= count, "the peers never averaged together"
    # Peers that averaged with everyone at every step so far hold identical
    # parameters: check every pair at every such epoch.
    clean = {i: True for i in range(count)}
    full_epochs = 0
    for epoch in range(1, EPOCHS + 1):
        for i in range(count):
            step = out[i].get(epoch)
            clean[i] = clean[i] and step is not None and step[2] == everyone
        ready = [i for i in range(count) if clean[i]]
        full_epochs += len(ready) == count
        for a in ready:
            for b in ready:
                if a < b:
                    for x, y in zip(out[a][epoch][3], out[b][epoch][3], strict=True):
                        assert torch.equal(x, y), f"epoch {epoch}: peers {a} and {b} differ"
    assert full_epochs >= 1, "no epoch where all peers averaged together"


def _lone(peer: Peer, model: torch.nn.Module, inner: torch.optim.Optimizer, **kw: Any) -> Any:
    return CollaborativeOptimizer(
        peer,
        run_id="lone",
        model=model,
        optimizer=inner,
        target_batch_size=4,
        batch_size_per_step=4,
        config=FAST,
        **kw,
    )


def _until_global_step(opt: Any, batch: Any) -> None:
    """Run ``batch`` (forward, backward, step; True if the step was global)
    until a global step happens. A lone peer's step is global once its
    progress record shows the epoch (re-read at most every few ms)."""
    for _ in range(500):
        if batch():
            return
        time.sleep(0.01)
    raise AssertionError("no global step")


def test_grad_scaler_unscales_before_averaging_and_skips_an_overflowing_batch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    seen: list[torch.Tensor] = []

    def hook(params: list[torch.nn.Parameter]) -> float:
        seen.append(params[0].grad.detach().clone())  # type: ignore[union-attr]
        return float(torch.nn.utils.clip_grad_norm_(params, 1e9))

    x = torch.ones(4, 3)
    with training_peers(1) as (_, (peer,)):
        opt = _lone(peer, model, torch.optim.SGD(model.parameters(), lr=0.0), grad_hook=hook)
        with opt:
            assert isinstance(opt, torch.optim.Optimizer)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            # the true gradient, without scaling
            model(x).sum().backward()
            true_grad = model.weight.grad.detach().clone()  # type: ignore[union-attr]
            model.zero_grad()

            def scaled_batch() -> bool:
                epoch = opt.epoch
                scaler.scale(model(x).sum()).backward()
                scaler.step(opt)  # GradScaler accepts it: unscales, then steps
                scaler.update()
                opt.zero_grad()
                return bool(opt.epoch > epoch)

            _until_global_step(opt, scaled_batch)
            assert opt.epoch == 1
            assert torch.allclose(seen[0], true_grad)  # unscaled before averaging
            step = opt.last_step
            assert step is not None and step.hook_result == pytest.approx(
                float(torch.linalg.vector_norm(torch.cat([true_grad.view(-1), torch.ones(1) * 4])))
            )
            opt.zero_grad()
            # an overflowing batch: skipped, not raised, not counted
            scale = scaler.get_scale()
            scaler.scale(model(x).sum() * float("inf")).backward()
            assert scaler.step(opt) is None
            scaler.update()
            assert opt.epoch == 1 and scaler.get_scale() == scale / 2
            opt.zero_grad()

            # the explicit form: step(grad_scaler=...)
            def explicit_batch() -> bool:
                scaler.scale(model(x).sum()).backward()
                stepped = opt.step(grad_scaler=scaler)
                scaler.update()
                opt.zero_grad()
                return bool(stepped)

            _until_global_step(opt, explicit_batch)
            assert torch.allclose(seen[1], true_grad)
            scaler.scale(model(x).sum() * float("nan")).backward()
            assert not opt.step(grad_scaler=scaler)  # skipped, not raised
            scaler.update()
            opt.zero_grad()
            assert opt.epoch == 2


def test_a_parameter_without_gradient_keeps_none_and_adamw_does_not_decay_it() -> None:
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    model = torch.nn.ModuleList([used, unused])
    before = [p.detach().clone() for p in unused.parameters()]
    grads: list[list[bool]] = []

    def hook(params: list[torch.nn.Parameter]) -> None:
        grads.append([p.grad is not None for p in params])

    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    with training_peers(1) as (_, (peer,)), _lone(peer, model, inner, grad_hook=hook) as opt:
        def batch() -> bool:
            used(torch.ones(4, 3)).sum().backward()
            stepped = opt.step()
            opt.zero_grad()
            return bool(stepped)

        for _ in range(2):
            _until_global_step(opt, batch)
    assert grads == [[True, True, False, False]] * 2
    for p, b in zip(unused.parameters(), before, strict=True):
        assert torch.equal(p, b)


def test_reduce_lr_on_plateau_steps_per_global_step_with_the_reported_metric() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(inner, factor=0.5, patience=0)
    with training_peers(1) as (_, (peer,)), _lone(peer, model, inner, scheduler=plateau) as opt:
        def batch() -> bool:
            model(torch.ones(4, 3)).sum().backward()
            stepped = opt.step()
            opt.zero_grad()
            return bool(stepped)

        for n in range(3):
            opt.report_metric(1.0)  # never improves after the first
            _until_global_step(opt, batch)
            assert inner.param_groups[0]["lr"] == [1.0, 0.5, 0.25][n]


def test_a_failing_scheduler_raises_after_a_whole_global_step() -> None:
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)

    class Broken(torch.optim.lr_scheduler.LambdaLR):
        armed = False

        def step(self, epoch: int | None = None) -> None:
            if self.armed:  # not at construction (torch steps once there)
                raise RuntimeError("scheduler bug")
            super().step()

    with training_peers(1) as (_, (peer,)):
        broken = Broken(inner, lambda _: 1.0)
        broken.armed = True
        with _lone(peer, model, inner, scheduler=broken) as opt:
            def batch() -> bool:
                model(torch.ones(4, 3)).sum().backward()
                stepped = opt.step()
                opt.zero_grad()
                return bool(stepped)

            with pytest.raises(RuntimeError, match="scheduler bug"):
                _until_global_step(opt, batch)
            # the step itself is whole: recorded, counted, accumulators fresh
            assert opt.epoch == 1 and opt.last_step is not None
            assert opt.last_step.epoch == 1


def test_a_warning_when_the_optimizer_holds_parameters_not_in_params() -> None:
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    inner = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with training_peers(1) as (_, (peer,)):
        with pytest.warns(UserWarning, match="2 trainable parameters that are not in params"):
            opt = _lone(peer, a, inner)
        opt.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _lone(peer, torch.nn.Sequential(a, b), inner).close()


def test_a_bfloat16_model_keeps_float32_master_weights() -> None:
    # 1.0 - 0.001 is 1.0 in bfloat16 (its spacing there is 2**-7): without a
    # float32 master copy the model would never move
    model = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    with training_peers(1) as (_, (peer,)), _lone(peer, model, inner) as opt:
        assert inner.param_groups[0]["params"][0].dtype == torch.float32
        assert opt.param_groups[0]["params"][0] is model.weight  # what GradScaler sees

        def batch() -> bool:
            model(torch.ones(4, 1, dtype=torch.bfloat16)).sum().div(4).backward()
            stepped = opt.step()
            opt.zero_grad()
            return bool(stepped)

        for _ in range(10):
            _until_global_step(opt, batch)
        assert model.weight.dtype == torch.bfloat16
        assert model.weight.item() == pytest.approx(0.99, abs=2**-7)
        assert opt.state_dict()["masters"][0].item() == pytest.approx(0.99, abs=1e-6)
