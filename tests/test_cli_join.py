"""Joining a run as a user does: the printed command, run as printed, and the
run's settings, adopted or refused. Real processes on 127.0.0.1, all reaped."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import trio
from cli_harness import CLIProcess, run_cli, run_command, run_to_completion, throttled_task_file

FAST = ("--host", "127.0.0.1", "--threads", "1", "--averaging-timeout", "6")


async def _join_command(peer: CLIProcess) -> str:
    line = await peer.read_line_containing("join with:", timeout=60)
    return line.removeprefix("join with: ")


async def _finishes(peer: CLIProcess, epoch: int) -> None:
    line = await peer.read_line_containing("finished at epoch", timeout=90)
    assert line.startswith(f"finished at epoch {epoch}: accuracy 0."), line
    with trio.fail_after(20):
        assert await peer.process.wait() == 0


@pytest.mark.slow
async def test_the_printed_join_command_joins_and_ends_with_the_run(tmp_path: Path) -> None:
    first_args = (
        "train", *FAST,
        "--matchmaking-time", "1",
        "--task", throttled_task_file(tmp_path, 0.02),
        "--run-id", "join-test",
        "--target-batch-size", "64",
        "--batch-size", "8",
        "--max-epochs", "3",
    )  # fmt: skip
    async with run_cli(*first_args) as first:
        join = await _join_command(first)
        # it names the run's end, and the way to run swarm here
        assert " --max-epochs 3" in join and " --matchmaking-time 1" in join, join
        waiting = await first.read_line_containing("waiting up to", timeout=10)
        assert waiting.startswith("waiting up to 60 s for peers to join"), waiting
        async with run_command(*shlex.split(join)) as second:
            assert (await second.read_line_containing("listening on", timeout=60)).startswith(
                "peer "
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_finishes, first, 3)
                nursery.start_soon(_finishes, second, 3)
        # they trained together: the first peer waited for the second
        epochs = [line for line in first.output if line.startswith("epoch 1:")]
        assert len(epochs) == 1 and epochs[0].endswith("; 2 peers alive"), first.output
        # its wait for the second is no part of the swarm's throughput: timing
        # starts at epoch 1, so the final line measures epochs 2 and 3 only
        assert "; swarm " not in epochs[0], epochs
        # a rate nobody has measured yet is left out, never shown as 0
        lines = [line for peer in (first, second) for line in peer.output]
        assert not any("compute 0 samples/s" in line for line in lines), lines
        (final,) = [line for line in first.output if line.startswith("finished at epoch")]
        assert " s/epoch over 2 epochs (" in final, final


@pytest.mark.slow
async def test_a_joiner_adopts_the_run_settings_or_is_refused(tmp_path: Path) -> None:
    task = throttled_task_file(tmp_path, 0.02)
    first_args = (
        "train", *FAST,
        "--matchmaking-time", "1",
        "--task", task,
        "--run-id", "settings-test",
        "--target-batch-size", "64",
        "--batch-size", "8",
        "--max-epochs", "3",
        "--precision", "bf16",
        "--wait-for-peers", "300",  # the refused joiners come and go first
    )  # fmt: skip
    async with run_cli(*first_args) as first:
        join = await _join_command(first)
        address = join.split("--initial-peer ", 1)[1].split()[0]
        joiner = ("train", "--host", "127.0.0.1", "--initial-peer", address)
        joiner += ("--run-id", "settings-test")
        conflicts = {
            ("--target-batch-size", "128"): "--target-batch-size 128 differs from run's 64",
            ("--precision", "fp32"): "--precision fp32 differs from run's bf16",
        }

        async def refused(option: tuple[str, ...], expected: str) -> None:
            result = await run_to_completion(*joiner, *option, timeout=90)
            lines = result.stderr.decode().strip().splitlines()
            assert result.returncode == 2, (option, lines)
            # one line says what to change (after the log of joining the DHT)
            errors = [line for line in lines if line.startswith("swarm train:")]
            assert errors == lines[-1:] and errors[0].startswith("swarm train: error:"), lines
            assert expected in errors[0] and not any("Traceback" in line for line in lines)

        async with trio.open_nursery() as nursery:
            for option, expected in conflicts.items():
                nursery.start_soon(refused, option, expected)

        # Naming nothing but the run: it trains the run's task, batch and end.
        async with run_cli(*joiner, "--threads", "1") as second:
            adopted = await second.read_line_containing("adopted the run's settings", timeout=60)
            for setting in (
                f"--task {task}",
                "--target-batch-size 64",
                "--matchmaking-time 1",
                "--max-epochs 3",
                "--precision bf16",
            ):
                assert setting in adopted, adopted
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_finishes, first, 3)
                nursery.start_soon(_finishes, second, 3)


async def test_the_first_trainer_behind_a_bootstrap_node_waits_for_others(tmp_path: Path) -> None:
    # It has an --initial-peer (the DHT node) but starts the run: nobody could
    # join its run if it trained its epochs alone at once.
    async with run_cli("dht", "--host", "127.0.0.1") as bootstrap:
        join = await bootstrap.read_line_containing("join with:", timeout=30)
        address = join.split("--initial-peer ", 1)[1].split()[0]
        train = ("train", *FAST, "--matchmaking-time", "1", "--initial-peer", address)
        train += ("--wait-for-peers", "120")
        async with run_cli(*train, "--task", throttled_task_file(tmp_path, 0.02)) as peer:
            waiting = await peer.read_line_containing("waiting up to", timeout=60)
            assert waiting.startswith("waiting up to 120 s for peers to join"), waiting
            assert await peer.stop() == 0
            assert (await peer.read_line_containing("stopped at")).startswith("stopped at epoch 0:")
        assert await bootstrap.stop() == 0
