"""What ``swarm train`` checks at start (exit 2, one line), and what it survives
later: a full disk at a checkpoint, a closed stdout. Real processes, all reaped;
the file systems are tmpfs mounts the tests make and remove (root)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from cli_harness import CLIProcess, run_cli, run_to_completion

ALONE = ("--host", "127.0.0.1", "--threads", "1", "--wait-for-peers", "0")


@contextmanager
def tmpfs(path: Path, *options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` (with mount ``options``), unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)], check=True
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _damaged_checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "checkpoint-0000000010.swarm"
    path.write_bytes(b"SWARMCK1 this is not a checkpoint")
    return path


@pytest.mark.slow
async def test_start_up_checks_exit_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    _damaged_checkpoint(tmp_path / "damaged")
    busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    cases = {
        ("--checkpoint-dir", str(tmp_path / "a-file" / "sub")): "is not writable",
        (
            "--checkpoint-dir",
            str(tmp_path / "read-only"),
        ): "is not writable (Read-only file system)",
        ("--checkpoint-dir", str(tmp_path / "damaged")): "every checkpoint in",
        ("--port", str(port)): f"port {port} on 127.0.0.1 is in use (UDP)",
        ("--task", "no-such.py:make_task"): "no-such.py",
        ("--device", "cuda:7"): "device 'cuda:7' is not on this machine",
        ("--device", "tpu"): "unknown device 'tpu'",
    }

    async def check(args: tuple[str, ...], expected: str) -> None:
        result = await run_to_completion("train", *ALONE, *args, timeout=60)
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 2, (args, lines)
        assert len(lines) == 1 and lines[0].startswith("swarm train: error:"), lines
        assert expected in lines[0], lines

    with busy, tmpfs(tmp_path / "read-only", "ro", "size=64k"):
        async with trio.open_nursery() as nursery:
            for args, expected in cases.items():
                nursery.start_soon(check, args, expected)


async def test_restart_from_scratch_sets_damaged_checkpoints_aside(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    damaged = _damaged_checkpoint(directory)
    result = await run_to_completion(
        "train", *ALONE,
        "--max-epochs", "2",
        "--checkpoint-dir", str(directory),
        "--restart-from-scratch",
        timeout=90,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert "finished at epoch 2:" in result.stdout.decode()
    assert not damaged.exists() and damaged.with_name(damaged.name + ".damaged").exists()
    assert (directory / "checkpoint-0000000002.swarm").exists()


@pytest.mark.slow
async def test_a_full_disk_at_checkpoints_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    # 8 KiB: the start-up probe fits, a checkpoint of the digits model does not.
    train = ("train", *ALONE, "--max-epochs", "6", "--checkpoint-every", "2")
    stderr: list[str] = []

    async def read_stderr(peer: CLIProcess) -> None:
        stderr.extend(await peer.read_stderr(timeout=90))

    with tmpfs(tmp_path / "full", "size=8k") as directory:
        checkpoints = ("--checkpoint-dir", str(directory))
        async with (
            run_cli(*train, *checkpoints, capture_stderr=True) as peer,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(read_stderr, peer)
            assert await peer.finish(timeout=90) == 0, stderr
        # no partial checkpoint left behind (the metric history is kept there too)
        assert [p.name for p in directory.iterdir() if p.name != "history.jsonl"] == []
    assert any(line.startswith("finished at epoch 6: accuracy 0.") for line in peer.output)
    # epochs 2, 4, 6 and the final one all failed: one warning, no traceback
    warnings = [line for line in stderr if "could not write a checkpoint" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], stderr
    assert "No space left on device" in warnings[0], warnings
    assert not any("Traceback" in line for line in stderr), stderr


async def test_a_closed_stdout_does_not_kill_the_peer(tmp_path: Path) -> None:
    # `swarm train | head -1`: the reader goes away after the first line.
    async with run_cli("train", *ALONE, "--max-epochs", "20", capture_stderr=True) as peer:
        await peer.read_line_containing("listening on", timeout=60)
        assert peer.process.stdout is not None
        await peer.process.stdout.aclose()
        stderr = await peer.read_stderr(timeout=90)
        with trio.fail_after(30):
            assert await peer.process.wait() == 0, stderr
    assert not any("Traceback" in line or "BrokenPipe" in line for line in stderr), stderr
    assert any("stdout was closed" in line for line in stderr), stderr
