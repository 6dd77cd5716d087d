"""What ARC-Top-K with EF21M costs in accuracy and saves in bytes, on digits.

No network: a group of peers that always averages exactly (what clean
all-reduces deliver, ``averaging._arctopk.exact_group_round``), so the figures
isolate the compression from timing and failures; the real swarm with
ArcTopK is measured by ``benchmarks/compression.py``. Each global step every
peer computes its mean gradient over ``target / peers`` samples; the group
then takes a dense step, or an EF21M step with ARC-Top-K, and the inner Adam
steps on the result. Dense is the baseline, measured in the same run on the
same data streams.

    python benchmarks/arctopk_digits.py                    # 4 peers, 200 epochs, 3 seeds
    python benchmarks/arctopk_digits.py --epochs 50 --json # early in training
    python benchmarks/arctopk_digits.py --seeds 5 --hidden 1024

Per method: value elements each peer all-reduces per step (sketch plus
values), their bytes (float32 for dense, the ArcTopK codec, float16 by
default, for the rest) and the share of dense's bytes, and the test accuracy
after ``--epochs`` global steps, mean/min/max over ``--seeds`` data seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from averaging._arctopk import exact_group_round, projection_seed
from trainer import ArcTopK, make_digits_task
from trainer._ef21m import EF21M


def _accuracy(
    compression: ArcTopK | None,
    *,
    epochs: int,
    peers: int,
    seed: int,
    hidden: int,
    target: int,
    lr: float | None,
) -> float:
    task = make_digits_task(hidden=hidden)
    model, inner, _ = task.build(seed=0)
    for group in inner.param_groups:
        group["lr"] = group["lr"] if lr is None else lr
    params = list(model.parameters())
    streams = [task.batches(seed * 100 + i, 32) for i in range(peers)]
    steps_per_peer = max(1, target // (32 * peers))
    efs = [EF21M(params, compression) for _ in range(peers)] if compression else []
    for epoch in range(epochs):
        grads = []
        for stream in streams:
            acc = [torch.zeros_like(p) for p in params]
            for _ in range(steps_per_peer):
                model.zero_grad()
                loss, size = task.loss(model, next(stream))
                loss.backward()
                for a, p in zip(acc, params, strict=True):
                    assert p.grad is not None
                    a.add_(p.grad, alpha=size / (32 * steps_per_peer))
            grads.append(acc)
        for ef, g in zip(efs, grads, strict=False):  # no EF21M state when dense
            ef.begin(g)
        if compression is not None and compression.compresses(epoch):
            _, own, mean = exact_group_round(
                grads,
                [1.0] * peers,
                seed=projection_seed(b"benchmark", epoch),
                rho=compression.rho,
                rank=compression.rank,
                codec=compression.codec,
            )
            for ef, c in zip(efs, own, strict=True):
                ef._own = c  # what EF21M.average records from the value round
        else:
            mean = [torch.stack([g[j] for g in grads]).mean(0) for j in range(len(params))]
        if efs:
            for ef in efs:  # every peer's g_bar: the same, from the same means
                shared = [t.clone() for t in mean]
                ef.finish(shared)
            mean = shared
        for p, g in zip(params, mean, strict=True):
            p.grad = g.clone()
        inner.step()
    return float(task.run_evaluation(model)["accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The defaults are those of benchmarks/compression.py.
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument(
        "--target", type=int, default=4096, help="samples of a global step, over all peers"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128, help="width of the digits MLP")
    parser.add_argument("--lr", type=float, help="inner learning rate (default: the task's)")
    parser.add_argument("--json", action="store_true", help="print one JSON list")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _, _ = make_digits_task(hidden=args.hidden).build(seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    dense = sum(p.numel() for p in model.parameters())
    methods: list[tuple[str, ArcTopK | None]] = [
        ("dense", None),
        ("ArcTopK(rho=0.2)", ArcTopK(rho=0.2)),
        ("ArcTopK(rho=0.1)", ArcTopK(rho=0.1)),
    ]
    rows = []
    for name, compression in methods:
        elements = dense if compression is None else sum(compression.payload_elements(shapes))
        size = 4 * dense if compression is None else compression.payload_bytes(shapes)
        accuracies = [
            _accuracy(
                compression,
                epochs=args.epochs,
                peers=args.peers,
                seed=s + 1,
                hidden=args.hidden,
                lr=args.lr,
                target=args.target,
            )
            for s in range(args.seeds)
        ]
        rows.append(
            {
                "method": name,
                "elements_per_step": elements,
                "bytes_per_step": size,
                "share_of_dense": size / (4 * dense),
                "accuracy_mean": statistics.fmean(accuracies),
                "accuracy_min": min(accuracies),
                "accuracy_max": max(accuracies),
            }
        )
    if args.json:
        print(json.dumps(rows))
        return
    print(
        f"digits (hidden {args.hidden}), {args.peers} peers, {args.target} samples a step, "
        f"{args.epochs} epochs, "
        f"{args.seeds} data seeds"
    )
    header = ("method", "bytes/step", "of dense", "acc mean", "min", "max")
    print("{:<18} {:>10} {:>9} {:>9} {:>6} {:>6}".format(*header))
    for r in rows:
        print(
            f"{r['method']:<18} {r['bytes_per_step']:>10} {r['share_of_dense']:>9.1%}"
            f" {r['accuracy_mean']:>9.3f} {r['accuracy_min']:>6.3f} {r['accuracy_max']:>6.3f}"
        )


if __name__ == "__main__":
    main()
