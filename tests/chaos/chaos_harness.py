"""Chaos runs: real ``swarm`` processes on 127.0.0.1 and a seeded schedule of faults.

A run is a bootstrap ``swarm dht`` plus training peers (``swarm train`` on a
throttled copy of the digits task, so that peers wait for each other). A
schedule drawn from ``random.Random(seed)`` kills training peers (SIGKILL) and
later restarts them with the same ``--identity`` and ``--checkpoint-dir``,
freezes one (SIGSTOP for longer than the averaging timeout, then SIGCONT),
kills the bootstrap, and lets new peers join late. Each fault is applied once
the swarm has reached the epoch the schedule names for it.

The run is observed only as a user could: the peers' stdout ("epoch N: ...",
"finished at epoch N: accuracy X"), their logs on stderr, their exit codes,
``swarm status --json`` and their checkpoint files. Every wait is bounded by
a figure derived from the configuration (``ChaosConfig.epoch_bound``), and
every process is reaped when the run ends, also on failure or interrupt.

``run_chaos(config, directory)`` prints the seed and the schedule first, so a
failing run is replayed with ``python tests/chaos/soak.py --seed N``.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trio
from cli_harness import CLIProcess, run_cli, run_to_completion, throttled_task_file

from averaging import MatchmakingConfig
from trainer import CheckpointDir, load_checkpoint

KILL, RESTART, FREEZE, KILL_BOOTSTRAP, JOIN = "kill", "restart", "freeze", "kill-bootstrap", "join"
BOOTSTRAP = "bootstrap"
RUN_ID = "chaos"
#: Seconds for a new process to import torch, join the DHT and print its address
#: (a bound, not a wait: on 2 loaded cores, starting 4 peers at once took over 90 s).
STARTUP_TIMEOUT = 180.0
#: Seconds for a killed or stopped process to be reaped.
EXIT_TIMEOUT = 30.0
#: What a trainer logs when it downloaded the swarm's state, before the epoch.
LOADED = "loaded the state of epoch "


def loaded_epoch(line: str) -> int | None:
    """The epoch of a "loaded the state of epoch N" log line, else None."""
    if LOADED not in line:
        return None
    return int(line.split(LOADED)[1].split()[0])


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run: the swarm, its training settings and how many faults of each kind."""

    seed: int
    #: training peers started together at the beginning
    peers: int = 3
    #: SIGKILLed training peers (each restarted later with its identity and checkpoints)
    kills: int = 1
    #: SIGSTOPped training peers (each continued after the averaging timeout)
    freezes: int = 1
    #: peers that join after the start
    joiners: int = 1
    max_epochs: int = 40
    target_batch_size: int = 768
    batch_size: int = 16
    #: seconds each local batch sleeps: a slow machine, so peers wait for each other
    delay: float = 0.1
    matchmaking_time: float = 1.0
    averaging_timeout: float = 6.0
    checkpoint_every: int = 2
    #: the first fault comes at this epoch; the next ones this many epochs apart
    first_fault_epoch: int = 3
    fault_gap: tuple[int, int] = (2, 4)
    #: no fault in the last epochs: late starters (seconds to import torch) still
    #: find donors, and the survivors finish in one group
    quiet_epochs: int = 20
    #: factor for a loaded machine (2 cores shared by every process of the run)
    slack: float = 3.0

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError("a chaos run needs at least 2 initial peers (one must keep training)")
        if self.max_epochs % 10:
            # the state is averaged every 10 epochs: the final one makes the survivors agree
            raise ValueError("max_epochs must be a multiple of 10")

    @property
    def epoch_bound(self) -> float:
        """Seconds within which the swarm's epoch must advance, whatever just failed:
        a matchmaking round (``MatchmakingConfig.bound``), an all-reduce that times
        out, and one epoch computed by a single peer, times ``slack``."""
        matchmaking = MatchmakingConfig(matchmaking_time=self.matchmaking_time).bound
        compute = self.target_batch_size / self.batch_size * self.delay
        return self.slack * (matchmaking + self.averaging_timeout + compute)

    @property
    def replay(self) -> str:
        return f"python tests/chaos/soak.py --seed {self.seed} --config '{_config_json(self)}'"


def _config_json(config: ChaosConfig) -> str:
    fields = {k: v for k, v in vars(config).items() if k != "seed"}
    return json.dumps(fields, separators=(",", ":"))


