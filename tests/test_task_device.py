"""Tasks on a device and in a dtype; the BatchNorm CNN and the generated LM."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from swarm import ConfigError
from trainer import (
    PRECISIONS,
    load_task,
    model_buffers,
    model_device,
    model_dtype,
    resolve_device,
    to_device,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_to_device_moves_every_tensor_in_a_batch() -> None:
    batch = {"x": (torch.zeros(2), [torch.ones(1), 3]), "name": "b"}
    moved = to_device(batch, "cpu")
    assert moved["x"][0] is batch["x"][0]  # already there: not copied
    assert moved["x"][1][1] == 3 and moved["name"] == "b"
    meta = to_device(batch, "meta")  # any other device: every tensor moves
    assert meta["x"][0].device.type == "meta" and meta["x"][1][0].device.type == "meta"


def test_build_draws_weights_on_the_cpu_then_moves_and_casts() -> None:
    task = load_task("digits")
    plain, _, _ = task.build(seed=3)
    model, optimizer, _ = task.build(seed=3, device="cpu", dtype=torch.bfloat16)
    assert model_dtype(model) == torch.bfloat16 and model_device(model).type == "cpu"
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b)
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())
    # the batch follows the model: float32 features, bf16 model, no error
    loss, size = task.loss(model, next(task.batches(0, 8)))
    assert loss.dtype == torch.float32 and size == 8
    with pytest.raises(ConfigError, match="not floating point"):
        task.build(dtype=torch.int32)


def test_the_digits_cnn_has_batchnorm_buffers_and_learns() -> None:
    torch.manual_seed(0)
    task = load_task("digits-cnn")
    model, optimizer, _ = task.build(seed=0)
    assert any(name.endswith("running_mean") for name in model_buffers(model))
    before = task.run_evaluation(model)["accuracy"]
    batches = task.batches(0, 64)
    for _ in range(30):
        loss, _ = task.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.run_evaluation(model)["accuracy"]
    assert after > max(0.5, before + 0.2), (before, after)


def test_the_generated_lm_has_a_configurable_shape_and_learns() -> None:
    example = runpy.run_path(str(EXAMPLES / "tiny_lm.py"))
    with pytest.raises(ConfigError):
        example["make_generated_task"](embed=30, heads=4)
    task = example["make_generated_task"](embed=32, heads=2, layers=1, context=16, vocab=64)
    model, optimizer, _ = task.build(seed=0)
    assert sum(p.numel() for p in model.parameters()) < 50_000
    before = task.evaluate(model)["loss"]
    batches = task.batches(0, 8)
    for _ in range(100):
        loss, _ = task.loss(model, next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert task.evaluate(model)["loss"] < before - 0.2
    # the presets: tens of millions of parameters (counted, not trained here)
    with torch.device("meta"):
        big = example["TinyLM"](8192, embed=512, heads=8, layers=8, context=256)
    assert 25e6 < sum(p.numel() for p in big.parameters()) < 35e6


def test_devices_and_precisions_resolve_or_say_what_this_machine_has() -> None:
    cpu_only = not torch.cuda.is_available() and not torch.backends.mps.is_available()
    if cpu_only:  # this CI machine
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="not on this machine"):
            resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu9")
    assert PRECISIONS["bf16"] == torch.bfloat16 and PRECISIONS["fp32"] == torch.float32
