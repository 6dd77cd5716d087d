"""``swarm demo``: a demo swarm of local peers training together on 127.0.0.1.

The first peer starts a run (``swarm train`` without ``--initial-peer``); the
others join it by running the exact command it prints, as a user on another
machine would. Every peer is its own process. Each line a peer prints is shown
with its name in front (``peer2 | epoch 3: ...``); a peer's log (stderr) is
kept and shown only if it fails.

The demo ends when every peer has exited: 0 if all exited 0. When a peer fails
the others are stopped and the demo exits with that peer's code; on Ctrl-C or
SIGTERM every peer is asked to leave after its current step (SIGTERM), and
killed if it has not left within ``DemoConfig.stop_timeout``. Every process is
reaped before ``run_demo`` returns, also when it raises or is cancelled.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import trio

from ._errors import ConfigError
from ._stdout import say

log = logging.getLogger("swarm")

#: Lines of a peer's log kept to show when it fails.
LOG_TAIL = 20
#: Seconds to read what exited peers left in their pipes.
PIPE_DRAIN_TIMEOUT = 5.0


@dataclass(frozen=True)
class DemoConfig:
    """The demo swarm; validated on construction (``ConfigError``)."""

    peers: int = 3
    max_epochs: int = 30
    task: str = "digits"
    #: peers on one machine find each other at once: a short window suffices
    matchmaking_time: float = 1.0
    target_batch_size: int = 256
    eval_every: int = 10
    #: how long the first peer waits for the others (they start in parallel)
    wait_for_peers: float = 120.0
    #: seconds a peer may take to print its join command or to leave when asked
    startup_timeout: float = 120.0
    stop_timeout: float = 30.0
    verbose: bool = False
    #: the command that runs ``swarm`` (default: this Python, ``-m swarm.cli``)
    command: tuple[str, ...] = field(default_factory=lambda: (sys.executable, "-m", "swarm.cli"))

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 32:
            raise ConfigError(f"--peers must be 1 to 32 (one process each), got {self.peers}")
        if self.max_epochs < 1:
            raise ConfigError(f"--max-epochs must be at least 1, got {self.max_epochs}")
        if not (math.isfinite(self.matchmaking_time) and self.matchmaking_time > 0):
            raise ConfigError(f"--matchmaking-time must be positive, got {self.matchmaking_time}")

    def first_peer(self) -> list[str]:
        return [
            *self.command, "train",
            "--host", "127.0.0.1",
            "--task", self.task,
            "--run-id", "demo",
            "--max-epochs", str(self.max_epochs),
            "--target-batch-size", str(self.target_batch_size),
            "--matchmaking-time", f"{self.matchmaking_time:g}",
            *self.each_peer(),
        ]  # fmt: skip

    def each_peer(self) -> list[str]:
        """Options of every peer beyond the join command: they start together."""
        return [
            "--min-peers", str(self.peers),
            "--wait-for-peers", f"{self.wait_for_peers:g}",
            "--eval-every", str(self.eval_every),
            "--threads", "1",
            *(["-v"] if self.verbose else []),
        ]  # fmt: skip


class _DemoPeer:
    """One peer process of the demo and what it printed."""

    def __init__(self, name: str, process: trio.Process) -> None:
        self.name = name
        self.process = process
        self.log: deque[str] = deque(maxlen=LOG_TAIL)
        self.join_command: str | None = None
        self.printed_join = trio.Event()
        #: set once stdout and stderr were read to their end
        self.stdout_read = trio.Event()
        self.stderr_read = trio.Event()

    async def relay_stdout(self) -> None:
        assert self.process.stdout is not None

        def on_line(line: str) -> None:
            if line.startswith("join with: ") and self.join_command is None:
                self.join_command = line[len("join with: ") :]
                self.printed_join.set()
            say(f"{self.name} | {line}")

        await _read_lines(self.process.stdout, on_line)
        self.printed_join.set()  # it exited: whoever waits learns it printed none
        self.stdout_read.set()

    async def keep_log(self) -> None:
        assert self.process.stderr is not None
        await _read_lines(self.process.stderr, self.log.append)
        self.stderr_read.set()

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def stop(self) -> None:
        """Ask the peer to leave after its current step (as Ctrl-C does)."""
        if self.running:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.running:
            self.process.kill()


async def _read_lines(stream: trio.abc.ReceiveStream, on_line: Callable[[str], object]) -> None:
    """Call ``on_line`` with each line of ``stream`` (without its newline) until it ends."""
    buffer = b""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            on_line(raw.decode(errors="replace"))
    if buffer:
        on_line(buffer.decode(errors="replace"))


class _Demo:
    """The running demo: its peers, and whether it is stopping them."""

    def __init__(self, config: DemoConfig, nursery: trio.Nursery) -> None:
        self.config = config
        self.nursery = nursery
        self.peers: list[_DemoPeer] = []
        #: the first peer that failed, and its exit code
        self.failure: tuple[_DemoPeer, int] | None = None
        self.stopping = False
        self.all_exited = trio.Event()

    async def start(self, name: str, argv: list[str]) -> _DemoPeer:
        log.debug("starting %s: %s", name, shlex.join(argv))
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        peer = _DemoPeer(name, process)
        self.peers.append(peer)
        say(f"demo: started {name} (pid {process.pid})")
        self.all_exited = trio.Event()
        self.nursery.start_soon(peer.relay_stdout)
        self.nursery.start_soon(peer.keep_log)
        self.nursery.start_soon(self._watch, peer)
        return peer

    async def _watch(self, peer: _DemoPeer) -> None:
        code = await peer.process.wait()
        if code != 0 and self.failure is None and not self.stopping:
            self.failure = (peer, code)
            say(f"demo: {peer.name} exited with {code}; stopping the others")
            self.stop()
        if not any(p.running for p in self.peers):
            self.all_exited.set()

    def stop(self) -> None:
        """Ask every peer to leave; kill those still running after ``stop_timeout``."""
        if self.stopping:
            return
        self.stopping = True
        for peer in self.peers:
            peer.stop()
        self.nursery.start_soon(self._kill_after, self.config.stop_timeout)

    async def _kill_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        for peer in self.peers:
            if peer.running:
                log.warning("%s did not leave within %gs: killing it", peer.name, seconds)
                peer.kill()

    def kill(self) -> None:
        for peer in self.peers:
            peer.kill()

    async def on_signals(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            if self.stopping:
                say("demo: interrupted again: killing every peer")
                self.kill()
            else:
                say(f"demo: {signal.Signals(signum).name}: every peer leaves after its step")
                self.stop()


async def run_demo(config: DemoConfig) -> int:
    """Run the demo swarm to the end; returns the exit code (see the module).

    Every peer process is reaped before this returns, also on an exception or
    cancellation (those still running are killed)."""
    began = time.monotonic()
    say(
        f"demo: {config.peers} peers on 127.0.0.1, one process each, train {config.task} for "
        f"{config.max_epochs} epochs together; Ctrl-C stops them all"
    )
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            demo = _Demo(config, nursery)
            try:
                nursery.start_soon(demo.on_signals, signals)
                await _start_peers(demo)
                await demo.all_exited.wait()
            finally:
                demo.kill()  # no-op for peers that exited
                with trio.CancelScope(shield=True):
                    for peer in demo.peers:
                        await peer.process.wait()
                    # what they printed last is still in the pipes: show it
                    with trio.move_on_after(PIPE_DRAIN_TIMEOUT):
                        for peer in demo.peers:
                            await peer.stdout_read.wait()
                            await peer.stderr_read.wait()
                nursery.cancel_scope.cancel()
    return _summary(demo, time.monotonic() - began)


async def _start_peers(demo: _Demo) -> None:
    """Start the first peer, then the others with the join command it printed."""
    config = demo.config
    first = await demo.start("peer1", config.first_peer())
    with trio.move_on_after(config.startup_timeout):
        await first.printed_join.wait()
    if first.join_command is None:
        if first.running:
            say(f"demo: peer1 printed no join command in {config.startup_timeout:g} s")
            demo.stop()
        code = await first.process.wait()
        if demo.failure is None:
            demo.failure = (first, code or 1)
        return
    for i in range(2, config.peers + 1):
        if demo.stopping:
            return
        await demo.start(f"peer{i}", [*shlex.split(first.join_command), *config.each_peer()])


def _summary(demo: _Demo, seconds: float) -> int:
    if demo.failure is not None:
        peer, code = demo.failure
        say(f"demo: {peer.name} failed (exit {code}); the last lines of its log:")
        for line in peer.log:
            say(f"{peer.name} ! {line}")
        return code if code > 0 else 1
    codes = [peer.process.returncode for peer in demo.peers]
    if any(code != 0 for code in codes):
        say(f"demo: exit codes {codes} after {seconds:.1f} s")
        return 1
    how = "stopped" if demo.stopping else "finished"
    say(f"demo: {len(codes)} peers {how}, exit 0, in {seconds:.1f} s")
    return 0
