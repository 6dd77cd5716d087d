import dataclasses
import itertools
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swarm import ConfigError
from trainer._task import Task, builtin_task_names, load_task, shuffled_batches
from trainer._tasks_digits import digits_split, make_digits_task

torch.set_num_threads(1)


def toy_task(**overrides: Any) -> Task[Any]:
    def batches(seed: int, batch_size: int) -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randn(batch_size, 2, generator=generator)

    fields: dict[str, Any] = {
        "name": "toy",
        "make_model": lambda: torch.nn.Linear(2, 1),
        "batches": batches,
        "loss": lambda model, batch: (model(batch).pow(2).mean(), len(batch)),
        "evaluate": lambda model: {"loss": 0.0},
    }
    return Task(**(fields | overrides))


# The digits task


def test_digits_split_is_fixed_stratified_and_complete() -> None:
    (train_x, train_y), (test_x, test_y) = digits_split.__wrapped__()
    (train_x2, train_y2), (test_x2, test_y2) = digits_split.__wrapped__()
    for a, b in [(train_x, train_x2), (train_y, train_y2), (test_x, test_x2), (test_y, test_y2)]:
        assert torch.equal(a, b)
    assert len(train_y) + len(test_y) == 1797
    assert train_x.dtype == torch.float32 and train_x.min() >= 0.0 and train_x.max() <= 1.0
    for label in range(10):
        share = (test_y == label).sum() / ((test_y == label).sum() + (train_y == label).sum())
        assert 0.18 < share < 0.22
    task = load_task("digits")
    assert task.train_size == len(train_y)


def test_the_digits_width_is_an_option_with_its_own_name() -> None:
    task = load_task("digits")
    assert task.name == "digits" and task.make_model()[0].out_features == 128
    wide = make_digits_task(hidden=512)
    model = wide.make_model()
    assert wide.name == "digits-h512" and model[0].out_features == model[2].in_features == 512
    for bad in (0, -3, 1 << 17, 2.0, True):
        with pytest.raises(ConfigError, match="hidden"):
            make_digits_task(hidden=bad)  # type: ignore[arg-type]


def test_digits_streams_are_seeded_and_each_pass_covers_the_training_set() -> None:
    task = load_task("digits")
    (_, train_y), _ = digits_split()

    def first(seed: int, batch_size: int, n: int) -> list[Any]:
        return list(itertools.islice(task.batches(seed, batch_size), n))

    a, b, c = first(1, 64, 5), first(1, 64, 5), first(2, 64, 5)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], c[0][0])
    assert all(len(y) == 64 for _, y in a)
    assert task.train_size is not None
    # One batch of a whole pass is a permutation of the training set; the next one differs.
    (_, y1), (_, y2) = first(3, task.train_size, 2)
    assert torch.equal(y1.sort().values, train_y.sort().values)
    assert not torch.equal(y1, y2)
    # Batches larger than the data set still come.
    (_, y), *_ = first(3, 3 * task.train_size, 1)
    assert len(y) == 3 * task.train_size


@pytest.mark.parametrize(
    ("tensors", "batch_size"),
    [
        ((), 1),
        ((torch.zeros(3), torch.zeros(4)), 1),
        ((torch.zeros(0),), 1),
        ((torch.zeros(3),), 0),
    ],
)
def test_shuffled_batches_refuses_bad_input(
    tensors: tuple[torch.Tensor, ...], batch_size: int
) -> None:
    with pytest.raises(ValueError):
        next(shuffled_batches(*tensors, seed=0, batch_size=batch_size))


def test_shuffled_batches_keeps_rows_together() -> None:
    x = torch.arange(10)
    for a, b in itertools.islice(shuffled_batches(x, x * 10, seed=0, batch_size=4), 5):
        assert torch.equal(a * 10, b)


def train_digits(steps: int, seed: int = 0) -> tuple[torch.nn.Module, dict[str, float]]:
    task = load_task("digits")
    model, optimizer, _ = task.build(seed=seed)
    for batch in itertools.islice(task.batches(seed, 64), steps):
        loss, samples = task.loss(model, batch)
        assert samples == 64
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, task.run_evaluation(model)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_digits_reaches_90_percent_in_40_steps_deterministically(seed: int) -> None:
    model, metrics = train_digits(40, seed)
    assert metrics["accuracy"] >= 0.9
    assert set(metrics) == {"accuracy", "loss"}
    model2, metrics2 = train_digits(40, seed)
    assert metrics == metrics2
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


# The Task object


def test_build_seeds_the_model_without_touching_the_global_generator() -> None:
    task = toy_task()
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, optimizer, scheduler = task.build(seed=5)
    b, _, _ = task.build(seed=5)
    c, _, _ = task.build(seed=6)
    assert torch.rand(1) == expected_next
    assert isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)
    assert isinstance(c, torch.nn.Linear)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
    assert isinstance(optimizer, torch.optim.Adam) and scheduler is None


def test_build_makes_the_scheduler_and_checks_factories() -> None:
    task = toy_task(make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1))
    assert isinstance(task.build()[2], torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ConfigError, match="make_model returned"):
        toy_task(make_model=lambda: "not a model").build()
    with pytest.raises(ConfigError, match="make_optimizer returned"):
        toy_task(make_optimizer=lambda params: None).build()


