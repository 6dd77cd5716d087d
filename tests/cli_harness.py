"""Run the ``swarm`` command as real processes; every process is reaped, also on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO

import trio

#: A copy of the built-in digits task that sleeps in every loss: unthrottled, the
#: first peer would finish all its epochs alone before the others import torch.
THROTTLED_TASK = """
import dataclasses
import time

from trainer import make_digits_task


def make_task():
    task = make_digits_task()

    def loss(model, batch):
        time.sleep({delay})  # a slow machine: the peers must wait for each other
        return task.loss(model, batch)

    return dataclasses.replace(task, loss=loss)
"""


def throttled_task_file(directory: Path, delay: float) -> str:
    """Write the throttled digits task into ``directory``; returns its ``--task`` value."""
    path = directory / f"throttled_{int(delay * 1000)}.py"
    path.write_text(THROTTLED_TASK.format(delay=delay))
    return f"{path}:make_task"


async def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nothing listens on (just freed)."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    sock.close()
    return port


class CLIProcess:
    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.output: list[str] = []
        self._buffer = b""

    async def read_stderr(self, timeout: float = 30.0) -> list[str]:
        """The whole stderr (with ``capture_stderr``) once the process closes it."""
        assert self.process.stderr is not None
        data = b""
        with trio.fail_after(timeout):
            while chunk := await self.process.stderr.receive_some(65536):
                data += chunk
        return data.decode(errors="replace").splitlines()

    async def finish(self, timeout: float = 60.0) -> int:
        """Read stdout to its end (into ``output``), then wait for the exit code."""
        assert self.process.stdout is not None
        with trio.fail_after(timeout):
            while chunk := await self.process.stdout.receive_some(4096):
                self._buffer += chunk
            lines = self._buffer.decode(errors="replace").split("\n")
            self._buffer = b""
            self.output.extend(line for line in lines if line)
            return await self.process.wait()

    async def read_line_containing(self, text: str, timeout: float = 30.0) -> str:
        """Read stdout until a line contains ``text``; fail after ``timeout`` seconds."""
        assert self.process.stdout is not None
        with trio.fail_after(timeout):
            while True:
                while b"\n" in self._buffer:
                    raw, self._buffer = self._buffer.split(b"\n", 1)
                    line = raw.decode(errors="replace")
                    self.output.append(line)
                    if text in line:
                        return line
                chunk = await self.process.stdout.receive_some(4096)
                if not chunk:
                    raise AssertionError(f"process exited before printing {text!r}: {self.output}")
                self._buffer += chunk

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for a clean exit; returns the exit code."""
        self.process.send_signal(sig)
        with trio.fail_after(timeout):
            return await self.process.wait()


@asynccontextmanager
async def run_cli(*args: str, capture_stderr: bool = False) -> AsyncIterator[CLIProcess]:
    """Run ``swarm *args`` with stdout (and with ``capture_stderr`` stderr) piped.

    On exit the process is killed if it still runs, and always reaped."""
    async with run_command(
        sys.executable, "-m", "swarm.cli", *args, capture_stderr=capture_stderr
    ) as cli:
        yield cli


@asynccontextmanager
async def run_command(
    *argv: str, capture_stderr: bool = False, stderr: IO[bytes] | None = None
) -> AsyncIterator[CLIProcess]:
    """Run ``argv`` as given (e.g. a command a peer printed), like ``run_cli``;
    with ``stderr`` (an open file), the process's stderr goes there."""
    if stderr is None:
        stderr_to: IO[bytes] | int = subprocess.PIPE if capture_stderr else subprocess.DEVNULL
    else:
        stderr_to = stderr
    process = await trio.lowlevel.open_process(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=stderr_to,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        yield CLIProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                await stream.aclose()


async def run_to_completion(
    *args: str, timeout: float = 30.0
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(timeout):
        return await trio.run_process(
            [sys.executable, "-m", "swarm.cli", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
