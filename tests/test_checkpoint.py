import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import trainer._checkpoint as checkpoint_module
from swarm import ConfigError
from trainer._checkpoint import (
    Checkpoint,
    CheckpointDir,
    load_checkpoint,
    save_checkpoint,
)

torch.set_num_threads(1)


def make_training() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return model, optimizer, scheduler


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    steps: int,
    seed: int = 0,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def small_checkpoint(epoch: int, value: float = 0.0) -> Checkpoint:
    return Checkpoint(epoch=epoch, model={"w": torch.full((3,), value)}, optimizer={})


def test_resuming_from_a_checkpoint_continues_exactly(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler, 5)
    path = tmp_path / "state.swarm"
    save_checkpoint(
        path, Checkpoint.capture(5, model, optimizer, scheduler, {"run_id": "r", "n": [1, 2]})
    )
    train(model, optimizer, scheduler, 4, seed=1)

    model2, optimizer2, scheduler2 = make_training()
    loaded = load_checkpoint(path)
    assert loaded.epoch == 5 and loaded.extra == {"run_id": "r", "n": [1, 2]}
    loaded.restore(model2, optimizer2, scheduler2)
    train(model2, optimizer2, scheduler2, 4, seed=1)

    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert scheduler.get_last_lr() == scheduler2.get_last_lr()
    assert str(optimizer.state_dict()) == str(optimizer2.state_dict())


def test_restore_refuses_a_scheduler_mismatch() -> None:
    model, optimizer, scheduler = make_training()
    checkpoint = Checkpoint.capture(0, model, optimizer, scheduler)
    with pytest.raises(ConfigError, match="scheduler"):
        checkpoint.restore(model, optimizer, None)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epoch": -1},
        {"epoch": True},
        {"epoch": 1.0},
        {"model": [1]},
        {"scheduler": 3},
        {"extra": None},
    ],
)
def test_checkpoint_fields_are_validated(kwargs: dict[str, Any]) -> None:
    fields: dict[str, Any] = {"epoch": 0, "model": {}, "optimizer": {}} | kwargs
    with pytest.raises(ConfigError):
        Checkpoint(**fields)


def test_directory_keeps_the_newest_and_finds_the_latest(tmp_path: Path) -> None:
    directory = CheckpointDir(tmp_path / "ckpt", keep=2)
    assert directory.latest() is None
    for epoch in (1, 5, 3, 12):
        directory.save(small_checkpoint(epoch, float(epoch)))
    assert [p.name for p in directory.paths()] == [
        "checkpoint-0000000005.swarm",
        "checkpoint-0000000012.swarm",
    ]
    latest = directory.latest()
    assert latest is not None and latest.epoch == 12
    assert torch.equal(latest.model["w"], torch.full((3,), 12.0))


def test_keep_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        CheckpointDir(tmp_path, keep=0)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        CheckpointDir(tmp_path / "file")


def test_a_damaged_latest_checkpoint_is_skipped(tmp_path: Path) -> None:
    directory = CheckpointDir(tmp_path)
    directory.save(small_checkpoint(1, 1.0))
    newest = directory.save(small_checkpoint(2, 2.0))
    data = bytearray(newest.read_bytes())
    data[-8] ^= 0x01  # one flipped bit in the tensor data
    newest.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="damaged"):
        load_checkpoint(newest)
    latest = directory.latest()
    assert latest is not None and latest.epoch == 1


def test_missing_and_truncated_files_raise_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_checkpoint(tmp_path / "nothing.swarm")
    path = tmp_path / "c.swarm"
    save_checkpoint(path, small_checkpoint(1))
    data = path.read_bytes()
    for cut in (0, 5, 12, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match="damaged"):
            load_checkpoint(path)


def test_a_pickle_file_is_not_loaded(tmp_path: Path) -> None:
    path = tmp_path / "c.swarm"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(ConfigError, match="not a swarm checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("failing", ["tensor_to_bytes", "replace"])
def test_a_write_that_fails_midway_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "c.swarm"
    save_checkpoint(path, small_checkpoint(1, 1.0))
    calls = 0
    real: Any

    def fail(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:  # after part of the file is written
            raise OSError("disk full")
        return real(*args)

    if failing == "tensor_to_bytes":
        real = checkpoint_module.tensor_to_bytes
        monkeypatch.setattr(checkpoint_module, "tensor_to_bytes", fail)
    else:
        real = os.replace
        calls = 1
        monkeypatch.setattr(checkpoint_module.os, "replace", fail)
    big = Checkpoint(epoch=2, model={"a": torch.ones(1000), "b": torch.ones(1000)}, optimizer={})
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, big)
    assert os.listdir(tmp_path) == ["c.swarm"]  # no temporary file left behind
    assert load_checkpoint(path).epoch == 1


WRITER = textwrap.dedent(
    """
    import sys
    import torch
    from trainer._checkpoint import Checkpoint, CheckpointDir

    directory = CheckpointDir(sys.argv[1], keep=2)
    weights = torch.zeros(4 * 2**20)  # 16 MiB per checkpoint
    epoch = 0
    while True:
        epoch += 1
        weights.fill_(epoch)
        directory.save(Checkpoint(epoch=epoch, model={"w": weights}, optimizer={}))
        print(epoch, flush=True)
    """
)


@pytest.mark.slow
def test_a_writer_killed_mid_write_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "1"
        # Kill while the next write is in progress: its temporary file exists.
        deadline = time.monotonic() + 20
        while not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline, "the writer never started a second checkpoint"
            time.sleep(0.001)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        process.kill()
        process.wait()
    directory = CheckpointDir(tmp_path, keep=2)
    checkpoints = [load_checkpoint(p) for p in directory.paths()]  # every file is complete
    assert checkpoints
    for checkpoint in checkpoints:
        assert torch.equal(checkpoint.model["w"], torch.full((4 * 2**20,), float(checkpoint.epoch)))
    # The next save sweeps away what the killed writer left behind.
    directory.save(small_checkpoint(10**6))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def valid_file_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("valid") / "c.swarm"
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler, 1)
    save_checkpoint(path, Checkpoint.capture(1, model, optimizer, scheduler, {"k": "v"}))
    return path.read_bytes()


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_mutated_files_raise_only_config_error(
    valid_file_bytes: bytes, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    mutated = bytearray(valid_file_bytes)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "c.swarm"
    path.write_bytes(bytes(mutated))
    with contextlib.suppress(ConfigError):
        load_checkpoint(path)
