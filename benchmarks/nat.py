"""Issue 21's scenario: two public peers and two behind home NATs, default flags.

Every peer runs ``swarm train`` as a user would, in a network namespace of its
own (``tests/netbed.py``; needs root): default ``--host``, the first peer with
no ``--initial-peer``, the others with the join command it prints. Layouts:

- ``nat``: peers 0 and 1 public, peers 2 and 3 each behind its own NAT
  (port-preserving MASQUERADE, a FORWARD chain that admits only replies)
- ``public``: all four public, the baseline measured in the same run

For each it reports the wall time from the first peer's start until the last
one finished, each peer's final accuracy, per peer the all-reduce rounds that
had every peer's data (``data of 4 of 4 senders``) out of all its rounds, the
reducer failures the peers logged, and what each peer said of its reachability.

    python benchmarks/nat.py                          # nat and public, 30 epochs
    python benchmarks/nat.py --layouts nat --swarm-root /tmp/base   # older code

``--swarm-root DIR`` runs the peers from another source tree (e.g. ``git
archive`` of the commit before issue 21 into DIR), put first on PYTHONPATH
and used as their working directory (``python -m`` puts that first on
sys.path); the bed is always this tree's. Links are 20 mbit/s each way (tbf), the task
the built-in digits; the congestion control is the machine's default (BBR
here). The machine's load shows in the times: compare layouts of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# this script's directory first on sys.path would shadow the dht package with benchmarks/dht.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.append(str(_HERE.parent / "tests"))

from netbed import Link, Nat, NetBed  # noqa: E402

PEERS = 4
HOME = Link("20mbit", "20mbit")
LAYOUTS: dict[str, list[Nat | None]] = {
    "nat": [None, None, Nat(), Nat()],
    "public": [None] * PEERS,
}
_JOIN = re.compile(r"join with: ((?:\S*/)?swarm \S+ --initial-peer \S+.*)$")
_ROUND = re.compile(r"all-reduce [0-9a-f]+: data of (\d+) of (\d+) senders in every part")
_FINISHED = re.compile(r"finished at epoch (\d+): accuracy ([0-9.]+)")


@dataclass
class PeerResult:
    accuracy: float | None
    epoch: int | None
    exit_code: int | None
    rounds: int
    full_rounds: int
    #: "K/M" (data of K of M senders in every part) -> rounds
    round_kinds: dict[str, int]
    reducer_failures: int
    reachability: str


@dataclass
class LayoutResult:
    layout: str
    wall_s: float
    peers: list[PeerResult] = field(default_factory=list)


class _Reader:
    """Collects a process's stdout lines in a thread, so its pipe never fills."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(process,), daemon=True)
        self._thread.start()

    def _run(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line with {text!r} in {timeout} s: {self.lines[-5:]}")
                self._cond.wait(left)


def run_layout(
    name: str, epochs: int, swarm_root: str | None, timeout: float, logs: Path
) -> LayoutResult:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if swarm_root is not None:
        env["PYTHONPATH"] = swarm_root + os.pathsep + env.get("PYTHONPATH", "")
    swarm = [sys.executable, "-m", "swarm.cli"]
    train = [
        "train", "--run-id", "nat-bench", "--target-batch-size", "256", "--threads", "1",
        "--matchmaking-time", "2",
    ]  # fmt: skip
    local = ["--max-epochs", str(epochs), "--min-peers", str(PEERS), "--eval-every", str(epochs)]
    result = LayoutResult(name, 0.0)
    with NetBed([HOME] * PEERS, nats=LAYOUTS[name]) as bed:
        readers: list[_Reader] = []
        processes: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        join: list[str] = []
        for i in range(PEERS):
            argv = [*swarm, *(train if i == 0 else join), *local]
            with (logs / f"{name}-peer{i}.log").open("wb") as log:
                process = bed.popen(
                    i, argv, stdout=subprocess.PIPE, stderr=log, env=env, cwd=swarm_root
                )
            processes.append(process)
            readers.append(_Reader(process))
            if i == 0:
                line = readers[0].wait_for("join with:", 120)
                match = _JOIN.search(line)
                assert match is not None, line
                join = shlex.split(match.group(1))[1:]
        deadline = start + timeout
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        result.wall_s = time.monotonic() - start
        for i, (process, reader) in enumerate(zip(processes, readers, strict=True)):
            finished = [m for m in map(_FINISHED.search, reader.lines) if m is not None]
            log_lines = (logs / f"{name}-peer{i}.log").read_text(errors="replace").splitlines()
            rounds = [m for m in map(_ROUND.search, log_lines) if m is not None]
            said = [line for line in reader.lines if line.startswith("reachability:")]
            result.peers.append(
                PeerResult(
                    accuracy=float(finished[-1].group(2)) if finished else None,
                    epoch=int(finished[-1].group(1)) if finished else None,
                    exit_code=process.poll(),
                    rounds=len(rounds),
                    full_rounds=sum(1 for m in rounds if m.group(1) == m.group(2) == str(PEERS)),
                    round_kinds=dict(
                        sorted(Counter(f"{m.group(1)}/{m.group(2)}" for m in rounds).items())
                    ),
                    reducer_failures=sum("reducer of part" in line for line in log_lines),
                    reachability=said[-1] if said else "-",
                )
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["nat", "public"])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--swarm-root", default=None, help="run the peers from this source tree")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="nat-bench-") as directory:
        for name in args.layouts:
            results.append(
                run_layout(name, args.epochs, args.swarm_root, args.timeout, Path(directory))
            )
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return
    for r in results:
        print(f"{r.layout}: {r.wall_s:.1f} s wall for {args.epochs} epochs")
        for i, p in enumerate(r.peers):
            accuracy = "-" if p.accuracy is None else f"{p.accuracy:.4f}"
            print(
                f"  peer {i}: accuracy {accuracy} at epoch {p.epoch}, exit {p.exit_code}, "
                f"rounds with all {PEERS}: {p.full_rounds}/{p.rounds} {p.round_kinds}, "
                f"reducer failures {p.reducer_failures}; {p.reachability[:60]}"
            )


if __name__ == "__main__":
    main()
