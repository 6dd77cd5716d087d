"""Train the built-in ``digits`` task with the library API, in a script of your own.

    python examples/digits_standalone.py --epochs 3

As written this trains on one machine. To train with a swarm instead, open a
peer and wrap the optimizer; the loop stays the same::

    with swarm.Peer(...) as peer:
        optimizer = CollaborativeOptimizer(peer, run_id="digits", params=model.parameters(),
                                           optimizer=optimizer, target_batch_size=256,
                                           batch_size_per_step=args.batch_size)

Here an epoch is one pass over the training set.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from trainer._task import load_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="model initialisation seed")
    parser.add_argument("--data-seed", type=int, default=0, help="this peer's data order")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    task = load_task("digits")
    model, optimizer, scheduler = task.build(seed=args.seed)
    batches = task.batches(args.data_seed, args.batch_size)
    steps_per_epoch = math.ceil((task.train_size or args.batch_size) / args.batch_size)

    model.train()
    for epoch in range(1, args.epochs + 1):
        for batch in itertools.islice(batches, steps_per_epoch):
            loss, _samples = task.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        metrics = task.run_evaluation(model)
        print(f"epoch {epoch}: test accuracy {metrics['accuracy']:.3f}, loss {metrics['loss']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
