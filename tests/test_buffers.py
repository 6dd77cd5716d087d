"""Model buffers (BatchNorm running statistics) reach newcomers and checkpoints;
compiled and plain models' states fit each other."""

from __future__ import annotations

from pathlib import Path

import torch
from trainer_harness import FAST, training_peers

from trainer import Checkpoint, CollaborativeOptimizer
from trainer._buffers import load_plain_state_dict, model_buffers, plain_state_dict


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def _optimizer(peer: object, model: torch.nn.Module, **kw: object) -> CollaborativeOptimizer:
    return CollaborativeOptimizer(
        peer,  # type: ignore[arg-type]
        run_id="buffers",
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        target_batch_size=64,
        batch_size_per_step=8,
        config=FAST,
        **kw,  # type: ignore[arg-type]
    )


def _set_statistics(model: torch.nn.Module, value: float) -> None:
    bn = model[1]
    assert isinstance(bn, torch.nn.BatchNorm1d)
    with torch.no_grad():
        bn.running_mean.fill_(value)
        bn.running_var.fill_(value + 1)
        bn.num_batches_tracked.fill_(int(value))


def test_buffers_are_named_without_the_compile_prefix() -> None:
    model = _model(0)
    compiled = torch.compile(model)
    assert list(model_buffers(compiled)) == list(model_buffers(model)) == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    state = compiled.state_dict()
    assert all(key.startswith("_orig_mod.") for key in state)
    plain = _model(1)
    load_plain_state_dict(plain, state)
    for key, value in plain_state_dict(state).items():
        assert torch.equal(plain.state_dict()[key], value)
    other = torch.compile(_model(2))
    load_plain_state_dict(other, model.state_dict())
    assert torch.equal(other.state_dict()["_orig_mod.0.weight"], model.state_dict()["0.weight"])


def test_a_newcomer_downloads_the_buffers_with_the_state() -> None:
    with training_peers(2) as (_, (donor_peer, newcomer_peer)):
        donor_model = _model(0)
        _set_statistics(donor_model, 3.0)
        with _optimizer(donor_peer, donor_model):
            newcomer_model = _model(1)  # other weights, fresh statistics
            with _optimizer(newcomer_peer, newcomer_model) as newcomer:
                assert newcomer.state_source == donor_peer.peer_id
                for a, b in zip(
                    donor_model.state_dict().values(),
                    newcomer_model.state_dict().values(),
                    strict=True,
                ):
                    assert torch.equal(a, b)


def test_checkpoints_hold_buffers_and_fit_compiled_and_plain_models(tmp_path: Path) -> None:
    with training_peers(1) as (_, (peer,)):
        plain = _model(0)
        _set_statistics(plain, 5.0)
        _optimizer(peer, plain, checkpoint_dir=tmp_path, load_state=False).close()
        compiled = torch.compile(_model(1))
        _optimizer(peer, compiled, checkpoint_dir=tmp_path, load_state=False).close()
        for key, value in plain.state_dict().items():
            assert torch.equal(compiled.state_dict()["_orig_mod." + key], value), key
        # and back: a plain model resumes from the compiled one's checkpoint
        compiled_opt = _optimizer(peer, compiled, checkpoint_dir=tmp_path, load_state=False)
        _set_statistics(compiled._orig_mod, 7.0)  # type: ignore[union-attr, arg-type]
        compiled_opt.epoch += 1  # a later checkpoint than the first
        compiled_opt.close()
        again = _model(2)
        _optimizer(peer, again, checkpoint_dir=tmp_path, load_state=False).close()
        bn = again[1]
        assert isinstance(bn, torch.nn.BatchNorm1d)
        assert bn.running_mean.eq(7.0).all() and int(bn.num_batches_tracked) == 7


def test_checkpoint_capture_and_restore_fit_compiled_and_plain_models() -> None:
    plain = _model(0)
    _set_statistics(plain, 2.0)
    compiled = torch.compile(_model(1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    checkpoint = Checkpoint.capture(1, plain, optimizer)
    checkpoint.restore(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    for key, value in plain.state_dict().items():
        assert torch.equal(compiled.state_dict()["_orig_mod." + key], value)
    back = Checkpoint.capture(2, compiled, optimizer)
    assert set(back.model) == set(plain.state_dict())  # no _orig_mod. in the file
    other = _model(2)
    back.restore(other, torch.optim.SGD(other.parameters(), lr=0.1))
    for key, value in plain.state_dict().items():
        assert torch.equal(other.state_dict()[key], value)
