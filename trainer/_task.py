"""The task API: what to train, on what data, judged how.

A ``Task`` bundles the few functions a training peer needs and nothing else:
build the model, build its optimizer (and optionally a learning-rate
scheduler), stream batches, compute the loss of a batch, and evaluate the
model on held-out data. The built-in tasks and a user's ``--task FILE.py:FACTORY``
are the same kind of object, so the trainer has one code path.

Minimal custom task::

    def make_task() -> Task:
        return Task(
            name="my-task",
            make_model=lambda: nn.Linear(4, 2),
            batches=my_batches,             # (seed, batch_size) -> endless iterator
            loss=my_loss,                   # (model, batch) -> (mean loss, samples)
            evaluate=my_evaluate,           # model -> {"loss": ..., "accuracy": ...}
        )

For a data set held in tensors, ``shuffled_batches`` is a ready-made ``batches``.
``load_task("digits")`` returns a built-in task; ``load_task("path/to/file.py:make_task")``
imports the file and calls its factory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import ParamsT

from swarm._errors import ConfigError

Batch = TypeVar("Batch")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def default_optimizer(params: ParamsT) -> torch.optim.Optimizer:
    """Adam with learning rate 1e-3: the optimizer of a task that names none."""
    return torch.optim.Adam(params, lr=1e-3)


@dataclass(frozen=True)
class Task(Generic[Batch]):
    """What a peer trains. Every field is a plain function, so a task is cheap to
    build, holds no model or data of its own until asked, and serves any number of
    peers in one process.

    - ``name``: short identifier (letters, digits, ``_.-``; at most 64 characters).
    - ``make_model()``: a freshly initialised model. Called once per peer; peers
      that must start from identical weights call ``build(seed=...)``.
    - ``batches(seed, batch_size)``: an endless iterator of batches. Each peer
      passes its own ``seed`` and so reads its own shuffled stream; the same seed
      gives the same stream.
    - ``loss(model, batch)``: the mean loss over the batch (a scalar tensor that
      requires grad) and the number of samples in the batch. The sample count is
      what a collaborative optimizer adds up towards its target batch size.
    - ``evaluate(model)``: metrics on held-out data, e.g. ``{"loss": 0.3,
      "accuracy": 0.9}``; deterministic for given weights. Call it through
      ``run_evaluation``, which sets eval mode and disables autograd.
    - ``make_optimizer(params)``: the optimizer of one global step (the
      collaborative optimizer wraps it). Defaults to ``default_optimizer``.
    - ``make_scheduler(optimizer)``: an optional learning-rate scheduler, stepped
      once per epoch (global optimizer step of the swarm).
    - ``batch_size``: the per-peer batch size to use when the user gives none.
    - ``train_size``: the number of training samples if the data set is finite
      (lets callers count passes over the data), else ``None``.

    Raises ``ConfigError`` from the constructor if a field has the wrong kind of
    value; the message names the field.
    """

    name: str
    make_model: Callable[[], nn.Module]
    batches: Callable[[int, int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch], tuple[torch.Tensor, int]]
    evaluate: Callable[[nn.Module], Mapping[str, float]]
    make_optimizer: Callable[[ParamsT], torch.optim.Optimizer] = default_optimizer
    make_scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None
    batch_size: int = 32
    train_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                f"task name {self.name!r} must be 1-64 letters, digits or '_.-', "
                "starting with a letter or digit"
            )
        if isinstance(self.make_model, nn.Module):
            raise ConfigError(
                f"task {self.name}: make_model must be a function returning a new model, "
                "not a model (several peers in one process each need their own)"
            )
        for field_name in ("make_model", "batches", "loss", "evaluate", "make_optimizer"):
            if not callable(getattr(self, field_name)):
                raise ConfigError(f"task {self.name}: {field_name} must be callable")
        if self.make_scheduler is not None and not callable(self.make_scheduler):
            raise ConfigError(f"task {self.name}: make_scheduler must be callable or None")
        if not _is_count(self.batch_size) or self.batch_size < 1:
            raise ConfigError(f"task {self.name}: batch_size must be an integer >= 1")
        if self.train_size is not None and (not _is_count(self.train_size) or self.train_size < 1):
            raise ConfigError(f"task {self.name}: train_size must be an integer >= 1 or None")

    def build(
        self,
        *,
        seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        lr: float | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, LRScheduler | None]:
        """A new model with its optimizer and scheduler (``None`` if the task has none).

        With ``seed``, the model is initialised from that seed without disturbing
        the global random state, so peers that pass the same seed start from
        identical weights. The weights are always drawn on the CPU (a GPU's
        random numbers depend on its model) and then moved to ``device`` and
        cast to ``dtype`` (floating point parameters and buffers only), before
        the optimizer is made. With ``lr``, every parameter group of the
        optimizer starts at that learning rate, set before the scheduler is made
        so that a schedule scales from it. Raises ``ConfigError`` for an ``lr``
        that is not a positive finite number.
        """
        if lr is not None and (isinstance(lr, bool) or not (math.isfinite(lr) and lr > 0)):
            raise ConfigError(f"learning rate {lr!r} must be a positive finite number")
        with _seeded(seed):
            model = self.make_model()
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"task {self.name}: make_model returned {type(model).__name__}, not an nn.Module"
            )
        if device is not None:
            model = model.to(torch.device(device))
        if dtype is not None:
            if not dtype.is_floating_point:
                raise ConfigError(f"task {self.name}: dtype {dtype} is not floating point")
            model = model.to(dtype)
        optimizer = self.make_optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"task {self.name}: make_optimizer returned {type(optimizer).__name__}, "
                "not a torch.optim.Optimizer"
            )
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        scheduler = None if self.make_scheduler is None else self.make_scheduler(optimizer)
        return model, optimizer, scheduler

    def run_evaluation(self, model: nn.Module) -> dict[str, float]:
        """``evaluate(model)`` in eval mode without autograd; the model's mode is restored.

        Raises ``ConfigError`` if ``evaluate`` does not return a mapping of metric
        names to numbers. A non-finite value (a diverged model) is returned as is.
        """
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                metrics = self.evaluate(model)
        finally:
            model.train(was_training)
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"task {self.name}: evaluate must return a dict of metrics")
        result: dict[str, float] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or isinstance(value, bool):
                raise ConfigError(f"task {self.name}: evaluate returned a bad metric {key!r}")
            try:
                result[key] = float(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(
                    f"task {self.name}: metric {key!r} is not a number: {value!r}"
                ) from e
        return result


#: ``--precision`` names and the model dtypes they mean
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means: ``auto`` (CUDA when present, else MPS when
    present, else the CPU), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``.

    Raises ``ConfigError`` for a name torch does not know or a device this
    machine does not have, saying which devices it has.
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N or mps") from e
    have = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    have += ["mps"] if torch.backends.mps.is_available() else []
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if str(device) not in have:
        raise ConfigError(f"device {name!r} is not on this machine (it has {', '.join(have)})")
    return device


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """``batch`` with every tensor in it (in tuples, lists and dicts, at any
    depth) moved to ``device``; other values are kept. A task's ``loss`` and
    ``evaluate`` call it with the model's device (see ``model_device``), so
    one task runs on any device. Copies from pinned memory are asynchronous."""
    target = torch.device(device)
    if isinstance(batch, torch.Tensor):
        if batch.device == target:
            return batch
        return batch.to(target, non_blocking=batch.is_pinned())  # type: ignore[return-value]
    if isinstance(batch, tuple):
        return type(batch)(to_device(item, target) for item in batch)
    if isinstance(batch, list):
        return [to_device(item, target) for item in batch]  # type: ignore[return-value]
    if isinstance(batch, dict):
        return {key: to_device(v, target) for key, v in batch.items()}  # type: ignore[return-value]
    return batch


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating point parameter (float32 if none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def shuffled_batches(
    *tensors: torch.Tensor, seed: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless batches from an in-memory data set, for a task's ``batches``.

    ``tensors`` share their first dimension (e.g. features and labels); each
    batch holds the same ``batch_size`` rows of each. Every pass over the data
    is in a fresh random order drawn from ``seed``, and batches run on across
    the end of a pass, so all batches are full. Raises ``ValueError`` for no
    tensors, tensors of different lengths, an empty data set or a
    ``batch_size`` below 1.
    """
    if not tensors or len({len(t) for t in tensors}) != 1 or len(tensors[0]) == 0:
        raise ValueError("need one or more non-empty tensors of the same length")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    size = len(tensors[0])
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.int64)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(size, generator=generator)])
        index, pending = pending[:batch_size], pending[batch_size:]
        yield tuple(t[index] for t in tensors)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: torch's default generator is process-wide: two threads seeding it at once
