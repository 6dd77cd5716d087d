"""Collaborative training with the library API, in a plain PyTorch loop.

Start a swarm on this machine, then join it from a second terminal (or
machine) with the command the first peer prints (it waits up to a minute for
you, ``--wait-for-peers``)::

    .venv/bin/python examples/digits_standalone.py --max-epochs 20
    .venv/bin/python examples/digits_standalone.py --initial-peer 127.0.0.1:41234 --max-epochs 20

``swarm train`` does the same with more options; this script shows the few
calls it takes to make an ordinary training loop collaborative: a running
``swarm.Peer`` and a ``trainer.CollaborativeOptimizer`` around the task's own
optimizer. ``opt.step()`` returns True when the swarm took a global step
(averaged gradients over the target batch size of all peers). On another
machine, listen on all interfaces and tell the others your address:
``--host 0.0.0.0 --port 31337 --announce 192.0.2.10:31337``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

from averaging import AveragerConfig, MatchmakingConfig
from swarm import BootstrapError, ConfigError, Peer, PeerConfig
from trainer import CollaborativeConfig, CollaborativeOptimizer, load_task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the digits task with a swarm.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="UDP+TCP port (default: any free)")
    parser.add_argument("--announce", metavar="HOST:PORT", help="address others dial, if not ours")
    parser.add_argument("--initial-peer", action="append", default=[], metavar="HOST:PORT")
    parser.add_argument("--run-id", default="digits-example")
    parser.add_argument("--target-batch-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per local step")
    parser.add_argument("--max-epochs", type=int, default=10, help="global steps to train")
    parser.add_argument(
        "--min-peers",
        type=int,
        default=None,
        help="wait for this many peers (default: 2 when starting a run, else 1)",
    )
    parser.add_argument(
        "--wait-for-peers", type=float, default=60.0, help="longest wait for --min-peers (s)"
    )
    parser.add_argument("--seed", type=int, default=None, help="this peer's data order")
    parser.add_argument(
        "--matchmaking-time", type=float, default=5.0, help="seconds to gather an averaging group"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the model is tiny: more threads only add overhead

    task = load_task("digits")
    # Every peer starts from the same weights (seed 0); each reads its own data order.
    model, inner_optimizer, scheduler = task.build(seed=0)
    try:
        config = PeerConfig(
            host=args.host, port=args.port, initial_peers=tuple(args.initial_peer),
            announce=args.announce,
        )  # fmt: skip
        # Settings are nested frozen dataclasses; each validates itself on construction.
        matchmaking = MatchmakingConfig(
            matchmaking_time=args.matchmaking_time,
            poll_interval=min(0.5, args.matchmaking_time / 4),
        )
        collaboration = CollaborativeConfig(averaging=AveragerConfig(matchmaking=matchmaking))
        min_peers = args.min_peers or (1 if args.initial_peer else 2)
        with Peer(config=config) as peer:
            print(f"join with: {_join_command(args, peer.address)}", flush=True)
            seed = args.seed if args.seed is not None else int(peer.peer_id.short(), 16)
            batches = task.batches(seed, args.batch_size)
            with CollaborativeOptimizer(
                peer,
                run_id=args.run_id,
                params=model.parameters(),
                optimizer=inner_optimizer,
                scheduler=scheduler,
                target_batch_size=args.target_batch_size,
                batch_size_per_step=args.batch_size,
                config=collaboration,
            ) as opt:
                if min_peers > 1:
                    print(f"waiting up to {args.wait_for_peers:g} s for peers to join", flush=True)
                    opt.wait_for_peers(min_peers, args.wait_for_peers)
                while opt.epoch < args.max_epochs:
                    model.train()
                    loss, samples = task.loss(model, next(batches))
                    loss.backward()
                    stepped = opt.step(samples, loss=loss.detach())  # read once per global step
                    opt.zero_grad()
                    if stepped:
                        metrics = task.run_evaluation(model)
                        opt.report_accuracy(metrics["accuracy"])  # shown by `swarm status`
                        peers = opt.swarm_progress().num_peers
                        print(
                            f"epoch {opt.epoch}: test accuracy {metrics['accuracy']:.3f}, "
                            f"test loss {metrics['loss']:.3f}, {peers} peers",
                            flush=True,
                        )
    except (ConfigError, BootstrapError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def _join_command(args: argparse.Namespace, address: str) -> str:
    """The command that joins this run, as it can be typed here: this Python
    and this script (relative to the working directory when inside it), the
    run's settings and its end, so that the joiner stops with the run."""

    def shown(path: str) -> str:
        relative = os.path.relpath(os.path.abspath(path))
        return path if relative.startswith("..") else relative

    parts = [shown(sys.executable), shown(sys.argv[0]), "--initial-peer", address]
    parts += ["--run-id", args.run_id, "--max-epochs", str(args.max_epochs)]
    parts += ["--target-batch-size", str(args.target_batch_size)]
    parts += ["--matchmaking-time", f"{args.matchmaking_time:g}"]
    return shlex.join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
