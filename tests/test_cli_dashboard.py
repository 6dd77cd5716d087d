"""The tools around ``swarm train`` as a user runs them, through the CLI with
real processes on 127.0.0.1: ``--config`` and its precedence, ``--lr``,
``swarm export``, the metric history and ``swarm plot``, ``--log-file`` in
JSON, Prometheus metrics scraped over HTTP, and the progress display (plain
lines through a pipe, a live display on a terminal).

One finished run (a module fixture: one peer, a few epochs of the built-in
digits task) is shared by the tests that inspect what a run leaves behind.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio
from cli_harness import run_cli, run_to_completion, throttled_task_file

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
        "--log-file", str(directory / "run.log"), "--log-format", "json",
        # one peer alone: no minute of waiting for others to join
        "--wait-for-peers", "0",
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


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    """``swarm *argv`` in this process (the same ``main`` the console script
    runs): its exit code and the lines it wrote to stderr."""
    from swarm.cli import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("target-batch-sise = 64", "unknown key 'target-batch-sise'"),
        ("target-batch-size = '64'", "key 'target-batch-size' must be an integer"),
        ("matchmaking-time = true", "key 'matchmaking-time' must be a number"),
        ("client-mode = 1", "key 'client-mode' must be true or false"),
        ("initial-peer = [1]", "key 'initial-peer' must be a string"),
        ("log-format = 'xml'", "key 'log-format' must be one of text, json"),
        ("lr = 0.1\nlr_x = 2", "unknown key 'lr_x'"),
        ("max-epochs = 2\nmax_epochs = 3", "key 'max_epochs' repeats 'max-epochs'"),
        ("config = 'other.toml'", "unknown key 'config'"),
        ("target-batch-size = ", "is not valid TOML"),
    ],
)
def test_bad_config_file_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, expected: str
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(toml + "\n")
    code, lines = _main(capsys, "train", "--config", str(config))
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("swarm train: error:"), lines
    assert expected in lines[0] and str(config) in lines[0], lines


async def test_bad_config_file_through_the_cli(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("target-batch-size = 64\nbatch_size = 'large'\n")
    result = await run_to_completion("train", "--config", str(config), timeout=60)
    assert result.returncode == 2
    assert result.stderr.decode().strip().splitlines() == [
        f"swarm train: error: {config}: key 'batch_size' must be an integer, got 'large'"
    ]


def test_bad_lr_missing_config_and_start_up_checks_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unwritable = tmp_path / "no-such-dir" / "run.log"
    for args, expected in [
        (("--lr", "0"), "--lr 0 must be a positive number"),
        (("--lr", "nan"), "--lr nan must be a positive number"),
        (("--metrics-port", "70000"), "--metrics-port 70000 is outside 0-65535"),
        (("--config", str(tmp_path / "none.toml")), "cannot read config file"),
        (("--log-file", str(unwritable)), f"--log-file {unwritable}: cannot write it"),
    ]:
        code, lines = _main(capsys, "train", "--host", "127.0.0.1", *args)
        assert code == 2, (args, lines)
        assert len(lines) == 1 and expected in lines[0], (args, lines)


# -- swarm export ---------------------------------------------------------------------


@pytest.mark.slow
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
    # the checkpoint's buffers (BatchNorm statistics) are exported, not the model's
    params["0"] = torch.ones(2, 3)
    mean = torch.tensor([0.5, -0.5])
    state = named_model_state(model, params | {"buffer:1.running_mean": mean})
    assert torch.equal(state["1.running_mean"], mean)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"buffer '1\.running_mean' does not fit"):
        named_model_state(model, params | {"buffer:1.running_mean": torch.zeros(3)})


def test_export_without_a_valid_checkpoint_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
        code, lines = _main(capsys, "export", "--checkpoint-dir", str(directory), "--out", str(out))
        assert code == 2, lines
        assert len(lines) == 1 and lines[0].startswith("swarm export: error:"), lines
        assert expected in lines[0], lines
        assert not out.exists()


# -- the progress display ---------------------------------------------------------------


def test_through_a_pipe_one_plain_line_per_epoch(finished_run: FinishedRun) -> None:
    lines = finished_run.stdout
    assert lines[0].startswith("peer ") and " listening on 127.0.0.1:" in lines[0], lines
    epochs = [line.split(":")[0] for line in lines if line.startswith("epoch ")]
    assert epochs == ["epoch 1", "epoch 2", "epoch 3"], lines
    assert lines[-1].startswith("finished at epoch 3: "), lines
    assert not any("\x1b" in line or "\r" in line for line in lines), lines


@pytest.mark.slow
def test_on_a_terminal_a_live_display(tmp_path: Path) -> None:
    train = ["train", "--host", "127.0.0.1", "--threads", "1", "--target-batch-size", "64",
             "--max-epochs", "2", "--eval-every", "0", "--wait-for-peers", "0"]  # fmt: skip
    code, text = _run_in_terminal(train, timeout=120)
    assert code == 0, text[-2000:]
    assert "\x1b[" in text  # the display redraws itself in place
    assert "samples of the global batch" in text and "ETA" in text and "peer alive" in text
    assert "epoch 1: train loss " in text and "epoch 2: train loss " in text
    assert "finished at epoch 2:" in text


# -- history, plot and log file -----------------------------------------------------------


def test_the_peer_keeps_its_metric_history(finished_run: FinishedRun) -> None:
    from swarm._history import read_history

    records = read_history(finished_run.checkpoint_dir / "history.jsonl")
    assert [(r.epoch, r.final) for r in records] == [(1, False), (2, False), (3, False), (3, True)]
    # the first step gives no interval to time (the start is no step: a wait for
    # peers would count), so its record has no throughput; every later one has
    assert records[0].samples_per_second is None
    for r in records:
        assert r is records[0] or (r.samples_per_second is not None and r.samples_per_second > 0)
        assert r.accuracy is not None and 0 <= r.accuracy <= 1
        assert r.eval_loss is not None and r.peers == 1
    assert all(r.train_loss is not None for r in records[:3])
    assert [r.time for r in records] == sorted(r.time for r in records)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_writes_a_png_of_the_expected_size(finished_run: FinishedRun, tmp_path: Path) -> None:
    out = tmp_path / "curves.png"
    result = _swarm(
        "plot", "--checkpoint-dir", str(finished_run.checkpoint_dir), "--out", str(out),
        "--width", "640", "--height", "480",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("plotted 4 records to "), result.stdout
    assert _png_size(out) == (640, 480)
    default = tmp_path / "default.png"
    history = finished_run.checkpoint_dir / "history.jsonl"
    result = _swarm("plot", "--history", str(history), "--out", str(default), timeout=120)
    assert result.returncode == 0, result.stderr
    assert _png_size(default) == (1200, 900)


async def test_plot_without_a_history_exits_2_with_one_line(tmp_path: Path) -> None:
    result = await run_to_completion(
        "plot", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "c.png"), timeout=60
    )
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2, lines
    assert len(lines) == 1 and "no metric history at" in lines[0], lines
    assert not (tmp_path / "c.png").exists()


def test_log_file_in_json_has_one_object_per_record(finished_run: FinishedRun) -> None:
    lines = (finished_run.directory / "run.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert entries
    for entry in entries:
        assert {"time", "level", "logger", "message"} <= set(entry), entry
    steps = [e for e in entries if e["logger"] == "swarm.metrics" and "epoch" in e]
    assert [e["epoch"] for e in steps] == [1, 2, 3, 3]
    assert all(e["averaging"] == "alone" for e in steps[:3])  # structured fields
    assert "samples_per_second" not in steps[0]  # none measured yet: left out, not 0
    assert all(isinstance(e["samples_per_second"], float) for e in steps[1:])


# -- metrics ------------------------------------------------------------------------------


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


@pytest.mark.slow
async def test_metrics_scraped_over_http_from_a_training_peer(tmp_path: Path) -> None:
    port = _free_tcp_port()
    task = throttled_task_file(tmp_path, 0.02)
    common = (
        "--host", "127.0.0.1", "--threads", "1", "--task", task, "--run-id", "metrics",
        "--target-batch-size", "96", "--matchmaking-time", "1", "--averaging-timeout", "6",
    )  # fmt: skip
    async with run_cli("train", *common, "--metrics-port", str(port)) as first:
        line = await first.read_line_containing("join with:", timeout=60)
        address = line.split("--initial-peer", 1)[1].split()[0]
        async with run_cli("train", *common, "--initial-peer", address) as second:
            await second.read_line_containing("join with:", timeout=60)
            # Prometheus is scraped by polling; so is this test, bounded
            with trio.fail_after(120):
                while True:
                    metrics = await trio.to_thread.run_sync(_scrape, port)
                    if metrics["swarm_epoch"] >= 2 and metrics["swarm_peers_alive"] == 2:
                        break
                    await trio.sleep(0.5)
            assert await second.stop(signal.SIGTERM, timeout=30) == 0
        assert await first.stop(signal.SIGTERM, timeout=30) == 0
    # one outcome per global step this peer took (more if it caught up a step)
    rounds = sum(v for k, v in metrics.items() if k.startswith("swarm_averaging_rounds_total"))
    assert 1 <= rounds <= metrics["swarm_epoch"], metrics
    assert metrics["swarm_averaging_seconds_count"] == rounds
    failures = sum(
        v for k, v in metrics.items() if k.startswith("swarm_averaging_round_failures_total")
    )
    assert failures == metrics.get("swarm_averaging_rounds_total{outcome=failed}", 0.0)
    # the second peer downloaded the state from this one, and they averaged
    assert metrics["swarm_bytes_sent_total"] > 0 and metrics["swarm_bytes_received_total"] > 0
    assert metrics["swarm_dht_contacts"] >= 1
    assert metrics["swarm_train_loss"] > 0
    assert metrics["swarm_samples_per_second"] > 0


def test_metrics_port_in_use_exits_2_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = _main(capsys, "train", "--host", "127.0.0.1", "--metrics-port", str(port))
    assert code == 2, lines
    assert len(lines) == 1 and f"--metrics-port {port}: cannot listen" in lines[0], lines


# -- swarm status --watch ------------------------------------------------------------------


def _run_in_terminal(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run ``swarm *argv`` with a pseudo-terminal as stdout; its exit code and
    what it wrote there. Killed after ``timeout`` seconds, and always reaped."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *argv],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "160", "TERM": "xterm"},
    )
    os.close(terminal)
    output = b""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            output += chunk
        code = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(controller)
    return code, output.decode(errors="replace")


@pytest.mark.slow
async def test_status_watch_refreshes_count_times(tmp_path: Path) -> None:
    async with run_cli("dht", "--host", "127.0.0.1") as node:
        line = await node.read_line_containing("join with:", timeout=60)
        address = line.split("--initial-peer", 1)[1].split()[0]
        status = ("status", "--initial-peer", address, "--run-id", "watched", "--watch", "0.2")
        result = await run_to_completion(*status, "--count", "3", timeout=90)
        assert result.returncode == 0, result.stderr
        tables = result.stdout.decode().split("\n\n")
        assert len(tables) == 3, tables
        assert all(t.startswith("run watched: epoch 0, 0 peers") for t in tables), tables
        assert "\x1b" not in result.stdout.decode()

        code, text = await trio.to_thread.run_sync(
            _run_in_terminal, [*status, "--count", "2"], 90.0
        )
        assert code == 0, text
        # the second table is drawn over the first: cursor up one line, clear below
        assert text.count("run watched: epoch 0") == 2, text
        assert "\x1b[1F\x1b[J" in text, repr(text)
        assert await node.stop(signal.SIGINT) == 0


def test_status_watch_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for args, expected in [
        (("--count", "2"), "--count needs --watch"),
        (("--watch", "0"), "--watch 0 must be a positive number"),
        (("--watch", "1", "--count", "0"), "--count 0 must be at least 1"),
    ]:
        code, lines = _main(capsys, "status", "--initial-peer", "127.0.0.1:9", *args)
        assert code == 2, (args, lines)
        assert len(lines) == 1 and expected in lines[0], (args, lines)