def test_run_evaluation_uses_eval_mode_and_restores_it() -> None:
    seen: list[tuple[bool, bool]] = []

    def evaluate(model: torch.nn.Module) -> dict[str, Any]:
        seen.append((model.training, torch.is_grad_enabled()))
        return {"loss": torch.tensor(0.5), "accuracy": 1}

    task = toy_task(evaluate=evaluate)
    model = task.make_model()
    assert task.run_evaluation(model) == {"loss": 0.5, "accuracy": 1.0}
    assert seen == [(False, False)] and model.training


@pytest.mark.parametrize("result", [[("loss", 1.0)], {"loss": "high"}, {1: 1.0}, {"ok": True}])
def test_run_evaluation_refuses_bad_metrics(result: Any) -> None:
    task = toy_task(evaluate=lambda model: result)
    with pytest.raises(ConfigError):
        task.run_evaluation(task.make_model())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"name": ""}, "name"),
        ({"name": "has space"}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"make_model": torch.nn.Linear(2, 1)}, "not a model"),
        ({"batches": None}, "batches must be callable"),
        ({"loss": 3}, "loss must be callable"),
        ({"evaluate": "accuracy"}, "evaluate must be callable"),
        ({"make_optimizer": None}, "make_optimizer must be callable"),
        ({"make_scheduler": 1}, "make_scheduler"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"train_size": 0}, "train_size"),
    ],
)
def test_task_fields_are_validated(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        toy_task(**overrides)


# load_task


def write(tmp_path: Path, source: str, name: str = "task.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


TASK_FILE = """
    from __future__ import annotations

    import dataclasses

    import torch
    from trainer._task import Task

    @dataclasses.dataclass
    class Settings:  # dataclasses need the module registered while it runs
        width: int = 3

    def batches(seed: int, batch_size: int):
        while True:
            yield torch.zeros(batch_size, Settings().width)

    def make_task() -> Task:
        return Task(
            name="from-file",
            make_model=lambda: torch.nn.Linear(Settings().width, 1),
            batches=batches,
            loss=lambda model, batch: (model(batch).mean(), len(batch)),
            evaluate=lambda model: {"loss": 0.0},
        )

    def not_a_task():
        return 42

    def broken():
        raise RuntimeError("no data here")

    NOT_CALLABLE = 5
"""


def test_load_task_from_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, TASK_FILE)
    task = load_task(f"{path}:make_task")
    assert task.name == "from-file"
    model, _, _ = task.build()
    loss, samples = task.loss(model, next(task.batches(0, 4)))
    assert samples == 4 and loss.requires_grad


def test_builtin_names() -> None:
    assert builtin_task_names() == ["digits", "digits-cnn"]
    assert load_task("digits").name == "digits"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("imagenet", "unknown task 'imagenet'.*digits"),
        ("{path}", r"add :FACTORY"),
        ("{dir}/missing.py:make_task", "does not exist"),
        ("{dir}:make_task", "does not exist"),
        ("{path}:no_such_factory", "defines no 'no_such_factory'"),
        ("{path}:NOT_CALLABLE", "is not a function"),
        ("{path}:not_a_task", "returned int, expected a swarm Task"),
        ("{path}:broken", "failed: RuntimeError: no data here"),
        ("{path}:make task", "not a function name"),
        ("{syntax}:make_task", "importing task file .* failed: SyntaxError"),
        ("{raises}:make_task", "importing task file .* failed: ModuleNotFoundError"),
    ],
)
def test_load_task_errors(tmp_path: Path, spec: str, match: str) -> None:
    paths = {
        "path": write(tmp_path, TASK_FILE),
        "syntax": write(tmp_path, "def make_task(:\n", "syntax.py"),
        "raises": write(tmp_path, "import swarm_no_such_module\n", "raises.py"),
        "dir": tmp_path,
    }
    with pytest.raises(ConfigError, match=match):
        load_task(spec.format(**paths))


def test_seeded_builds_agree_across_threads() -> None:
    import threading

    from trainer import load_task

    task = load_task("digits")
    weights: list[list[torch.Tensor]] = []
    lock = threading.Lock()

    def build() -> None:
        for _ in range(20):
            model, _, _ = task.build(seed=7)
            with lock:
                weights.append([p.detach().clone() for p in model.parameters()])

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for other in weights[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights[0], other, strict=True))


def test_build_with_lr_sets_every_group_before_the_scheduler_is_made() -> None:
    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1)

    def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    task = dataclasses.replace(
        make_digits_task(), make_optimizer=make_optimizer, make_scheduler=make_scheduler
    )
    _, optimizer, scheduler = task.build(seed=0, lr=0.02)
    assert [g["lr"] for g in optimizer.param_groups] == [0.02]
    assert scheduler is not None and scheduler.base_lrs == [0.02]  # the schedule scales from it
    assert task.build(seed=0)[1].param_groups[0]["lr"] == 0.1
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="learning rate"):
            task.build(lr=bad)