#: (several peers in one process) would interleave and build different weights.
_GLOBAL_RNG = threading.Lock()


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _builtin_tasks() -> dict[str, Callable[[], Task[Any]]]:
    # Imported here so that loading a user's task never pays for the built-ins.
    from ._tasks_digits import make_digits_cnn_task, make_digits_task

    return {"digits": make_digits_task, "digits-cnn": make_digits_cnn_task}


def builtin_task_names() -> list[str]:
    """The names ``load_task`` accepts without a file."""
    return sorted(_builtin_tasks())


def load_task(spec: str) -> Task[Any]:
    """The task named by ``spec``: a built-in name, or ``"path/to/file.py:factory"``.

    For a file (relative to the working directory), the module is imported from
    its path and ``factory()`` is called
    with no arguments; it must return a ``Task``. Raises ``ConfigError`` with a
    message that says what to change for an unknown built-in name, a missing
    file, a file that fails to import, a missing or non-callable factory, a
    factory that raises, or a factory that returns something else.
    """
    builtins = _builtin_tasks()
    if spec in builtins:
        return builtins[spec]()
    path_text, sep, factory_name = spec.rpartition(":")
    if not sep:
        hint = " (add :FACTORY, the function that returns the Task)" if spec.endswith(".py") else ""
        raise ConfigError(
            f"unknown task {spec!r}{hint}: use one of {', '.join(sorted(builtins))} "
            "or FILE.py:FACTORY"
        )
    if not factory_name.isidentifier():
        raise ConfigError(f"task {spec!r}: {factory_name!r} is not a function name")
    module = _import_file(Path(path_text))
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ConfigError(f"task file {path_text} defines no {factory_name!r}")
    if not callable(factory):
        raise ConfigError(f"{factory_name!r} in {path_text} is not a function")
    try:
        task = factory()
    except ConfigError:
        raise
    except Exception as e:  # the user's code: report it as the user's configuration problem
        raise ConfigError(
            f"task factory {factory_name}() in {path_text} failed: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(task, Task):
        raise ConfigError(
            f"task factory {factory_name}() in {path_text} returned "
            f"{type(task).__name__}, expected a swarm Task"
        )
    return task


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"task file {path} does not exist")
    resolved = path.resolve()
    # A name unique per file, so two task files named alike do not replace each other.
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_swarm_task_{_identifier(resolved.stem)}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"task file {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and typing look their module up there.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: report it as the user's configuration problem
        del sys.modules[module_name]
        raise ConfigError(f"importing task file {path} failed: {type(e).__name__}: {e}") from e
    return module


def _identifier(text: str) -> str:
    return re.sub(r"\W", "_", text) or "task"
