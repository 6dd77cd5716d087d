"""Benchmark: what the lossy plane's arithmetic alone costs training, without a network.

    python benchmarks/loss_arithmetic.py [--task digits|FILE.py:FACTORY] [--loss 0.1]
                                         [--steps 80] [--seeds 3] [--peers 4]
                                         [--batch-size 8] [--resync 10]
                                         [--lose contributions,results] [--parity K]

``benchmarks/loss.py`` trains on emulated links, where timing, CPU and the
control plane move one run's metric by several percent from run to run.
This one keeps only the arithmetic: ``--peers`` simulated peers in one
process, each with its own model and optimizer (the task's, from one seed)
and its own batch stream, take ``--steps`` global steps together. In each,
every peer computes one batch's gradient and the group averages them:

- *exact*: every peer gets the mean (the TCP plane's result);
- *lossy*: as the lossy data plane averages (``averaging._lossy``): the
  vector is cut into one part per peer, each part reduced by its peer with
  the plane's own estimator (``averaging._pieces.PieceReducer``: per piece,
  the weighted mean of the contributions that arrived), every other peer's
  piece lost on its way there with probability ``--loss``, and every piece
  of the result lost on its way back to each peer with the same
  probability, where that peer keeps its own value.

Each peer's optimizer then steps with what it holds. Every ``--resync``
steps the parameters and the optimizer's floating-point state are averaged
the same way (the state rounds). Both runs of a seed start from the same
weights and read the same batches; losses are drawn from one seeded
generator. ``--lose`` limits the loss to the contributions or the results,
to tell their costs apart. ``--parity K`` is a what-if the plane does not
do: a parity datagram after every K pieces of a result (lost like any),
from which a peer rebuilds the one piece of the K it lacks, if only one.
Reported per seed and as means: the task's metric after the last step
(accuracy where it reports one, the lowest of the peers; else perplexity or
loss, the highest), exact and lossy, and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
# benchmarks/dht.py would shadow the dht package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from averaging._pieces import PIECE_ELEMENTS, PieceReducer, num_pieces  # noqa: E402
from trainer import Task, load_task  # noqa: E402

#: the metrics a task's evaluation may report, in the order this looks for
#: them, and whether more is better
METRICS = (("accuracy", True), ("perplexity", False), ("loss", False))


def lossy_mean(
    vectors: list[torch.Tensor],
    loss: float,
    generator: torch.Generator,
    *,
    lose_contributions: bool = True,
    lose_results: bool = True,
    parity: int = 0,
) -> list[torch.Tensor]:
    """What each peer holds after a lossy round of ``vectors`` (one per peer,
    equal weights): part j reduced by peer j over the pieces that reached it,
    each piece of it back at peer m (m != j) unless lost, where peer m keeps
    its own values. ``loss`` 0 gives every peer the exact mean. ``parity``
    (a what-if: the plane sends none): one more datagram per ``parity``
    pieces of a result, lost like the others, from which a peer rebuilds
    the one piece of those it lacks, if it lacks only one."""
    n, total = len(vectors), vectors[0].numel()
    bounds = [total * j // n for j in range(n + 1)]
    held = [v.clone() for v in vectors]
    for j in range(n):
        a, b = bounds[j], bounds[j + 1]
        pieces = num_pieces(b - a)
        reducer = PieceReducer(b - a, dict.fromkeys(range(n), 1.0))
        reducer.add_all(j, vectors[j][a:b])
        for sender in range(n):
            if sender == j:
                continue
            arrived = _arrivals(pieces, loss if lose_contributions else 0.0, generator)
            for piece in arrived.nonzero().flatten().tolist():
                start = piece * PIECE_ELEMENTS
                end = min(start + PIECE_ELEMENTS, b - a)
                reducer.add(sender, piece, vectors[sender][a + start : a + end])
        reducer.finish()
        result = reducer.result()
        for member in range(n):
            if member == j:
                held[member][a:b] = result
                continue
            back = _arrivals(pieces, loss if lose_results else 0.0, generator)
            if parity:
                back = _repaired(back, parity, loss if lose_results else 0.0, generator)
            back = back.repeat_interleave(PIECE_ELEMENTS)[: b - a]
            held[member][a:b] = torch.where(back, result, vectors[member][a:b])
    return held


def _arrivals(pieces: int, loss: float, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(pieces, generator=generator) >= loss


def _repaired(
    arrived: torch.Tensor, k: int, loss: float, generator: torch.Generator
) -> torch.Tensor:
    """``arrived`` with each group of ``k`` pieces made whole where one piece
    of it was lost and the group's parity datagram (lost like any) arrived."""
    groups = -(-arrived.numel() // k)
    parity = _arrivals(groups, loss, generator)
    padded = torch.ones(groups * k, dtype=torch.bool)
    padded[: arrived.numel()] = arrived
    padded = padded.view(groups, k)
    whole = (padded.sum(dim=1) == k - 1) & parity
    padded[whole] = True
    return padded.flatten()[: arrived.numel()]


class _Peer:
    def __init__(self, task: Task[Any], seed: int, stream: int, batch_size: int) -> None:
        self.model, self.optimizer, _ = task.build(seed=seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.batches: Iterator[Any] = task.batches(stream, batch_size)

    def gradient(self, task: Task[Any]) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        loss, _ = task.loss(self.model, next(self.batches))
        loss.backward()
        return torch.cat(
            [torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in self.params]
        )

    def step(self, gradient: torch.Tensor) -> None:
        for p, g in zip(self.params, _split(gradient, self.params), strict=True):
            p.grad = g.view_as(p).clone()
        self.optimizer.step()

    def state(self) -> list[torch.Tensor]:
        """The parameters and the optimizer's floating-point state with a shape."""
        tensors = [p.data for p in self.params]
        for p in self.params:
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
                    tensors.append(value)
        return tensors


def _split(vector: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.split(vector, [t.numel() for t in like]))


def train(args: argparse.Namespace, task: Task[Any], seed: int, *, lossy: bool) -> list[float]:
    """One run: each peer's evaluation after ``args.steps`` global steps."""
    torch.manual_seed(seed)
    peers = [_Peer(task, seed, 1000 * seed + i, args.batch_size) for i in range(args.peers)]
    generator = torch.Generator().manual_seed(seed)

    def average(vectors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not lossy or args.loss == 0:
            mean = torch.stack(vectors).mean(dim=0)
            return [mean] * len(vectors)
        return lossy_mean(
            vectors,
            args.loss,
            generator,
            lose_contributions="contributions" in args.lose,
            lose_results="results" in args.lose,
            parity=args.parity,
        )

    for step in range(args.steps):
        for peer, held in zip(peers, average([p.gradient(task) for p in peers]), strict=True):
            peer.step(held)
        if args.resync and (step + 1) % args.resync == 0:
            with torch.no_grad():
                states = [p.state() for p in peers]
                flats = [torch.cat([t.reshape(-1) for t in s]) for s in states]
                for state, held in zip(states, average(flats), strict=True):
                    for t, values in zip(state, _split(held, state), strict=True):
                        t.copy_(values.view_as(t))
    return [_metric(task.run_evaluation(p.model)) for p in peers]


def _metric(report: dict[str, float]) -> float:
    for name, _ in METRICS:
        if name in report:
            return float(report[name])
    raise SystemExit(f"the task's evaluation reports none of {[m for m, _ in METRICS]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="digits")
    parser.add_argument("--loss", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--resync", type=int, default=10, help="0: never")
    parser.add_argument(
        "--lose", default="contributions,results", help="what may be lost (comma-separated)"
    )
    parser.add_argument(
        "--parity",
        type=int,
        default=0,
        help="what if a parity datagram followed every K pieces of a result (0: none, as the"
        " plane sends)",
    )
    args = parser.parse_args()
    lose = set(args.lose.split(","))
    if not 0 <= args.loss < 1 or args.steps < 1 or args.seeds < 1 or args.peers < 2:
        parser.error("need 0 <= --loss < 1, --steps >= 1, --seeds >= 1, --peers >= 2")
    if args.resync < 0 or args.parity < 0 or not lose <= {"contributions", "results"}:
        parser.error("need --resync >= 0, --parity >= 0 and --lose from contributions,results")
    args.lose = lose
    torch.set_num_threads(1)
    task = load_task(args.task)
    report = task.run_evaluation(task.build(seed=0)[0])
    name, higher = next((m, h) for m, h in METRICS if m in report)
    worst = min if higher else max
    print(
        f"{task.name}: {args.peers} peers, batches of {args.batch_size}, {args.steps} steps,"
        f" re-synchronised every {args.resync or 'never'}; lossy: {args.loss:.0%} of"
        f" {' and '.join(sorted(lose))} lost"
        + (f", a parity datagram per {args.parity} result pieces" if args.parity else "")
        + f"; {name}: the {worst.__name__} over the peers"
    )
    exact_runs, lossy_runs = [], []
    for seed in range(args.seeds):
        exact = worst(train(args, task, seed, lossy=False))
        lossy = worst(train(args, task, seed, lossy=True))
        exact_runs.append(exact)
        lossy_runs.append(lossy)
        print(f"  seed {seed}: exact {exact:.4f}  lossy {lossy:.4f}  ({lossy - exact:+.4f})")
    mean_exact, mean_lossy = statistics.mean(exact_runs), statistics.mean(lossy_runs)
    print(
        f"  mean:   exact {mean_exact:.4f}  lossy {mean_lossy:.4f}"
        f"  ({mean_lossy - mean_exact:+.4f}, {mean_lossy / mean_exact - 1:+.1%})"
    )


if __name__ == "__main__":
    main()
