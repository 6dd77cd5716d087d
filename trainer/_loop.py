"""The training loop of one peer: a task, a collaborative optimizer, until done.

``swarm train``, the examples, the tests and the benchmark all run this loop, so
what they measure is what users run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarm import NonFiniteError, Peer

from ._optimizer import CollaborativeConfig
from ._sync_optimizer import CollaborativeOptimizer
from ._task import Task

log = logging.getLogger(__name__)
#: Batches in a row whose gradients may hold NaN or Inf before the run stops:
#: a stray one is skipped, a model that yields nothing else has diverged.
MAX_NONFINITE_BATCHES = 10


@dataclass(frozen=True)
class TrainingConfig:
    """What one peer trains, and for how long."""

    run_id: str = "swarm"
    target_batch_size: int = 256
    #: per-peer batch size; None: the task's default
    batch_size: int | None = None
    #: learning rate of the inner optimizer; None: the task's (see ``Task.build``)
    lr: float | None = None
    #: stop after this many global steps (epochs); None: until stopped
    max_epochs: int | None = None
    #: evaluate every this many epochs (0: only at the end)
    eval_every: int = 5
    #: seed of the model's initial weights: every peer of a run must use the same
    model_seed: int = 0
    #: seed of this peer's data stream: peers should differ
    data_seed: int = 0
    #: wait until this many peers are in the run before training (bounded by
    #: ``min_peers_timeout``), so that a run starts together
    min_peers: int = 1
    min_peers_timeout: float = 60.0
    checkpoint_dir: Path | None = None
    #: download the swarm's state on joining; False only when every peer
    #: starts from the same weights at the same time (e.g. a benchmark)
    load_state: bool = True
    optimizer: CollaborativeConfig = field(default_factory=CollaborativeConfig)
    #: the device the model trains on ("cpu", "cuda", "cuda:1", "mps")
    device: str = "cpu"
    #: the model's dtype (float32, or bfloat16/float16 with float32 master weights)
    dtype: torch.dtype = torch.float32


@dataclass
class TrainingReport:
    epochs: int = 0
    local_steps: int = 0
    samples: int = 0
    wall_seconds: float = 0.0
    averaging_seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    #: epoch -> group size of the gradient averaging (0: no group)
    groups: dict[int, int] = field(default_factory=dict)


def train(
    peer: Peer,
    task: Task[Any],
    config: TrainingConfig,
    *,
    stop: threading.Event | None = None,
    on_epoch: Callable[[CollaborativeOptimizer, TrainingReport], None] | None = None,
    compute_clock: Callable[[], float] = time.monotonic,
    on_start: Callable[[CollaborativeOptimizer], None] | None = None,
) -> TrainingReport:
    """Train ``task`` with the swarm until ``max_epochs`` or until ``stop`` is set.

    Returns what happened. ``compute_clock`` is the clock DropCompute measures
    compute with (tests pass a virtual one). ``on_start(opt)`` is called once the
    optimizer is ready (resumed or caught up), before the first batch; ``on_epoch``
    after each global step. The optimizer is closed on the way out (final
    checkpoint, progress record withdrawn), also on an exception. A batch whose
    gradients hold NaN or Inf is skipped with a warning; ``NonFiniteError`` once
    ``MAX_NONFINITE_BATCHES`` come in a row (the model has diverged).
    """
    model, inner, scheduler = task.build(
        seed=config.model_seed, device=config.device, dtype=config.dtype, lr=config.lr
    )
    batch_size = config.batch_size or task.batch_size
    report = TrainingReport()
    started = time.monotonic()
    batches = task.batches(config.data_seed, batch_size)
    evaluated_at: int | None = None
    with CollaborativeOptimizer(
        peer,
        run_id=config.run_id,
        model=model,  # its buffers (BatchNorm statistics) travel with the state
        optimizer=inner,
        scheduler=scheduler,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=batch_size,
        config=config.optimizer,
        checkpoint_dir=config.checkpoint_dir,
        load_state=config.load_state,
        compute_clock=compute_clock,
    ) as opt:
        if on_start is not None:
            on_start(opt)
        if (
            config.min_peers > 1
            and not opt.wait_for_peers(config.min_peers, config.min_peers_timeout, stop=stop)
            and not (stop is not None and stop.is_set())
        ):
            log.warning(
                "fewer than %d peers after %gs: training anyway",
                config.min_peers,
                config.min_peers_timeout,
            )
        nonfinite = 0  # batches in a row with NaN or Inf gradients
        while not (stop is not None and stop.is_set()):
            if config.max_epochs is not None and opt.epoch >= config.max_epochs:
                break
            model.train()
            loss, size = task.loss(model, next(batches))
            loss.backward()
            try:
                # the loss as a tensor: read once per global step, not per batch
                stepped = opt.step(size, loss=loss.detach())
            except NonFiniteError:
                nonfinite += 1
                if nonfinite >= MAX_NONFINITE_BATCHES:
                    raise
                log.warning("skipped a batch whose gradients hold NaN or Inf")
                continue
            finally:
                opt.zero_grad()
            nonfinite = 0
            report.local_steps += 1
            report.samples += size
            if not stepped:
                continue
            step = opt.last_step
            if step is not None:
                report.averaging_seconds += step.averaging_seconds
                members = step.averaging.members if step.averaging is not None else ()
                report.groups[step.epoch] = len(members)
            if config.eval_every and opt.epoch % config.eval_every == 0:
                report.metrics = _evaluate(task, model, opt)
                evaluated_at = opt.epoch
            report.epochs = opt.epoch
            if on_epoch is not None:
                on_epoch(opt, report)
        report.epochs = opt.epoch
        # DiLoCo moves the model between outer steps: evaluate what it is now.
        if evaluated_at != opt.epoch or config.optimizer.diloco is not None:
            report.metrics = _evaluate(task, model, opt)
    report.wall_seconds = time.monotonic() - started
    return report


def _evaluate(
    task: Task[Any], model: torch.nn.Module, opt: CollaborativeOptimizer
) -> dict[str, float]:
    metrics = task.run_evaluation(model)
    if "accuracy" in metrics:
        opt.report_accuracy(metrics["accuracy"])
    log.info(
        "epoch %d evaluation: %s",
        opt.epoch,
        ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())),
    )
    return metrics
