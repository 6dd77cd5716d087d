"""``swarm demo`` (what ``make run`` runs): local peers train together, each line
shows its peer, failures propagate and every peer process is reaped."""

from __future__ import annotations

import contextlib
import os
import re
import signal

import pytest
from cli_harness import CLIProcess, run_cli


def _pids(demo: CLIProcess) -> dict[str, int]:
    found = (re.match(r"demo: started (peer\d+) \(pid (\d+)\)", line) for line in demo.output)
    return {m.group(1): int(m.group(2)) for m in found if m is not None}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill_leftovers(demo: CLIProcess) -> None:
    # Only if the demo failed to reap them (the test then fails anyway).
    for pid in _pids(demo).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
async def test_demo_peers_train_together_and_all_finish() -> None:
    async with run_cli("demo", "--peers", "3", "--max-epochs", "3") as demo:
        try:
            assert await demo.finish(timeout=180) == 0, demo.output
        finally:
            _kill_leftovers(demo)
    pids = _pids(demo)
    assert sorted(pids) == ["peer1", "peer2", "peer3"], demo.output
    assert all(_gone(pid) for pid in pids.values())
    for name in pids:
        lines = [line for line in demo.output if line.startswith(f"{name} | ")]
        # the peers wait for each other and all take the first global step
        assert any(line.startswith(f"{name} | epoch 1: train loss ") for line in lines), lines
        finished = [line for line in lines if "finished at epoch" in line]
        assert len(finished) == 1 and finished[0].startswith(
            f"{name} | finished at epoch 3: accuracy 0."
        ), lines
    # the others joined with the command the first printed, and waited for each other
    join = next(line for line in demo.output if line.startswith("peer1 | join with: "))
    assert " --max-epochs 3" in join, join
    # where each trains, in words a volunteer checks (the machine here has no GPU)
    trains = [line for line in demo.output if " | training task digits in run " in line]
    assert len(trains) == 3 and all(line.endswith(" on cpu in fp32") for line in trains), trains
    assert any(line.endswith("; 3 peers alive") for line in demo.output), demo.output
    assert demo.output[-1].startswith("demo: 3 peers finished, exit 0, in "), demo.output


async def test_demo_fails_when_a_peer_fails() -> None:
    async with run_cli("demo", "--peers", "2", "--task", "no-such-task") as demo:
        try:
            code = await demo.finish(timeout=90)
        finally:
            _kill_leftovers(demo)
    assert code == 2, demo.output
    # the first peer failed before printing a join command: nobody else started
    assert list(_pids(demo)) == ["peer1"], demo.output
    assert any("demo: peer1 failed (exit 2)" in line for line in demo.output), demo.output
    assert any(line.startswith("peer1 ! ") and "unknown task" in line for line in demo.output)
    assert all(_gone(pid) for pid in _pids(demo).values())


@pytest.mark.slow
async def test_ctrl_c_stops_and_reaps_every_peer() -> None:
    async with run_cli("demo", "--peers", "2", "--max-epochs", "100000") as demo:
        try:
            await demo.read_line_containing("peer2 | epoch 2:", timeout=150)
            demo.process.send_signal(signal.SIGINT)
            assert await demo.finish(timeout=60) == 0, demo.output
        finally:
            _kill_leftovers(demo)
    pids = _pids(demo)
    assert sorted(pids) == ["peer1", "peer2"] and all(_gone(pid) for pid in pids.values())
    for name in pids:
        assert any(line.startswith(f"{name} | stopped at epoch ") for line in demo.output)
    assert demo.output[-1].startswith("demo: 2 peers stopped, exit 0, in "), demo.output
