"""``--config run.toml``: the file's values become defaults, flags override them."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from swarm import ConfigError
from swarm._config_file import config_path, option_defaults
from swarm._plot import plot_history
from swarm.cli import (
    DHT_REPORT_INTERVAL,
    STATUS_WATCH_INTERVAL,
    _collaborative_config,
    _parse_args,
    build_parser,
)
from trainer import PRECISIONS


def test_config_path_is_found_in_either_spelling_and_not_after_double_dash() -> None:
    assert config_path(["train", "--config", "a.toml"]) == "a.toml"
    assert config_path(["train", "--config=b.toml", "--lr", "1"]) == "b.toml"
    assert config_path(["train", "--", "--config", "c.toml"]) is None
    assert config_path(["train"]) is None


def test_every_kind_of_option_from_the_file_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text(
        'task = "digits"\n'
        "target_batch_size = 512\n"
        "matchmaking-time = 3\n"  # an integer for a float option is a number
        "client-mode = true\n"
        'initial-peer = ["10.0.0.1:4000", "10.0.0.2:4000"]\n'
        "lr = 0.01\n"
    )
    args = _parse_args(build_parser(), ["train", "--config", str(config), "--lr", "0.5"])
    assert args.task == "digits" and args.target_batch_size == 512
    assert args.matchmaking_time == 3.0 and isinstance(args.matchmaking_time, float)
    assert args.client_mode is True
    assert args.initial_peer == ["10.0.0.1:4000", "10.0.0.2:4000"]
    assert args.lr == 0.5  # the flag
    # a repeatable option's flags replace the file's list, as any flag replaces its value
    argv = ["train", "--config", str(config), "--initial-peer", "10.0.0.3:1", "--initial-peer=h:2"]
    assert _parse_args(build_parser(), argv).initial_peer == ["10.0.0.3:1", "h:2"]


def test_defaults_without_a_file_come_from_the_config_dataclasses() -> None:
    from averaging import MatchmakingConfig
    from trainer import CollaborativeConfig
    from trainer._loop import TrainingConfig

    args = _parse_args(build_parser(), ["train"])
    assert args.target_batch_size == TrainingConfig().target_batch_size
    # --min-peers depends on whether the peer starts the run (2) or joins it (1)
    assert args.min_peers is None
    assert args.wait_for_peers == TrainingConfig().min_peers_timeout
    assert args.eval_every == TrainingConfig().eval_every
    assert args.checkpoint_every == CollaborativeConfig().checkpoint_every
    assert args.matchmaking_time == MatchmakingConfig().matchmaking_time
    assert args.target_group_size == MatchmakingConfig().target_group_size
    assert args.lr is None and args.config is None
    # the precision names TrainingConfig's dtype; the averaging timeout's floor is
    # CollaborativeConfig's default, unless matchmaking needs longer
    assert PRECISIONS[args.precision] == TrainingConfig().dtype
    config = _collaborative_config(args)
    bound = config.averaging.matchmaking.bound
    assert config.averaging_timeout == max(CollaborativeConfig().averaging_timeout, 2 * bound)
    assert CollaborativeConfig().averaging_timeout > 2 * bound  # (so the floor is what counts)
    slow = _collaborative_config(_parse_args(build_parser(), ["train", "--matchmaking-time", "60"]))
    assert slow.averaging_timeout == 2 * slow.averaging.matchmaking.bound
    # swarm status counts a peer gone when its progress record would have expired
    status = _parse_args(build_parser(), ["status", "--initial-peer", "127.0.0.1:1"])
    assert status.stale_after == CollaborativeConfig().progress_ttl
    assert status.watch is None
    watching = ["status", "--initial-peer", "127.0.0.1:1", "--watch"]
    assert _parse_args(build_parser(), watching).watch == STATUS_WATCH_INTERVAL
    assert _parse_args(build_parser(), ["dht"]).report_interval == DHT_REPORT_INTERVAL
    plot = _parse_args(build_parser(), ["plot", "--history", "h", "--out", "o.png"])
    drawn = inspect.signature(plot_history).parameters
    assert (plot.width, plot.height) == (drawn["width"].default, drawn["height"].default)


def test_train_help_groups_the_options_and_shows_the_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trainer import CollaborativeConfig

    with pytest.raises(SystemExit) as exit_:
        _parse_args(build_parser(), ["train", "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    groups = [line for line in shown.splitlines() if line and not line.startswith(" ")]
    assert groups[-5:] == [
        "peer and network:",
        "the run (every peer of a run passes the same values):",
        "training (this peer):",
        "checkpointing:",
        "output:",
    ]
    floor = f"{CollaborativeConfig().averaging_timeout:g} and twice the matchmaking bound"
    assert floor in " ".join(shown.split())


def test_a_string_for_a_string_option_and_choices_are_checked() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["a", "b"])
    parser.add_argument("--name")
    assert option_defaults(parser, {"mode": "a", "name": "x"}, source="f") == {
        "mode": "a",
        "name": "x",
    }
    with pytest.raises(ConfigError, match="f: key 'mode' must be one of a, b, got 'c'"):
        option_defaults(parser, {"mode": "c"}, source="f")
    with pytest.raises(ConfigError, match="f: key 'name' must be a string, got 3"):
        option_defaults(parser, {"name": 3}, source="f")


def test_swarm_dht_takes_a_config_file_too(tmp_path: Path) -> None:
    config = tmp_path / "dht.toml"
    config.write_text('port = 31337\ninitial-peer = "10.0.0.1:31337"\nreport_interval = 5\n')
    args = _parse_args(build_parser(), ["dht", "--config", str(config), "--port", "4000"])
    assert (args.port, args.initial_peer, args.report_interval) == (4000, ["10.0.0.1:31337"], 5.0)


def test_no_auto_punch_turns_automatic_punching_off_from_a_flag_or_the_file(
    tmp_path: Path,
) -> None:
    from swarm.cli import _peer_config

    config = tmp_path / "run.toml"
    config.write_text("no-auto-punch = true\n")
    for argv, auto in [
        (["train", "--host", "127.0.0.1"], True),
        (["train", "--host", "127.0.0.1", "--no-auto-punch"], False),
        (["train", "--host", "127.0.0.1", "--config", str(config)], False),
    ]:
        assert _peer_config(_parse_args(build_parser(), argv)).punch.auto is auto, argv


def test_no_auto_pacing_turns_automatic_pacing_off_and_a_declared_rate_still_paces() -> None:
    from swarm.cli import _collaborative_config

    for argv, auto, pacing in [
        (["train"], True, None),
        (["train", "--no-auto-pacing"], False, None),
        (["train", "--no-auto-pacing", "--upload-rate", "8mbit"], False, 0.97e6),
    ]:
        config = _collaborative_config(_parse_args(build_parser(), argv)).averaging.allreduce
        assert (config.auto_pacing, config.upload_pacing) == (auto, pacing), argv
