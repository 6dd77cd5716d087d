"""Train the built-in ``digits`` task with the library API, in a script of your own.

    python examples/digits_standalone.py --epochs 3

As written this trains alone. To train with a swarm, open a peer around
``train(...)`` and pass it the collaborative optimizer instead of the local one;
``train`` itself does not change::

    with swarm.Peer(...) as peer:
        optimizer = CollaborativeOptimizer(peer, run_id="digits", params=model.parameters(),
                                           optimizer=optimizer, target_batch_size=256,
                                           batch_size_per_step=args.batch_size)
        train(task, model, optimizer, ...)

Here an epoch is one pass of this peer over the training set (in the swarm's
vocabulary an epoch is one global optimizer step).
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainer._task import Task, load_task


def train(
    task: Task[Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Any],
    *,
    epochs: int,
    steps_per_epoch: int,
) -> dict[str, float]:
    """Train for ``epochs`` x ``steps_per_epoch`` batches; print and return test metrics."""
    metrics: dict[str, float] = {}
    model.train()
    for epoch in range(1, epochs + 1):
        for batch in itertools.islice(batches, steps_per_epoch):
            loss, _samples = task.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        metrics = task.run_evaluation(model)
        print(f"epoch {epoch}: test accuracy {metrics['accuracy']:.3f}, loss {metrics['loss']:.3f}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the digits task on this machine.")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    parser.add_argument("--data-seed", type=int, default=0, help="this peer's data order")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the model is tiny: more threads only add overhead

    task = load_task("digits")
    model, optimizer, _scheduler = task.build(seed=args.seed)
    train(
        task,
        model,
        optimizer,
        task.batches(args.data_seed, args.batch_size),
        epochs=args.epochs,
        steps_per_epoch=math.ceil((task.train_size or args.batch_size) / args.batch_size),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
