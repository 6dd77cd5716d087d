"""``swarm train`` and ``swarm status`` as a user runs them: real processes on 127.0.0.1.

The peers train a throttled copy of the built-in digits task (a task file, so
``--task FILE.py:FACTORY`` is exercised too): unthrottled, the first peer would
finish all its epochs alone before the others have imported torch.
"""

from __future__ import annotations

import argparse
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from cli_harness import (
    CLIProcess,
    free_udp_port,
    run_cli,
    run_to_completion,
    throttled_task_file,
)

from swarm import ConfigError

FAST = (
    "--host", "127.0.0.1",
    "--threads", "1",
    "--matchmaking-time", "1",
    "--averaging-timeout", "6",
)  # fmt: skip


async def _join_address(peer: CLIProcess) -> str:
    line = await peer.read_line_containing("join with:", timeout=40)
    address = line.split("--initial-peer", 1)[1].split()[0]
    assert address.startswith("127.0.0.1:"), line
    return address


async def _status(address: str, run_id: str) -> dict[str, Any]:
    result = await run_to_completion(
        "status", "--initial-peer", address, "--run-id", run_id, "--json", timeout=40
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().strip().splitlines()
    assert len(lines) == 1, lines
    status: dict[str, Any] = json.loads(lines[0])
    return status


async def test_three_peers_train_and_status_shows_them(tmp_path: Path) -> None:
    # 8 samples per 0.1 s: alone, an epoch of 600 samples takes 7.5 s; together ~3.5 s.
    train = (
        "train", *FAST,
        "--task", throttled_task_file(tmp_path, 0.1),
        "--run-id", "cli-test",
        "--target-batch-size", "600",
        "--batch-size", "8",
        "--max-epochs", "5",
        "--eval-every", "1",
    )  # fmt: skip
    async with run_cli(*train) as first:
        address = await _join_address(first)
        join = f"train --initial-peer {address} --run-id cli-test --host 127.0.0.1 --task "
        assert f" {join}" in first.output[-1], first.output
        assert first.output[-1].endswith(" --max-epochs 5"), first.output
        waiting = await first.read_line_containing("waiting up to", timeout=5)
        assert waiting.startswith("waiting up to 60 s for peers to join"), waiting
        async with (
            run_cli(*train, "--initial-peer", address) as second,
            run_cli(*train, "--initial-peer", address) as third,
        ):
            peers = (first, second, third)
            for peer in peers[1:]:
                await _join_address(peer)
            peer_ids = {peer.output[0].split()[1] for peer in peers}  # "peer <id> listening on"

            seen_three = False
            epochs: list[int] = []
            for _ in range(8):
                status = await _status(address, "cli-test")
                assert status["run_id"] == "cli-test"
                epochs.append(status["epoch"])
                if len(status["peers"]) == 3:
                    seen_three = True
                    assert {p["peer_id"] for p in status["peers"]} == peer_ids
                    for peer_status in status["peers"]:
                        assert peer_status["epoch"] <= status["epoch"]
                        assert peer_status["samples_per_second"] >= 0
                        rate = peer_status["compute_samples_per_second"]
                        assert rate == peer_status["samples_per_second"]
                        assert peer_status["train_loss"] == peer_status["loss"]
                        accuracy = peer_status["accuracy"]
                        assert accuracy is None or 0 <= accuracy <= 1
                        assert "loss" in peer_status
                        assert peer_status["device"] == "cpu fp32"  # the default
                    # the run's settings, and its real throughput since it began
                    assert status["settings"]["target_batch_size"] == 600
                    assert status["settings"]["max_epochs"] == 5
                    if status["epoch"] > 0:
                        expected = status["epoch"] * 600 / status["seconds_since_start"]
                        assert status["samples_per_second"] == pytest.approx(expected, rel=0.01)
                if seen_three and epochs[-1] > epochs[0]:
                    break
            assert seen_three, epochs
            assert epochs[-1] > epochs[0], epochs

            async def finishes(peer: CLIProcess) -> None:
                line = await peer.read_line_containing("finished at epoch", timeout=60)
                assert line.startswith("finished at epoch 5: accuracy 0."), line
                assert ", eval loss " in line and ", train loss " in line, line
                with trio.fail_after(20):
                    assert await peer.process.wait() == 0

            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(finishes, peer)


async def test_sigterm_mid_run_leaves_cleanly(tmp_path: Path) -> None:
    train = (
        "train", *FAST,
        "--wait-for-peers", "0",
        "--task", throttled_task_file(tmp_path, 0.02),
        "--target-batch-size", "32",
        "--batch-size", "8",
    )  # fmt: skip
    async with run_cli(*train) as peer:
        await peer.read_line_containing("epoch 2:", timeout=40)
        assert await peer.stop(signal.SIGTERM) == 0
        assert any(line.startswith("epoch ") for line in peer.output)
        line = await peer.read_line_containing("stopped at epoch", timeout=5)
        assert "accuracy" in line


async def test_sigterm_while_waiting_for_min_peers_leaves_at_once(tmp_path: Path) -> None:
    # Regression (chaos soak): the --min-peers wait slept through SIGTERM for up
    # to its whole minute (TrainingConfig.min_peers_timeout).
    train = ("train", *FAST, "--task", throttled_task_file(tmp_path, 0.02), "--min-peers", "3")
    async with run_cli(*train) as peer:
        await _join_address(peer)
        assert await peer.stop(signal.SIGTERM, timeout=30) == 0  # well within the minute
        line = await peer.read_line_containing("stopped at epoch 0", timeout=5)
        assert "accuracy" in line


async def test_bad_configuration_exits_2_with_one_line(tmp_path: Path) -> None:
    nobody = f"127.0.0.1:{await free_udp_port()}"
    cases = {
        ("train", "--task", "no-such-task"): "unknown task",
        ("train", "--target-batch-size", "0"): "--target-batch-size",
        ("train", "--offload-optimizer", "--diloco", "4"): "offload_optimizer",
        ("train", "--initial-peer", nobody): "no initial peer answered",
        ("status", "--initial-peer", nobody): "no initial peer answered",
        ("status", "--initial-peer", "nonsense"): "HOST:PORT",
        ("train", "--upload-rate", "20mbps"): "--upload-rate",
    }

    async def check(args: tuple[str, ...], expected: str) -> None:
        result = await run_to_completion(*args, "--host", "127.0.0.1", timeout=90)
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 2, (args, lines)
        assert len(lines) == 1 and lines[0].startswith(f"swarm {args[0]}: error:"), lines
        assert expected in lines[0], lines

    async with trio.open_nursery() as nursery:
        for args, expected in cases.items():
            nursery.start_soon(check, args, expected)


def test_diloco_and_drop_compute_options() -> None:
    from swarm.cli import _check_train_args, _collaborative_config, _join_command, build_parser
    from trainer import DiLoCo, DropCompute

    def parse(*argv: str) -> argparse.Namespace:
        args = build_parser().parse_args(["train", *argv])
        _check_train_args(args)
        return args

    config = _collaborative_config(parse("--diloco", "10", "--drop-compute", "auto"))
    assert config.diloco == DiLoCo(local_steps=10)
    assert config.drop_compute == DropCompute()
    config = _collaborative_config(parse("--drop-compute", "2.5"))
    assert config.diloco is None and config.drop_compute == DropCompute(threshold=2.5)
    # every peer of a run must use DiLoCo alike: the join command says so
    assert "--diloco 10" in _join_command(parse("--diloco", "10"), "127.0.0.1:1", "run")
    # --lossy: gradients over the lossy data plane, a run setting like DiLoCo
    assert _collaborative_config(parse("--lossy")).lossy
    assert not _collaborative_config(parse()).lossy
    assert _join_command(parse("--lossy"), "127.0.0.1:1", "run").endswith(" --lossy")
    with pytest.raises(ConfigError, match="lossy"):
        _collaborative_config(parse("--lossy", "--diloco", "4"))
    # --ring: the pipelined ring where a group allows it, a run setting too
    assert _collaborative_config(parse("--ring")).averaging.allreduce.ring
    assert not _collaborative_config(parse()).averaging.allreduce.ring
    assert _join_command(parse("--ring"), "127.0.0.1:1", "run").endswith(" --ring")
    both = _join_command(parse("--lossy", "--ring"), "127.0.0.1:1", "run")
    assert both.endswith(" --lossy --ring")
    for argv, expected in [
        (("--diloco", "0"), "--diloco"),
        (("--drop-compute", "soon"), "--drop-compute"),
        (("--drop-compute", "-1"), "DropCompute threshold"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            _collaborative_config(parse(*argv))


def test_link_rates_in_bits_or_bytes_come_out_in_bytes_per_second() -> None:
    from swarm._link_rate import parse_link_rate

    for text, rate in [
        ("20mbit", 2.5e6),
        ("100Mbit", 12.5e6),
        (" 1.5gbit/s ", 187.5e6),
        ("800kbit", 1e5),
        ("2.5MB/s", 2.5e6),
        ("500KB/s", 5e5),
        ("300 kB/s", 3e5),
        ("1e3B/s", 1e3),
    ]:
        assert parse_link_rate(text) == pytest.approx(rate), text
    # read both ways by people (a factor of 8 apart), or no rate at all: refused
    for bad in ("", "20", "fast", "20mbps", "20Mb/s", "2MBps", "20 mb/s", "mbit", "-5mbit"):
        with pytest.raises(ConfigError, match="such as 20mbit"):
            parse_link_rate(bad)
    for bad in ("0mbit", "0.0MB/s", "1e999mbit"):
        with pytest.raises(ConfigError, match="positive and finite"):
            parse_link_rate(bad)


def test_upload_rate_declares_the_upload_and_paces_the_allreduce_under_it() -> None:
    from averaging._averager import UPLOAD_PACING_SHARE
    from swarm.cli import _check_train_args, _collaborative_config, _join_command, build_parser

    def parse(*argv: str) -> argparse.Namespace:
        args = build_parser().parse_args(["train", *argv])
        _check_train_args(args)
        return args

    def config(*argv: str) -> Any:
        return _collaborative_config(parse(*argv))

    averaging = config("--upload-rate", "20mbit").averaging
    assert averaging.upload_rate == 2.5e6
    # the pacing counts IP packets, the link its frames too: a little under
    assert averaging.allreduce.upload_pacing == UPLOAD_PACING_SHARE * 2.5e6 < 2.5e6
    assert averaging.bandwidth is None
    assert config("--upload-rate", "2.5MB/s").averaging == averaging  # the same, in bytes
    # a local setting (peers' links differ), not a run setting the join command carries
    join = _join_command(parse("--upload-rate", "20mbit"), "127.0.0.1:1", "run")
    assert "--upload-rate" not in join
    unset = config().averaging
    assert unset.upload_rate is None and unset.allreduce.upload_pacing is None
    for bad in ("20mbps", "0mbit", "lots"):
        with pytest.raises(ConfigError, match="--upload-rate"):
            config("--upload-rate", bad)
