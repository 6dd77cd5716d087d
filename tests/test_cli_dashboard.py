"""The tools around ``swarm train`` as a user runs them, through the CLI with
real processes on 127.0.0.1: ``--config`` and its precedence, ``--lr``,
``swarm export``.

One finished run (a module fixture: one peer, a few epochs of the built-in
digits task) is shared by the tests that inspect what a run leaves behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cli_harness import run_to_completion

#: The run's settings in its config file; the command line overrides one of them.
RUN_TOML = """
target-batch-size = 32
matchmaking_time = 2.5
max-epochs = 3
eval-every = 1
lr = 0.05
threads = 1
checkpoint-dir = "{checkpoint_dir}"
"""


@dataclass(frozen=True)
class FinishedRun:
    directory: Path
    checkpoint_dir: Path
    stdout: list[str]
    stderr: str


def _swarm(*args: str, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarm.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    directory = tmp_path_factory.mktemp("run")
    checkpoint_dir = directory / "checkpoints"
    config = directory / "run.toml"
    config.write_text(RUN_TOML.format(checkpoint_dir=checkpoint_dir))
    result = _swarm(
        "train", "--config", str(config), "--host", "127.0.0.1", "--target-batch-size", "64",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return FinishedRun(directory, checkpoint_dir, result.stdout.splitlines(), result.stderr)


def test_config_file_sets_options_and_flags_override_it(finished_run: FinishedRun) -> None:
    join = next(line for line in finished_run.stdout if line.startswith("join with:"))
    # the flag beats the file's 32; the file's matchmaking_time (underscores) is used
    assert "--target-batch-size 64" in join and "--matchmaking-time 2.5" in join, join
    assert finished_run.stdout[-1].startswith("finished at epoch 3:"), finished_run.stdout


def test_lr_sets_the_inner_optimizers_learning_rate(finished_run: FinishedRun) -> None:
    from trainer import CheckpointDir

    checkpoint = CheckpointDir(finished_run.checkpoint_dir).latest()
    assert checkpoint is not None and checkpoint.epoch == 3
    groups = checkpoint.optimizer["param_groups"]
    assert groups and all(group["lr"] == 0.05 for group in groups)


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("target-batch-sise = 64", "unknown key 'target-batch-sise'"),
        ("target-batch-size = '64'", "key 'target-batch-size' must be an integer"),
        ("matchmaking-time = true", "key 'matchmaking-time' must be a number"),
        ("client-mode = 1", "key 'client-mode' must be true or false"),
        ("initial-peer = [1]", "key 'initial-peer' must be a string"),
        ("lr = 0.1\nlr_x = 2", "unknown key 'lr_x'"),
        ("max-epochs = 2\nmax_epochs = 3", "key 'max_epochs' repeats 'max-epochs'"),
        ("config = 'other.toml'", "unknown key 'config'"),
        ("target-batch-size = ", "is not valid TOML"),
    ],
)
async def test_bad_config_file_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, toml: str, expected: str
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(toml + "\n")
    result = await run_to_completion("train", "--config", str(config), timeout=60)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith("swarm train: error:"), lines
    assert expected in lines[0] and str(config) in lines[0], lines


async def test_bad_lr_and_missing_config_file_exit_2(tmp_path: Path) -> None:
    for args, expected in [
        (("--lr", "0"), "--lr 0 must be a positive number"),
        (("--lr", "nan"), "--lr nan must be a positive number"),
        (("--config", str(tmp_path / "none.toml")), "cannot read config file"),
    ]:
        result = await run_to_completion("train", "--host", "127.0.0.1", *args, timeout=60)
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 2, (args, lines)
        assert len(lines) == 1 and expected in lines[0], (args, lines)


# -- swarm export ---------------------------------------------------------------------


def test_export_round_trip_gives_the_same_outputs(
    finished_run: FinishedRun, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from trainer import CheckpointDir, load_task

    out = tmp_path / "model.safetensors"
    result = _swarm(
        "export", "--checkpoint-dir", str(finished_run.checkpoint_dir), "--out", str(out),
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exported epoch 3 "), result.stdout
    weights = load_file(out)
    checkpoint = CheckpointDir(finished_run.checkpoint_dir).latest()
    assert checkpoint is not None

    task = load_task("digits")
    trained, _, _ = task.build(seed=1)
    with torch.no_grad():  # the trainer's checkpoints hold the parameters by index
        for i, p in enumerate(trained.parameters()):
            p.copy_(checkpoint.model[str(i)])
    assert set(weights) == set(trained.state_dict())
    exported, _, _ = task.build(seed=2)  # other initial weights: the file must replace them
    exported.load_state_dict(weights)
    inputs = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    trained.eval(), exported.eval()
    with torch.no_grad():
        assert torch.equal(trained(inputs), exported(inputs))
        assert not torch.equal(task.build(seed=2)[0](inputs), exported(inputs))


def test_export_strips_compile_prefix_and_refuses_non_tensors() -> None:
    from swarm import ConfigError
    from trainer._export import plain_state_dict

    model = torch.nn.Linear(3, 2)
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert set(plain_state_dict(compiled)) == {"weight", "bias"}
    with pytest.raises(ConfigError, match="'step' is a int, not a tensor"):
        plain_state_dict({"step": 3})
    with pytest.raises(ConfigError, match="same name"):
        plain_state_dict({"_orig_mod.w": torch.zeros(1), "w": torch.zeros(1)})


def test_export_names_the_checkpoints_parameters_by_the_tasks_model() -> None:
    from swarm import ConfigError
    from trainer._export import named_model_state

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    params = {str(i): torch.full_like(p, float(i)) for i, p in enumerate(model.parameters())}
    state = named_model_state(model, params)
    assert torch.equal(state["1.bias"], params["3"])  # type: ignore[arg-type]
    assert "1.running_mean" in state  # a buffer: the model's own value
    assert not torch.equal(model[0].weight, params["0"])  # the model is not changed
    with pytest.raises(ConfigError, match="holds 3 parameters, the task's model 4"):
        named_model_state(model, {str(i): params[str(i)] for i in range(3)})
    params["0"] = torch.zeros(5)
    with pytest.raises(ConfigError, match="parameter 0 has shape \\(5,\\)"):
        named_model_state(model, params)


async def test_export_without_a_valid_checkpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    empty = tmp_path / "empty"
    empty.mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "checkpoint-0000000004.swarm").write_bytes(b"SWARMCK1 but cut short")
    for directory, expected in [
        (empty, f"no valid checkpoint in {empty}: nothing to export"),
        (damaged, "(1 damaged: checkpoint-0000000004.swarm)"),
        (tmp_path / "missing", "does not exist"),
    ]:
        result = await run_to_completion(
            "export", "--checkpoint-dir", str(directory), "--out", str(out), timeout=60
        )
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 2, lines
        assert len(lines) == 1 and lines[0].startswith("swarm export: error:"), lines
        assert expected in lines[0], lines
        assert not out.exists()