@dataclass(frozen=True)
class Fault:
    kind: str
    #: applied once the swarm has reached this epoch
    epoch: int
    #: "bootstrap", "peer0".. (initial peers) or "joiner0".. (late joiners)
    peer: str
    #: seconds a frozen peer stays stopped (at least until the swarm left it behind)
    seconds: float = 0.0

    def __str__(self) -> str:
        extra = f" for {self.seconds:.1f}s" if self.kind == FREEZE else ""
        return f"at epoch {self.epoch}: {self.kind} {self.peer}{extra}"


def make_schedule(config: ChaosConfig) -> tuple[Fault, ...]:
    """The faults of a run, a pure function of ``config`` (seed included).

    At every fault at least one other training peer keeps running; a killed
    peer is restarted by a later fault. Raises ``ValueError`` if the faults do
    not fit between ``first_fault_epoch`` and the quiet end of the run."""
    rng = random.Random(config.seed)
    remaining = Counter(
        {KILL: config.kills, FREEZE: config.freezes, KILL_BOOTSTRAP: 1, JOIN: config.joiners}
    )
    running = [f"peer{i}" for i in range(config.peers)]
    killed: list[str] = []
    joined = 0
    faults: list[Fault] = []
    epoch = config.first_fault_epoch
    while +remaining or killed:
        options = [kind for kind in (KILL_BOOTSTRAP, JOIN) if remaining[kind]]
        if len(running) >= 2:
            options += [kind for kind in (KILL, FREEZE) if remaining[kind]]
        if killed:
            options.append(RESTART)
        kind = rng.choice(options)
        remaining[kind] -= 1
        seconds = 0.0
        if kind == KILL_BOOTSTRAP:
            peer = BOOTSTRAP
        elif kind == JOIN:
            peer = f"joiner{joined}"
            joined += 1
            running.append(peer)
        elif kind == RESTART:
            peer = killed.pop(rng.randrange(len(killed)))
            running.append(peer)
        else:
            peer = rng.choice(running)
            if kind == KILL:
                running.remove(peer)
                killed.append(peer)
            else:
                seconds = round(config.averaging_timeout * rng.uniform(1.2, 2.0), 1)
        faults.append(Fault(kind, epoch, peer, seconds))
        epoch += rng.randint(*config.fault_gap)
    last = faults[-1].epoch if faults else 0
    if last > config.max_epochs - config.quiet_epochs:
        raise ValueError(
            f"{len(faults)} faults reach epoch {last}: raise max_epochs above "
            f"{last + config.quiet_epochs} or lower fault_gap"
        )
    return tuple(faults)


@dataclass
class ChaosPeer:
    """One peer of the run across its restarts, as seen from outside."""

    name: str
    directory: Path
    #: the running process (None before the start and after a kill)
    cli: CLIProcess | None = None
    address: str | None = None
    peer_id: str | None = None
    #: the last "epoch N:" line of the current process
    epoch: int = 0
    #: the newest state it downloaded ("loaded the state of epoch N"), which
    #: prints no "epoch" line
    loaded: int = 0
    #: the "finished at epoch N: ..." line
    finished: str | None = None
    frozen: bool = False
    #: exit codes of every process this peer ran, in order
    exit_codes: list[int] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    @property
    def identity(self) -> Path:
        return self.directory / "identity.key"

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    @property
    def running(self) -> bool:
        return self.cli is not None and self.cli.process.returncode is None

    def log_since(self, start: int, text: str) -> int | None:
        """Index of the first stderr line from ``start`` on that contains ``text``."""
        for index in range(start, len(self.stderr)):
            if text in self.stderr[index]:
                return index
        return None

    def on_line(self, stream: str, line: str) -> None:
        if stream == "stderr":
            self.stderr.append(line)
            loaded = loaded_epoch(line)
            if loaded is not None:
                self.loaded = max(self.loaded, loaded)
            return
        self.stdout.append(line)
        words = line.split()
        if line.startswith("peer ") and " listening on " in line:
            self.peer_id, self.address = words[1], words[-1]
        elif line.startswith("epoch ") and words[1].endswith(":"):
            self.epoch = int(words[1][:-1])
        elif line.startswith("finished at epoch "):
            self.finished = line


