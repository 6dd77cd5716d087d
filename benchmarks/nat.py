"""Issue 21's scenario: two public peers and two behind home NATs, default flags.

Every peer runs ``swarm train`` as a user would, in a network namespace of its
own (``tests/netbed.py``; needs root): default ``--host``, the first peer with
no ``--initial-peer``, the others with the join command it prints. Layouts:

- ``nat``: peers 0 and 1 public, peers 2 and 3 each behind its own NAT
  (port-preserving MASQUERADE, a FORWARD chain that admits only replies)
- ``relay``: peer 0 public, peers 1-3 each behind its own NAT: everything that
  reaches a NATed peer goes through peer 0's relay
- ``public``: all four public, the baseline measured in the same run
- ``leave``: peer 0 public, peers 1-3 behind NATs that drop unsolicited
  packets (which hole punching needs on this bed, ``netbed.Nat``); peer 0
  is stopped (SIGTERM) at epoch ``--leave-at``, and the NATed peers, which punched
  direct connections and DHT paths to each other by themselves meanwhile,
  train on without it
- ``leave-no-punch``: the same with ``--no-auto-punch`` on the NATed peers,
  the baseline: without a public peer they cannot reach each other

For the ``leave`` layouts it also reports, per NATed peer, the rounds after
peer 0 was stopped: those in which all three remaining peers contributed (``data
of 3 of 3 senders``), out of those plus the partial ones and the epochs it
stepped without an average (``applying local gradients``, ``stepping alone``).

For each it reports the wall time from the first peer's start until the last
one finished, each peer's final accuracy, per peer the all-reduce rounds that
had every peer's data (``data of 4 of 4 senders``) out of all its rounds and
the mean seconds between its rounds, the reducer failures the peers logged,
what each peer said of its reachability, the CPU seconds each peer's process
used (``wait4``'s rusage), and what each public peer relayed (bytes and
circuits: its ``swarm_relay_*`` counters, scraped from ``--metrics-port``
every few seconds while it runs; the last scrape is reported, so up to one
interval of the end is missing).

    python benchmarks/nat.py                          # nat, relay and public, 30 epochs
    python benchmarks/nat.py --layouts leave leave-no-punch --leave-at 10
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
    "relay": [None, Nat(), Nat(), Nat()],
    "public": [None] * PEERS,
    "leave": [None, *[Nat(stealth=True)] * 3],
    "leave-no-punch": [None, *[Nat(stealth=True)] * 3],
}
#: Layouts whose peer 0 leaves after ``--leave-at`` epochs.
LEAVING = ("leave", "leave-no-punch")
_ALONE = re.compile(r"epoch \d+: .*(applying local gradients|stepping alone)")
_JOIN = re.compile(r"join with: ((?:\S*/)?swarm \S+ --initial-peer \S+.*)$")
_ROUND = re.compile(r"all-reduce [0-9a-f]+: data of (\d+) of (\d+) senders in every part")
_FINISHED = re.compile(r"finished at epoch (\d+): accuracy ([0-9.]+)")
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_RELAY_METRIC = re.compile(r"^swarm_relay_(bytes|circuits)_total (\S+)$", re.MULTILINE)
METRICS_PORT = 9100
#: Seconds between scrapes of the public peers' relay counters.
SCRAPE_INTERVAL = 3.0


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
    #: mean seconds between this peer's consecutive all-reduce rounds
    round_interval_s: float | None = None
    #: user + system CPU seconds of the peer's process
    cpu_s: float | None = None
    #: what it relayed for others (public peers; last scrape)
    relay_bytes: int | None = None
    relay_circuits: int | None = None
    #: leave layouts: after peer 0 was stopped, rounds with every remaining
    #: peer's data, and all rounds and epochs stepped without an average
    full_after_leave: int | None = None
    steps_after_leave: int | None = None


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


def _round_interval(stamps: list[float]) -> float | None:
    if len(stamps) < 2:
        return None
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _stamp(line: str) -> float | None:
    match = _STAMP.search(line)
    if match is None:
        return None
    seconds = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
    return seconds + int(match.group(2)) / 1000


class _RelayScraper:
    """Reads the relay counters of the public peers every ``SCRAPE_INTERVAL``
    seconds (from inside each one's namespace), keeping the last values."""

    def __init__(self, bed: NetBed, peers: list[int]) -> None:
        self.last: dict[int, dict[str, int]] = {}
        self._bed = bed
        self._peers = peers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fetch = (
            "import urllib.request; print(urllib.request.urlopen("
            f"'http://127.0.0.1:{METRICS_PORT}/metrics', timeout=2).read().decode())"
        )
        while not self._stop.wait(SCRAPE_INTERVAL):
            for i in self._peers:
                done = subprocess.run(
                    self._bed.exec(i, [sys.executable, "-c", fetch]),
                    capture_output=True,
                    text=True,
                    check=False,
                )
                found = {k: int(float(v)) for k, v in _RELAY_METRIC.findall(done.stdout)}
                if found:
                    self.last[i] = found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _wait_all(
    processes: list[subprocess.Popen[bytes]], deadline: float
) -> dict[int, tuple[int, float]]:
    """Reap the processes as they exit, until ``deadline``: exit code and CPU
    seconds (user + system) of each one that exited, by index."""
    reaped: dict[int, tuple[int, float]] = {}
    while len(reaped) < len(processes) and time.monotonic() < deadline:
        for i, process in enumerate(processes):
            if i in reaped:
                continue
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                process.returncode = code  # reaped here: Popen must not wait again
                reaped[i] = (code, usage.ru_utime + usage.ru_stime)
        time.sleep(0.5)
    return reaped


def run_layout(
    name: str, epochs: int, swarm_root: str | None, timeout: float, logs: Path, leave_at: int
) -> LayoutResult:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if swarm_root is not None:
        env["PYTHONPATH"] = swarm_root + os.pathsep + env.get("PYTHONPATH", "")
    swarm = [sys.executable, "-m", "swarm.cli"]
    train = [
        "train", "--run-id", "nat-bench", "--target-batch-size", "256", "--threads", "1",
        "--matchmaking-time", "2",
    ]  # fmt: skip
    local = [
        "--max-epochs", str(epochs), "--min-peers", str(PEERS), "--eval-every", str(epochs),
        "--metrics-port", str(METRICS_PORT),
    ]  # fmt: skip
    result = LayoutResult(name, 0.0)
    with NetBed([HOME] * PEERS, nats=LAYOUTS[name]) as bed:
        readers: list[_Reader] = []
        processes: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        join: list[str] = []
        for i in range(PEERS):
            argv = [*swarm, *(train if i == 0 else join), *local]
            if name == "leave-no-punch" and i > 0:
                argv.append("--no-auto-punch")
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
        public = [i for i, nat in enumerate(LAYOUTS[name]) if nat is None]
        scraper = _RelayScraper(bed, public)
        left: float | None = None
        try:
            if name in LEAVING:  # as a user stops it (Ctrl-C): a clean exit
                readers[0].wait_for(f"epoch {leave_at}:", timeout)
                processes[0].terminate()
                left = time.time()
            reaped = _wait_all(processes, start + timeout)
        finally:
            scraper.stop()
        result.wall_s = time.monotonic() - start
        for i, (process, reader) in enumerate(zip(processes, readers, strict=True)):
            finished = [m for m in map(_FINISHED.search, reader.lines) if m is not None]
            log_lines = (logs / f"{name}-peer{i}.log").read_text(errors="replace").splitlines()
            rounds = [m for m in map(_ROUND.search, log_lines) if m is not None]
            said = [line for line in reader.lines if line.startswith("reachability:")]
            stamps = [
                t for line in log_lines if _ROUND.search(line) and (t := _stamp(line)) is not None
            ]
            relayed = scraper.last.get(i, {})
            full_after = steps_after = None
            if left is not None and i > 0:
                after = [line for line in log_lines if (t := _stamp(line)) is not None and t > left]
                ended = [m for m in map(_ROUND.search, after) if m is not None]
                full_after = sum(1 for m in ended if m.group(1) == m.group(2) == str(PEERS - 1))
                steps_after = len(ended) + sum(1 for line in after if _ALONE.search(line))
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
                    round_interval_s=_round_interval(stamps),
                    cpu_s=reaped[i][1] if i in reaped else None,
                    relay_bytes=relayed.get("bytes"),
                    relay_circuits=relayed.get("circuits"),
                    full_after_leave=full_after,
                    steps_after_leave=steps_after,
                )
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--layouts", nargs="+", choices=sorted(LAYOUTS), default=["nat", "relay", "public"]
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument(
        "--leave-at", type=int, default=10, help="epochs after which peer 0 leaves (leave layouts)"
    )
    parser.add_argument("--swarm-root", default=None, help="run the peers from this source tree")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per layout")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="nat-bench-") as directory:
        for name in args.layouts:
            results.append(
                run_layout(
                    name, args.epochs, args.swarm_root, args.timeout, Path(directory), args.leave_at
                )
            )
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
        return
    for r in results:
        print(f"{r.layout}: {r.wall_s:.1f} s wall for {args.epochs} epochs")
        for i, p in enumerate(r.peers):
            accuracy = "-" if p.accuracy is None else f"{p.accuracy:.4f}"
            interval = "-" if p.round_interval_s is None else f"{p.round_interval_s:.2f}"
            cpu = "-" if p.cpu_s is None else f"{p.cpu_s:.1f}"
            relayed = (
                ""
                if p.relay_bytes is None
                else f", relayed {p.relay_bytes / 1e6:.1f} MB in {p.relay_circuits} circuits"
            )
            if p.steps_after_leave is not None:
                relayed += (
                    f", after peer 0 left: all {PEERS - 1} in {p.full_after_leave}/"
                    f"{p.steps_after_leave} rounds"
                )
            print(
                f"  peer {i}: accuracy {accuracy} at epoch {p.epoch}, exit {p.exit_code}, "
                f"rounds with all {PEERS}: {p.full_rounds}/{p.rounds} {p.round_kinds}, "
                f"{interval} s between rounds, CPU {cpu} s{relayed}, "
                f"reducer failures {p.reducer_failures}; {p.reachability[:60]}"
            )


if __name__ == "__main__":
    main()
