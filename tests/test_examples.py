import itertools
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm import ConfigError
from trainer._task import load_task

torch.set_num_threads(1)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_tiny_lm_loads_as_a_task_file_and_learns() -> None:
    task = load_task(f"{EXAMPLES / 'tiny_lm.py'}:make_task")
    assert task.name == "tiny-lm"
    model, optimizer, _ = task.build(seed=0)
    before = task.run_evaluation(model)
    assert set(before) == {"loss", "perplexity"}
    losses = []
    for batch in itertools.islice(task.batches(0, 8), 12):
        loss, samples = task.loss(model, batch)
        assert samples == 8
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert sum(losses[-3:]) < sum(losses[:3])
    assert task.run_evaluation(model)["loss"] < before["loss"]
    # The output layer shares the embedding's weights.
    assert model.get_submodule("head").weight is model.get_submodule("embed").weight


def test_tiny_lm_reads_a_text_file(tmp_path: Path) -> None:
    example = runpy.run_path(str(EXAMPLES / "tiny_lm.py"))
    make_task, context = example["make_task"], example["CONTEXT"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    task = make_task(str(corpus))
    model, _, _ = task.build(seed=0)
    assert model.embed.num_embeddings == len(set(corpus.read_text()))
    inputs, targets = next(task.batches(1, 2))
    assert inputs.shape == targets.shape == (2, context)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])

    corpus.write_text("too short")
    with pytest.raises(ConfigError, match="needs at least"):
        make_task(str(corpus))
    with pytest.raises(ConfigError, match="cannot read"):
        make_task(str(tmp_path / "missing.txt"))


def test_small_generated_lm_has_a_megabyte_gradient_and_learns() -> None:
    """The loss benchmark's data-dominated task: its size sets its all-reduce time."""
    task = load_task(f"{EXAMPLES / 'tiny_lm.py'}:make_small_generated_task")
    model, optimizer, _ = task.build(seed=0)
    assert 1.2e6 < 4 * sum(p.numel() for p in model.parameters()) < 1.4e6  # float32 bytes
    before = task.run_evaluation(model)
    for batch in itertools.islice(task.batches(0, 8), 10):
        loss, samples = task.loss(model, batch)
        assert samples == 8
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = task.run_evaluation(model)
    assert after["perplexity"] < before["perplexity"]

    make_generated_task = runpy.run_path(str(EXAMPLES / "tiny_lm.py"))["make_generated_task"]
    with pytest.raises(ConfigError, match="learning rate must be positive"):
        make_generated_task(embed=8, heads=2, layers=1, context=4, vocab=16, lr=0.0)


def _start_example(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / "digits_standalone.py"), "--host", "127.0.0.1", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_tiny_lm_trains_with_swarm_train() -> None:
    task = f"{EXAMPLES / 'tiny_lm.py'}:make_task"
    args = ["--task", task, "--host", "127.0.0.1", "--max-epochs", "1", "--threads", "1"]
    args += ["--wait-for-peers", "0"]  # one peer alone: no wait for others to join
    result = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "train", *args, "--target-batch-size", "32"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "training task tiny-lm in run tiny-lm" in result.stdout
    assert re.search(r"finished at epoch 1: eval loss [0-9.]+, perplexity [0-9.]+", result.stdout)


@pytest.mark.slow
def test_digits_standalone_first_peer_prints_address_and_a_second_joins() -> None:
    """The documented use: the first peer prints the command that joins it and
    waits for a second; that command, run as printed, joins; both train three
    epochs together and exit 0."""
    processes: list[subprocess.Popen[str]] = []
    try:
        first = _start_example("--max-epochs", "3", "--matchmaking-time", "1")
        processes.append(first)
        assert first.stdout is not None
        join = first.stdout.readline()
        assert join.startswith("join with: ") and "--initial-peer 127.0.0.1:" in join, join
        assert "--max-epochs 3" in join, join
        assert first.stdout.readline().startswith("waiting up to 60 s for peers to join")
        second = subprocess.Popen(
            shlex.split(join.removeprefix("join with: ")),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        processes.append(second)
        outputs = [process.communicate(timeout=90)[0] for process in processes]
        assert [process.returncode for process in processes] == [0, 0]
        assert outputs[0].startswith("epoch 1: test accuracy 0."), outputs[0]
        assert "epoch 3: test accuracy 0." in outputs[0]
        assert outputs[1].startswith("join with: ")
        assert "epoch 3: test accuracy 0." in outputs[1]
    finally:
        for process in processes:
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()


@pytest.mark.slow
def test_digits_async_trains_two_peers_in_one_trio_run() -> None:
    """The documented async use: two peers, each an ``AsyncCollaborativeOptimizer``
    with ``open_peer`` in one ``trio.run``, train together and print the same
    accuracy (they averaged every step together from the same weights)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits_async.py"), "--peers", "2", "--max-epochs", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["peer 0", "peer 1"], result.stdout
    assert all(line.split("test accuracy ")[1].startswith("0.") for line in lines), lines
