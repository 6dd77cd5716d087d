import itertools
import runpy
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


@pytest.mark.slow
def test_digits_standalone_script_runs() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLES / "digits_standalone.py"),
            "--epochs",
            "1",
            "--batch-size",
            "128",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0, stderr
    assert stdout.startswith("epoch 1: test accuracy 0.")