class ChaosSwarm:
    """The processes of one run; use ``open_chaos_swarm``."""

    def __init__(
        self,
        config: ChaosConfig,
        directory: Path,
        nursery: trio.Nursery,
        stack: AsyncExitStack,
    ) -> None:
        self.config = config
        self.directory = directory
        self.task = throttled_task_file(directory, config.delay)
        self.peers: dict[str, ChaosPeer] = {}
        self._nursery = nursery
        self._stack = stack
        self._changed = trio.Event()
        self._pending_checks: Counter[str] = Counter()

    # -- observing ---------------------------------------------------------------------

    def peer(self, name: str) -> ChaosPeer:
        if name not in self.peers:
            directory = self.directory / name
            directory.mkdir()
            self.peers[name] = ChaosPeer(name, directory)
        return self.peers[name]

    @property
    def epoch(self) -> int:
        """The swarm's epoch: the most advanced epoch any training peer printed."""
        return max((p.epoch for p in self.peers.values() if p.name != BOOTSTRAP), default=0)

    def trainers(self) -> list[ChaosPeer]:
        return [p for p in self.peers.values() if p.name != BOOTSTRAP]

    def live_addresses(self) -> list[str]:
        """Addresses of running, unfrozen peers, the bootstrap first."""
        return [
            p.address
            for p in self.peers.values()
            if p.running and not p.frozen and p.address is not None
        ]

    def describe(self) -> str:
        lines = [f"seed {self.config.seed}; replay: {self.config.replay}"]
        for p in self.peers.values():
            state = "frozen" if p.frozen else "running" if p.running else "stopped"
            lines.append(
                f"  {p.name} ({state}, epoch {p.epoch}, exits {p.exit_codes}): "
                f"{p.stdout[-2:]} log: {p.stderr[-4:]}"
            )
        return "\n".join(lines)

    async def wait_for(self, what: str, condition: Callable[[], bool], timeout: float) -> None:
        """Wait until ``condition()`` holds, re-checked on every line any peer prints;
        raises ``AssertionError`` (with the state of every peer) after ``timeout``."""
        with trio.move_on_after(timeout):
            while not condition():
                await self._changed.wait()
            return
        raise AssertionError(f"{what}: not within {timeout:.0f}s\n{self.describe()}")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _read(self, peer: ChaosPeer, cli: CLIProcess, stream_name: str) -> None:
        stream = cli.process.stdout if stream_name == "stdout" else cli.process.stderr
        assert stream is not None
        log = (peer.directory / f"{stream_name}.log").open("a", encoding="utf-8")
        buffer = b""
        with log, contextlib.suppress(trio.ClosedResourceError):  # closed by run_cli
            while chunk := await stream.receive_some(65536):
                *lines, buffer = (buffer + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace")
                    peer.on_line(stream_name, line)
                    print(line, file=log, flush=True)
                self._notify()
        if stream_name == "stdout":
            peer.exit_codes.append(await cli.process.wait())
            self._notify()

    def check_soon(self, check: Callable[[], Awaitable[None]], peer: str = "") -> None:
        """Run ``check`` (about ``peer``) beside the next faults; a failure fails the
        run at once. ``checks_done`` waits for the checks (of one peer)."""
        self._pending_checks[peer] += 1

        async def run() -> None:
            await check()
            self._pending_checks[peer] -= 1
            self._notify()

        self._nursery.start_soon(run)

    async def checks_done(self, timeout: float, peer: str | None = None) -> None:
        """Wait for the checks begun after faults: all of them, or ``peer``'s (a
        fault that stops a peer first lets the checks of its recovery finish)."""
        await self.wait_for(
            f"the checks begun after faults{'' if peer is None else ' about ' + peer}",
            lambda: (
                not (
                    sum(self._pending_checks.values())
                    if peer is None
                    else self._pending_checks[peer]
                )
            ),
            timeout,
        )

    # -- starting and faults -----------------------------------------------------------

    async def _start(self, peer: ChaosPeer, *args: str) -> None:
        cli = await self._stack.enter_async_context(run_cli(*args, capture_stderr=True))
        peer.cli, peer.address, peer.epoch, peer.finished = cli, None, 0, None
        exits = len(peer.exit_codes)
        self._nursery.start_soon(self._read, peer, cli, "stdout")
        self._nursery.start_soon(self._read, peer, cli, "stderr")
        await self.wait_for(
            f"{peer.name} prints its address",
            lambda: peer.address is not None or len(peer.exit_codes) > exits,
            STARTUP_TIMEOUT,
        )
        assert peer.address is not None, f"{peer.name} exited: {peer.stderr[-1:]}"

    async def start_bootstrap(self) -> None:
        peer = self.peer(BOOTSTRAP)
        await self._start(peer, "dht", "--host", "127.0.0.1", "--identity", str(peer.identity))

    async def start_trainer(self, name: str, *extra: str) -> ChaosPeer:
        """Start (or restart) training peer ``name``, joining through every live peer."""
        c = self.config
        peer = self.peer(name)
        initial = [arg for address in self.live_addresses() for arg in ("--initial-peer", address)]
        await self._start(
            peer,
            "train", "--host", "127.0.0.1", "--threads", "1",
            "--task", self.task,
            "--run-id", RUN_ID,
            "--target-batch-size", str(c.target_batch_size),
            "--batch-size", str(c.batch_size),
            "--max-epochs", str(c.max_epochs),
            "--matchmaking-time", str(c.matchmaking_time),
            "--averaging-timeout", str(c.averaging_timeout),
            "--eval-every", "10",
            "--identity", str(peer.identity),
            "--checkpoint-dir", str(peer.checkpoints),
            "--checkpoint-every", str(c.checkpoint_every),
            *initial, *extra,
        )  # fmt: skip
        return peer

    async def kill(self, peer: ChaosPeer) -> None:
        assert peer.cli is not None and peer.running, f"{peer.name} is not running"
        peer.cli.process.send_signal(signal.SIGKILL)
        with trio.fail_after(EXIT_TIMEOUT):
            await peer.cli.process.wait()
        await self.wait_for(f"{peer.name} is reaped", lambda: bool(peer.exit_codes), EXIT_TIMEOUT)
        assert peer.exit_codes[-1] == -signal.SIGKILL, peer.exit_codes
        peer.cli = None

    async def status(self) -> dict[str, Any]:
        """``swarm status --json`` through the live peers (any one that answers)."""
        initial = [arg for address in self.live_addresses() for arg in ("--initial-peer", address)]
        result = await run_to_completion(
            "status", *initial, "--run-id", RUN_ID, "--json", timeout=STARTUP_TIMEOUT
        )
        assert result.returncode == 0, result.stderr.decode()
        status: dict[str, Any] = json.loads(result.stdout)
        return status


@asynccontextmanager
async def open_chaos_swarm(config: ChaosConfig, directory: Path) -> AsyncIterator[ChaosSwarm]:
    """A ``ChaosSwarm`` whose processes are all killed (if still running) and reaped on
    exit, also when the body raises or is cancelled."""
    # The exit stack (run_cli's kill and reap, one per process) unwinds first; each
    # reader then ends at the end of its pipe. Nothing here cancels the nursery: a
    # Cancelled raised while unwinding would replace, and swallow, the body's error.
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        yield ChaosSwarm(config, directory, nursery, stack)


# -- the run ----------------------------------------------------------------------------


@dataclass
class ChaosReport:
    """What a run survived (for the soak summary)."""

    seed: int
    schedule: tuple[Fault, ...]
    accuracies: dict[str, float] = field(default_factory=dict)
    identical: list[str] = field(default_factory=list)


async def run_chaos(config: ChaosConfig, directory: Path) -> ChaosReport:
    """Run ``config``'s swarm through its fault schedule and check every invariant.

    Raises ``AssertionError`` naming the seed, the replay command and the state
    of every peer when one fails."""
    schedule = make_schedule(config)
    print(f"chaos seed {config.seed}: {config}", flush=True)
    for fault in schedule:
        print(f"  {fault}", flush=True)
    print(f"  replay: {config.replay}", flush=True)
    report = ChaosReport(config.seed, schedule)
    async with open_chaos_swarm(config, directory) as swarm:
        await swarm.start_bootstrap()
        async with trio.open_nursery() as nursery:
            for i in range(config.peers):
                nursery.start_soon(
                    swarm.start_trainer, f"peer{i}", "--min-peers", str(config.peers)
                )
        for fault in schedule:
            await swarm.wait_for(
                f"the swarm reaches epoch {fault.epoch} (for {fault})",
                lambda f=fault: swarm.epoch >= f.epoch,
                config.epoch_bound * max(1, fault.epoch - swarm.epoch + 1),
            )
            print(f"applying {fault} (swarm at epoch {swarm.epoch})", flush=True)
            await _APPLY[fault.kind](swarm, fault)
        await swarm.checks_done(config.epoch_bound + STARTUP_TIMEOUT)
        await _finish(swarm, report)
    _check_checkpoints(swarm, report)
    return report


async def _advances(swarm: ChaosSwarm, fault: Fault, since: int) -> None:
    """The run never stops: the epoch passes ``since`` within ``epoch_bound``; and
    ``swarm status`` (through a live peer) sees it too."""
    await swarm.wait_for(
        f"the epoch advances past {since} after {fault}",
        lambda: swarm.epoch > since,
        swarm.config.epoch_bound,
    )

    async def status_agrees() -> None:
        # in the background: a status process takes seconds to start, and the
        # schedule's next fault should not wait for it
        status = await swarm.status()
        assert status["run_id"] == RUN_ID and status["epoch"] > since, (fault, status)

    swarm.check_soon(status_agrees)


async def _kill(swarm: ChaosSwarm, fault: Fault) -> None:
    peer = swarm.peers[fault.peer]
    await swarm.checks_done(swarm.config.epoch_bound + STARTUP_TIMEOUT, peer.name)
    since = swarm.epoch
    await swarm.kill(peer)
    await _advances(swarm, fault, since)


async def _freeze(swarm: ChaosSwarm, fault: Fault) -> None:
    """SIGSTOP for ``fault.seconds`` (more than the averaging timeout) and until the
    others have taken two steps without it; after SIGCONT the peer must download
    the state before it averages anything (checked in the background)."""
    peer = swarm.peers[fault.peer]
    await swarm.checks_done(swarm.config.epoch_bound + STARTUP_TIMEOUT, peer.name)
    assert peer.cli is not None and peer.running
    # The epoch it is in: a state it downloaded counts, though it printed none.
    behind = max(peer.epoch, peer.loaded)
    peer.cli.process.send_signal(signal.SIGSTOP)
    peer.frozen = True
    try:
        with trio.move_on_after(fault.seconds):
            await trio.sleep_forever()  # the fault's duration, not an assertion
        await swarm.wait_for(
            f"the swarm leaves {peer.name} behind ({fault})",
            lambda: swarm.epoch >= behind + 2,
            2 * swarm.config.epoch_bound,
        )
    finally:
        peer.cli.process.send_signal(signal.SIGCONT)
        peer.frozen = False
    woke, swarm_epoch = len(peer.stderr), swarm.epoch

    async def resynchronises() -> None:
        await swarm.wait_for(
            f"{peer.name} downloads the state after waking ({fault})",
            lambda: peer.log_since(woke, LOADED) is not None,
            swarm.config.epoch_bound + STARTUP_TIMEOUT,
        )
        loaded = peer.log_since(woke, LOADED)
        assert loaded is not None
        # The one round it may finish is the one it was frozen in, if that round
        # completed (its data was in before the freeze): then the others log the
        # same epoch and group size. Any other averaging mixes in stale gradients.
        for line in peer.stderr[woke:loaded]:
            if "averaged gradients with" in line:
                said = line.split("INFO trainer._optimizer: ")[1]
                epoch, size = int(said.split()[1][:-1]), int(said.split()[-2])
                others = sum(
                    said in other_line
                    for other in swarm.trainers()
                    if other is not peer
                    for other_line in other.stderr
                )
                assert epoch == behind and others >= size - 1, (
                    f"{peer.name} averaged stale gradients after waking: {line}"
                )
        epoch = loaded_epoch(peer.stderr[loaded])
        assert epoch is not None
        assert epoch >= swarm_epoch, (peer.name, epoch, swarm_epoch)

    swarm.check_soon(resynchronises, peer.name)


async def _restart(swarm: ChaosSwarm, fault: Fault) -> None:
    """Same identity, same checkpoint directory: the peer keeps its peer id, resumes
    from its newest checkpoint, downloads the swarm's state and catches up."""
    peer = swarm.peers[fault.peer]
    old_id = peer.peer_id
    saved = CheckpointDir(peer.checkpoints).latest()
    since = len(peer.stderr)
    target = swarm.epoch
    await swarm.start_trainer(peer.name)
    assert peer.peer_id == old_id, "a restart with the same --identity keeps the peer id"
    await _advances(swarm, fault, target)

    async def catches_up() -> None:
        if saved is not None:
            resumed = f"resumed from the checkpoint of epoch {saved.epoch}"
            await swarm.wait_for(
                f"{peer.name} {resumed}",
                lambda: peer.log_since(since, resumed) is not None,
                STARTUP_TIMEOUT,
            )
        await _catches_up(swarm, peer, target, since)

    swarm.check_soon(catches_up, peer.name)


async def _catches_up(swarm: ChaosSwarm, peer: ChaosPeer, target: int, since: int) -> None:
    """``peer`` downloads a state at least as new as ``target`` and steps past it."""
    await swarm.wait_for(
        f"{peer.name} catches up with epoch {target}",
        lambda: peer.epoch > target,
        swarm.config.epoch_bound + STARTUP_TIMEOUT,
    )
    loaded = peer.log_since(since, LOADED)
    assert loaded is not None, (peer.name, peer.stderr[since:])


async def _join(swarm: ChaosSwarm, fault: Fault) -> None:
    target = swarm.epoch
    peer = await swarm.start_trainer(fault.peer)
    await _advances(swarm, fault, target)
    swarm.check_soon(partial(_catches_up, swarm, peer, target, 0), peer.name)


async def _kill_bootstrap(swarm: ChaosSwarm, fault: Fault) -> None:
    since = swarm.epoch
    await swarm.kill(swarm.peers[BOOTSTRAP])
    await _advances(swarm, fault, since)


_APPLY = {
    KILL: _kill,
    FREEZE: _freeze,
    RESTART: _restart,
    JOIN: _join,
    KILL_BOOTSTRAP: _kill_bootstrap,
}


async def _finish(swarm: ChaosSwarm, report: ChaosReport) -> None:
    """Every running peer exits 0 by itself at ``max_epochs`` with accuracy >= 0.9."""
    c = swarm.config
    live = [p for p in swarm.trainers() if p.running]
    await swarm.wait_for(
        f"every running peer exits by itself at epoch {c.max_epochs}",
        lambda: all(not p.running and p.exit_codes for p in live),
        c.epoch_bound * max(1, c.max_epochs - swarm.epoch + 1),
    )
    for p in live:
        assert p.exit_codes[-1] == 0, (p.name, p.exit_codes, p.stderr[-5:])
        assert p.finished is not None, (p.name, p.stdout[-3:])
        words = p.finished.replace(",", "").split()
        assert words[3] == f"{c.max_epochs}:" and words[4] == "accuracy", p.finished
        report.accuracies[p.name] = float(words[5])
        assert report.accuracies[p.name] >= 0.9, f"{p.name}: {p.finished}"
    bootstrap = swarm.peers.get(BOOTSTRAP)
    if bootstrap is not None and bootstrap.running:
        assert bootstrap.cli is not None
        assert await bootstrap.cli.stop(signal.SIGTERM) == 0


def _check_checkpoints(swarm: ChaosSwarm, report: ChaosReport) -> None:
    """No checkpoint is half-written: every complete file loads (CRC checked). The
    peers that finished in one group at the last epoch hold identical parameters."""
    c = swarm.config
    final: dict[str, dict[str, torch.Tensor]] = {}
    for p in swarm.trainers():
        for path in CheckpointDir(p.checkpoints).paths():
            checkpoint = load_checkpoint(path)
            if checkpoint.epoch == c.max_epochs and p.name in report.accuracies:
                final[p.name] = checkpoint.model
    assert set(final) == set(report.accuracies), (sorted(final), sorted(report.accuracies))
    # "epoch <max>: averaged parameters with N peers": the logs say how big each
    # finisher's last group was, not who was in it. The finishers that said N
    # were in ceil(count / N) groups at least, and each group's members hold one
    # set of parameters. A group may hold fewer finishers than N: a member that
    # the leader counted but that never heard of the group (its own matchmaking
    # timed out) says "0 peers" and keeps its own values, as the all-reduce's
    # fault tolerance intends (seed 18 of the soak).
    sizes: dict[int, list[str]] = {}
    said = f"epoch {c.max_epochs}: averaged parameters with "
    for name in final:
        index = swarm.peers[name].log_since(0, said)
        if index is not None:
            size = int(swarm.peers[name].stderr[index].split(said)[1].split()[0])
            sizes.setdefault(size, []).append(name)
    for size, names in sorted(sizes.items()):
        if size < 2:
            continue
        classes: list[list[str]] = []
        for name in names:
            for members in classes:
                if _same_parameters(final[members[0]], final[name]):
                    members.append(name)
                    break
            else:
                classes.append([name])
        groups = -(-len(names) // size)
        assert len(classes) <= groups and all(len(m) <= size for m in classes), (
            f"finishers that averaged parameters in groups of {size} differ: {classes}"
        )
        report.identical = max([report.identical, *classes], key=len)


def _same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
