"""The built-in ``digits`` task: a tiny MLP on scikit-learn's handwritten digits.

The data set (1,797 8x8 images, ten classes) ships inside the scikit-learn
package, so nothing is downloaded. Pixels are scaled to [0, 1]. The split into
training and test sets is stratified and fixed by ``SPLIT_SEED``, so every peer
of a run holds the same test set; each peer then reads the training set in
its own seeded random order. The network (64-128-10) trains in a few seconds
on one CPU core, which is what tests and benchmarks of the swarm need;
``make_digits_task(hidden=...)`` widens it, for benchmarks whose per-step
overhead should weigh less against the gradient (``benchmarks/compression.py
--hidden``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.optimizer import ParamsT

from swarm import ConfigError

from ._task import Task, model_device, model_dtype, shuffled_batches, to_device

#: Seed of the train/test split; the same on every peer, whatever its stream seed.
SPLIT_SEED = 0
#: Share of each class held out for evaluation.
TEST_FRACTION = 0.2
HIDDEN = 128
LEARNING_RATE = 1e-2

DigitsBatch = tuple[torch.Tensor, torch.Tensor]


@functools.cache
def digits_split() -> tuple[DigitsBatch, DigitsBatch]:
    """``((train_x, train_y), (test_x, test_y))``: float32 features in [0, 1], int64 labels.

    Loaded once per process and shared read-only by every peer in it.
    """
    from sklearn.datasets import load_digits  # slow import, paid only when used

    data = load_digits()
    features = torch.as_tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.as_tensor(data.target, dtype=torch.int64)
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    train_parts, test_parts = [], []
    for label in range(10):
        members = torch.nonzero(labels == label).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_test = round(len(members) * TEST_FRACTION)
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    # Sorted so that the order of the training set does not depend on class order.
    train, test = torch.cat(train_parts).sort().values, torch.cat(test_parts).sort().values
    return (features[train], labels[train]), (features[test], labels[test])


#: Widest hidden layer ``make_digits_task`` accepts.
MAX_HIDDEN = 1 << 16


def _make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def _make_optimizer(params: ParamsT) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def _batches(seed: int, batch_size: int) -> Iterator[DigitsBatch]:
    (features, labels), _ = digits_split()
    stream = shuffled_batches(features, labels, seed=seed, batch_size=batch_size)
    return ((x, y) for x, y in stream)


def _on_model(model: nn.Module, batch: DigitsBatch) -> DigitsBatch:
    """The batch on the model's device, features in the model's dtype."""
    features, labels = to_device(batch, model_device(model))
    return features.to(model_dtype(model)), labels


def _loss(model: nn.Module, batch: DigitsBatch) -> tuple[torch.Tensor, int]:
    features, labels = _on_model(model, batch)
    # the loss in float32 also for a bf16/fp16 model
    return F.cross_entropy(model(features).float(), labels), len(labels)


def _evaluate(model: nn.Module) -> dict[str, float]:
    features, labels = _on_model(model, digits_split()[1])
    with torch.no_grad():
        logits = model(features).float()
        loss = F.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).float().mean().item()
    return {"accuracy": accuracy, "loss": loss}


class DigitsCNN(nn.Module):
    """A small CNN with BatchNorm on the digits as 1x8x8 images (~10k parameters)."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


def make_digits_cnn_task(channels: int = 16) -> Task[DigitsBatch]:
    """The ``digits-cnn`` task: ``DigitsCNN`` (BatchNorm: its running statistics
    are buffers the swarm must share), Adam (lr 1e-2), batches of 64.
    ``ConfigError`` unless 1 <= channels <= 256."""
    if isinstance(channels, bool) or not isinstance(channels, int) or not 1 <= channels <= 256:
        raise ConfigError(f"channels={channels!r} must be an integer in [1, 256]")
    (_, train_labels), _ = digits_split()
    return Task(
        name="digits-cnn" if channels == 16 else f"digits-cnn-c{channels}",
        make_model=functools.partial(DigitsCNN, channels),
        batches=_batches,
        loss=_loss,
        evaluate=_evaluate,
        make_optimizer=_make_optimizer,
        batch_size=64,
        train_size=len(train_labels),
    )


def make_digits_task(hidden: int = HIDDEN) -> Task[DigitsBatch]:
    """The ``digits`` task: 64-``hidden``-10 MLP, Adam (lr 1e-2), batches of 64.

    ``hidden`` defaults to 128 (the task ``load_task("digits")`` returns);
    another width names the task ``digits-h<hidden>``, so peers of different
    widths never share a run. ``ConfigError`` unless 1 <= hidden <= 65536.
    """
    if isinstance(hidden, bool) or not isinstance(hidden, int) or not 1 <= hidden <= MAX_HIDDEN:
        raise ConfigError(f"hidden={hidden!r} must be an integer in [1, {MAX_HIDDEN}]")
    (_, train_labels), _ = digits_split()
    return Task(
        name="digits" if hidden == HIDDEN else f"digits-h{hidden}",
        make_model=functools.partial(_make_model, hidden),
        batches=_batches,
        loss=_loss,
        evaluate=_evaluate,
        make_optimizer=_make_optimizer,
        batch_size=64,
        train_size=len(train_labels),
    )
