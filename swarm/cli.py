"""The ``swarm`` command: ``swarm dht``, ``swarm train``, ``swarm status``,
``swarm demo`` and ``swarm keygen``.

Configuration is read once, here, into the frozen config dataclasses of the
layers below; nothing underneath reads the environment or the command line.

Exit codes: 0 done, 1 runtime failure, 2 bad usage or bad configuration (with a
one-line message that says what to change).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import trio

from ._address import parse_address
from ._announce import announce_host, is_wildcard
from ._errors import (
    BootstrapError,
    ConfigError,
    PeerCrashedError,
    SwarmError,
    collapse_exception_groups,
)
from ._identity import Identity
from ._link_rate import parse_link_rate
from ._stdout import say
from ._throughput import Throughput, ThroughputMeter

if TYPE_CHECKING:
    from averaging import MatchmakingConfig
    from trainer import (
        CollaborativeConfig,
        CollaborativeOptimizer,
        DropCompute,
        PeerProgress,
        SwarmProgress,
        Task,
    )
    from trainer._loop import TrainingConfig, TrainingReport

    from ._dashboard import Dashboard, Display
    from ._peer import Peer, PeerConfig
    from ._run_settings import RunSettings

log = logging.getLogger("swarm")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: The task ``swarm train`` trains when given no ``--task``.
DEFAULT_TASK = "digits"
#: Seconds between the routing and storage reports of ``swarm dht`` in the log.
DHT_REPORT_INTERVAL = 60.0
#: Seconds between the tables of ``swarm status --watch`` given no number.
STATUS_WATCH_INTERVAL = 2.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_peer_options(parser: argparse.ArgumentParser | _Group, *, verbose: bool = True) -> None:
    parser.add_argument(
        "--host", default="0.0.0.0", help="address to listen on (default %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_peer_defaults().port,
        help="UDP+TCP port (default: any free port)",
    )
    parser.add_argument(
        "--initial-peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a peer already in the swarm (repeat for several)",
    )
    parser.add_argument("--identity", metavar="PATH", help="key file, created 0600 if missing")
    _add_swarm_key_option(parser)
    parser.add_argument(
        "--announce", metavar="HOST:PORT", help="address others should dial, if not --host:--port"
    )
    if verbose:
        parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _add_swarm_key_option(parser: argparse.ArgumentParser | _Group) -> None:
    parser.add_argument(
        "--swarm-key",
        metavar="FILE",
        help="join a private swarm: its pre-shared key file, made by swarm keygen (mode 0600)",
    )


def _swarm_key(args: argparse.Namespace) -> bytes | None:
    """The key of ``--swarm-key``, if given; ``ConfigError`` if the file is
    missing, readable by others or not a key."""
    if args.swarm_key is None:
        return None
    from ._swarm_key import load_swarm_key

    return load_swarm_key(args.swarm_key)


def _swarm_key_option(args: argparse.Namespace) -> str:
    """`` --swarm-key FILE`` for a join command, when this peer has one."""
    return "" if args.swarm_key is None else f" --swarm-key {args.swarm_key}"


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``swarm train``, in the groups ``--help`` shows. Their
    defaults are read from the config dataclasses (``_TrainDefaults``), so a
    default is stated once; this imports the trainer, so it runs only when
    ``train`` is the command (``_LazySubParsers``)."""
    from trainer import PRECISIONS

    d = _TrainDefaults.read()
    network = parser.add_argument_group("peer and network")
    _add_peer_options(network, verbose=False)
    network.add_argument(
        "--client-mode",
        action="store_true",
        help="accept no incoming connections (behind NAT); still trains and averages",
    )
    network.add_argument(
        "--upload-rate",
        metavar="RATE",
        help="this peer's upload, e.g. 20mbit or 2.5MB/s: parts of the average follow it "
        "instead of the measured rate, and the all-reduce paces its streams to 97%% of it "
        "so that they share the link without queueing (default: measured, and paced at "
        "the measured rate where unpaced rounds queued at the link)",
    )
    network.add_argument(
        "--no-auto-pacing",
        action="store_true",
        help="without --upload-rate, do not pace the all-reduce at the measured upload",
    )
    network.add_argument(
        "--no-auto-punch",
        action="store_true",
        help="never punch a direct connection through NATs to a peer reached through a relay",
    )
    run = parser.add_argument_group("the run (every peer of a run passes the same values)")
    run.add_argument(
        "--task",
        default=DEFAULT_TASK,
        metavar="NAME|FILE.py:FACTORY",
        help=f"built-in task name or a file and the function returning a Task "
        f"(default {DEFAULT_TASK})",
    )
    run.add_argument("--run-id", metavar="ID", help="name of the run (default: the task's name)")
    run.add_argument(
        "--target-batch-size",
        type=int,
        default=d.training.target_batch_size,
        metavar="N",
        help="samples the whole swarm processes per global step (default %(default)s)",
    )
    run.add_argument(
        "--matchmaking-time",
        type=float,
        default=d.matchmaking.matchmaking_time,
        metavar="SECONDS",
        help="how long a group leader gathers peers to average with (default %(default)g)",
    )
    run.add_argument(
        "--target-group-size",
        type=int,
        default=d.matchmaking.target_group_size,
        metavar="N",
        help="peers per averaging group (Moshpit; default %(default)s)",
    )
    run.add_argument(
        "--diloco",
        type=int,
        metavar="H",
        help="DiLoCo: H local steps per peer, then an outer step on the averaged "
        "pseudo-gradients (float16); for slow links (default: off)",
    )
    run.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default=next(name for name, dtype in PRECISIONS.items() if dtype == d.training.dtype),
        help="the model's precision: fp32, or bf16/fp16 parameters with float32 master "
        "weights and float32 averaging (default %(default)s)",
    )
    run.add_argument(
        "--lossy",
        action="store_true",
        help="average gradients over the lossy data plane: paced, authenticated UDP "
        "datagrams that are never retransmitted, for lossy or long links; parameters are "
        "re-synchronised the same way at a period set by the measured loss (default: off)",
    )
    run.add_argument(
        "--ring",
        action="store_true",
        help="average over a pipelined ring (one TCP flow per link) where a group's links "
        "are alike, else the butterfly; for links of equal speed (default: off)",
    )
    training = parser.add_argument_group("training (this peer)")
    training.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda[:N]|mps",
        help="where the model trains; auto: CUDA when present, else MPS, else the CPU "
        "(default %(default)s)",
    )
    training.add_argument(
        "--batch-size", type=int, metavar="N", help="samples per local step (default: the task's)"
    )
    training.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep float32 master weights and the optimizer's state in host memory and step "
        "there once per global step: the device holds the model, its gradients and "
        "activations only (not with --diloco; default: off)",
    )
    training.add_argument(
        "--lr",
        type=float,
        metavar="RATE",
        help="learning rate of the inner optimizer (default: the task's)",
    )
    training.add_argument(
        "--max-epochs", type=int, metavar="N", help="leave after this global step (default: never)"
    )
    training.add_argument(
        "--averaging-timeout",
        type=float,
        metavar="SECONDS",
        help="longest wait for one averaging round (default: the larger of "
        f"{d.optimizer.averaging_timeout:g} and twice the matchmaking bound)",
    )
    training.add_argument(
        "--min-peers",
        type=int,
        metavar="N",
        help="wait (up to --wait-for-peers) until N peers are in the run before training "
        "(default: 2 for the peer that starts a run, 1 for one that joins)",
    )
    training.add_argument(
        "--wait-for-peers",
        type=float,
        default=d.training.min_peers_timeout,
        metavar="SECONDS",
        help="longest wait for --min-peers before training anyway (0: no wait; "
        "default %(default)g)",
    )
    training.add_argument(
        "--eval-every",
        type=int,
        default=d.training.eval_every,
        metavar="N",
        help="evaluate every N epochs (0: only at the end; default %(default)s)",
    )
    training.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="seed of this peer's data order (default: derived from the peer id)",
    )
    training.add_argument(
        "--threads", type=int, metavar="N", help="torch CPU threads (default: torch's choice)"
    )
    training.add_argument(
        "--drop-compute",
        metavar="SECONDS|auto",
        help="DropCompute: stop computing after SECONDS per global step and average what "
        "this peer has; 'auto' chooses it from the first steps (default: off)",
    )
    checkpoints = parser.add_argument_group("checkpointing")
    checkpoints.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save and resume checkpoints here"
    )
    checkpoints.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.optimizer.checkpoint_every,
        metavar="N",
        help="epochs between checkpoints (default %(default)s)",
    )
    checkpoints.add_argument(
        "--restart-from-scratch",
        action="store_true",
        help="when every checkpoint in --checkpoint-dir is damaged, set them aside and start "
        "anew (without it the peer refuses to start)",
    )
    output = parser.add_argument_group("output")
    output.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _add_config_option(output)
    _add_output_options(output)


@dataclass(frozen=True)
class _TrainDefaults:
    """The config dataclasses whose defaults are ``swarm train``'s defaults."""

    training: TrainingConfig
    optimizer: CollaborativeConfig
    matchmaking: MatchmakingConfig

    @classmethod
    def read(cls) -> _TrainDefaults:
        from averaging import MatchmakingConfig
        from trainer import CollaborativeConfig
        from trainer._loop import TrainingConfig

        return cls(TrainingConfig(), CollaborativeConfig(), MatchmakingConfig())


def _peer_defaults() -> PeerConfig:
    from ._peer import PeerConfig

    return PeerConfig()


if TYPE_CHECKING:
    _SubParsersAction = argparse._SubParsersAction[argparse.ArgumentParser]
else:  # not subscriptable at run time
    _SubParsersAction = argparse._SubParsersAction


class _LazySubParsers(_SubParsersAction):
    """Subcommands whose options are added only when the command is chosen:
    ``swarm train``'s defaults come from the trainer's dataclasses, and
    ``swarm dht`` should not pay for importing torch to read them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def add_lazily(
        self, name: str, add_options: Callable[[argparse.ArgumentParser], None], **kwargs: Any
    ) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self.add_parser(name, **kwargs)
        self._pending[name] = add_options
        return parser

    def command(self, name: str) -> argparse.ArgumentParser | None:
        """The parser of command ``name`` with all its options, or None."""
        add_options = self._pending.pop(name, None)
        parser = self.choices.get(name)
        if add_options is not None and parser is not None:
            add_options(parser)
        return parser

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self.command(values[0])
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="swarm", description="Train one model on many unreliable machines.")
    commands: _LazySubParsers = parser.add_subparsers(  # type: ignore[assignment]
        dest="command", required=True, parser_class=_Parser, action=_LazySubParsers
    )
    dht = commands.add_parser("dht", help="run a DHT-only peer (e.g. a long-lived bootstrap node)")
    _add_peer_options(dht)
    dht.add_argument(
        "--report-interval",
        type=float,
        default=DHT_REPORT_INTERVAL,
        metavar="SECONDS",
        help="seconds between routing/storage reports in the log (default %(default)g)",
    )
    _add_config_option(dht)
    commands.add_lazily(
        "train",
        _add_train_options,
        help="train with a swarm (starts a new one without --initial-peer)",
        description="Train a task with the swarm. Without --initial-peer this peer starts a "
        "new swarm and prints the command other machines run to join it. "
        "Ctrl-C or SIGTERM leaves after the current step.",
    )
    commands.add_lazily(
        "status", _add_status_options, help="show who is training in a run and how far it has got"
    )
    _add_demo_parser(commands)
    keygen = commands.add_parser(
        "keygen",
        help="create the key file of a new private swarm",
        description="Create a new random swarm key in FILE (mode 0600; an existing file is "
        "never overwritten). Copy it to every machine of the swarm over a channel you trust "
        "and pass --swarm-key FILE to swarm dht, train and status.",
    )
    keygen.add_argument("--swarm-key", required=True, metavar="FILE", help="file to create")
    keygen.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _add_export_command(commands)
    _add_plot_command(commands)
    return parser


def _add_status_options(status: argparse.ArgumentParser) -> None:
    """The options of ``swarm status``; ``--stale-after`` defaults to the
    trainer's progress TTL, so this imports the trainer (``_LazySubParsers``)."""
    from trainer import CollaborativeConfig

    status.add_argument(
        "--initial-peer",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="any peer of the swarm (repeat for several)",
    )
    status.add_argument(
        "--run-id", default=DEFAULT_TASK, metavar="ID", help="default %(default)s"
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--host", help="address to listen on (default: 127.0.0.1 for loopback peers, else 0.0.0.0)"
    )
    status.add_argument(
        "--stale-after",
        type=float,
        default=CollaborativeConfig().progress_ttl,
        metavar="SECONDS",
        help="peers silent this long count as gone (default %(default)g: the run's progress "
        "records live that long)",
    )
    _add_swarm_key_option(status)
    status.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _add_status_watch_options(status)


def _add_demo_parser(commands: Any) -> None:
    from ._demo import DemoConfig

    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo",
        help="start a demo swarm: several local peers train together on 127.0.0.1",
        description="Start a demo swarm on this machine: the first peer starts a run, the "
        "others join it with the command it prints, all train together and the demo exits "
        "0 when every peer has finished (non-zero if one fails). Each line shows its peer. "
        "Ctrl-C stops every peer.",
    )
    demo.add_argument(
        "--peers",
        type=int,
        default=defaults.peers,
        metavar="N",
        help=f"peers to start, one process each (default {defaults.peers})",
    )
    demo.add_argument(
        "--max-epochs",
        type=int,
        default=defaults.max_epochs,
        metavar="N",
        help=f"global steps to train (default {defaults.max_epochs})",
    )
    demo.add_argument(
        "--task",
        default=defaults.task,
        metavar="NAME|FILE.py:FACTORY",
        help=f"the task every peer trains (default {defaults.task})",
    )
    demo.add_argument(
        "--matchmaking-time",
        type=float,
        default=defaults.matchmaking_time,
        metavar="SECONDS",
        help=f"as for swarm train (default {defaults.matchmaking_time:g}: peers on one machine)",
    )
    demo.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        for noisy in ("kademlia", "rpcudp", "asyncio", "trio_asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _is_wildcard(host: str) -> bool:
    return is_wildcard(host)


def _announce_host(host: str, toward: str | None = None) -> str:
    """The host others should dial (``swarm._announce``: never loopback to peers
    that are not on this machine). Raises ``ConfigError`` saying to pass
    ``--announce`` when this machine has no address another could dial."""
    return announce_host(host, toward)


def _first_initial_host(initial_peers: Sequence[str]) -> str | None:
    return parse_address(initial_peers[0])[0] if initial_peers else None


# -- swarm dht ------------------------------------------------------------------------


async def _run_dht(args: argparse.Namespace) -> int:
    from dht import DHTConfig, open_dht_node

    from ._bans import BanList

    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    initial = [parse_address(a) for a in args.initial_peer]
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is outside 0-65535")
    config = DHTConfig(swarm_key=_swarm_key(args))
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_dht_node(
            identity,
            host=args.host,
            port=args.port,
            initial_peers=initial,
            config=config,
            bans=BanList(clock=trio.current_time),
        ) as node:
            toward = _first_initial_host(args.initial_peer)
            announce = args.announce or f"{_announce_host(args.host, toward)}:{node.port}"
            say(f"peer {node.peer_id} listening on {args.host}:{node.port}")
            say(
                f"join with: {_swarm_command()} dht --initial-peer {announce}"
                f"{_swarm_key_option(args)}"
            )
            async with trio.open_nursery() as nursery:

                async def report() -> None:
                    while True:
                        await trio.sleep(args.report_interval)
                        log.info(
                            "routing table: %d peers; storing %d keys",
                            node.routing_table_size(),
                            node.stored_key_count(),
                        )

                nursery.start_soon(report)
                async for signum in signals:
                    log.info("received %s, leaving", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
    return EXIT_OK


# -- swarm train ----------------------------------------------------------------------


def _collaborative_config(args: argparse.Namespace) -> CollaborativeConfig:
    from averaging import AllReduceConfig, AveragerConfig, MatchmakingConfig
    from trainer import CollaborativeConfig, DiLoCo

    defaults = MatchmakingConfig()
    if not (math.isfinite(args.matchmaking_time) and args.matchmaking_time > 0):
        raise ConfigError(f"--matchmaking-time {args.matchmaking_time} must be positive")
    matchmaking = MatchmakingConfig(
        target_group_size=args.target_group_size,
        min_group_size=min(defaults.min_group_size, args.target_group_size),
        matchmaking_time=args.matchmaking_time,
        request_timeout=defaults.request_timeout,
        # a peer must look for a leader several times within one matchmaking window
        poll_interval=min(defaults.poll_interval, args.matchmaking_time / 4),
    )
    timeout = args.averaging_timeout
    if timeout is None:
        timeout = max(CollaborativeConfig().averaging_timeout, 2 * matchmaking.bound)
    elif not timeout > matchmaking.bound:
        raise ConfigError(
            f"--averaging-timeout {timeout:g} must exceed --matchmaking-time plus two "
            f"request timeouts ({matchmaking.bound:g}s), or no group can form"
        )
    allreduce = AllReduceConfig(ring=args.ring, auto_pacing=not args.no_auto_pacing)
    averaging = AveragerConfig(matchmaking=matchmaking, allreduce=allreduce)
    if args.upload_rate is not None:
        averaging = averaging.with_upload_rate(_upload_rate(args.upload_rate))
    return CollaborativeConfig(
        averaging=averaging,
        averaging_timeout=timeout,
        checkpoint_every=args.checkpoint_every,
        diloco=None if args.diloco is None else DiLoCo(local_steps=args.diloco),
        drop_compute=_drop_compute(args.drop_compute),
        lossy=args.lossy,
        offload_optimizer=args.offload_optimizer,
    )


def _upload_rate(value: str) -> float:
    try:
        return parse_link_rate(value)
    except ConfigError as e:
        raise ConfigError(f"--upload-rate: {e}") from None


def _drop_compute(value: str | None) -> DropCompute | None:
    from trainer import DropCompute

    if value is None:
        return None
    if value == "auto":
        return DropCompute()
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(
            f"--drop-compute {value!r} must be a number of seconds or 'auto'"
        ) from None
    return DropCompute(threshold=seconds)


def _check_train_args(args: argparse.Namespace) -> None:
    names = ("target_batch_size", "batch_size", "max_epochs", "threads", "checkpoint_every")
    for name in (*names, "diloco", "min_peers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.eval_every < 0:
        raise ConfigError(f"--eval-every must be 0 or more, got {args.eval_every}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is outside 0-65535")
    if not (math.isfinite(args.wait_for_peers) and args.wait_for_peers >= 0):
        raise ConfigError(f"--wait-for-peers must be 0 or more seconds, got {args.wait_for_peers}")


def _startup_checks(args: argparse.Namespace) -> None:
    """What can fail at start is checked before the peer starts: ``ConfigError``
    (exit 2, one line) for a device this machine does not have, a checkpoint
    directory that cannot be written or holds only damaged checkpoints, and for
    a port that is taken."""
    from trainer import resolve_device

    from ._startup_checks import (
        check_checkpoints_loadable,
        check_port_free,
        check_writable_directory,
    )

    resolve_device(args.device)
    if args.checkpoint_dir is not None:
        directory = Path(args.checkpoint_dir)
        check_writable_directory(directory)
        check_checkpoints_loadable(directory, restart_from_scratch=args.restart_from_scratch)
    check_port_free(args.host, args.port)


def _free_port(host: str) -> int:
    """A port number free for both TCP and UDP on ``host`` right now."""
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port: int = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
                return port
    raise ConfigError(f"cannot find a free port on {host}: pass --port")


def _peer_config(args: argparse.Namespace) -> PeerConfig:
    from ._peer import PeerConfig
    from ._punch import PunchConfig

    port = args.port
    if args.announce is None and _is_wildcard(args.host):
        # Others cannot dial 0.0.0.0: the peer announces this machine's address
        # (``_announce``), checked by asking peers to dial it back
        # (``_reachability``); fail now, with the usual message, if it has none.
        if port == 0:
            port = _free_port(args.host)
        _announce_host(args.host, _first_initial_host(args.initial_peer))
    return PeerConfig(
        host=args.host,
        port=port,
        initial_peers=tuple(args.initial_peer),
        announce=args.announce,
        client_mode=args.client_mode,
        swarm_key=_swarm_key(args),
        punch=PunchConfig(auto=not args.no_auto_punch),
    )


def _swarm_command() -> str:
    """How the ``swarm`` command is typed on this machine: ``swarm`` when that
    name on PATH is this installation, else the path of this installation's
    script (relative to the working directory when inside it, e.g.
    ``.venv/bin/swarm``), else ``python -m swarm.cli``. Printed commands use it
    so that they work as printed."""
    invoked = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    script = invoked if invoked is not None and invoked.name == "swarm" else None
    if script is None or not script.is_file():
        script = Path(sys.executable).parent / "swarm"
    if script.is_file():
        on_path = shutil.which("swarm")
        if on_path is not None and Path(on_path).resolve() == script.resolve():
            return "swarm"
        shown = os.path.relpath(script.absolute())
        if shown.startswith(".."):
            shown = str(script.absolute())
        elif "/" not in shown:
            shown = f"./{shown}"
        return shlex.quote(shown)
    return f"{shlex.quote(sys.executable)} -m swarm.cli"


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def _join_address(peer: Peer) -> str:
    """The address others join through: this peer's, unless others found they
    cannot reach it (``_reachability``); then the initial peer it joined by."""
    from ._reachability import Reachability

    reachability = peer.async_peer.reachability
    if reachability is Reachability.UNREACHABLE and peer.async_peer.config.initial_peers:
        say(
            f"reachability: other peers cannot dial this one at {peer.address} (behind a "
            "NAT or a firewall): others reach it through a relay (a peer they can dial), "
            "and join through its initial peer"
        )
        return peer.async_peer.config.initial_peers[0]
    if reachability is Reachability.REACHABLE:
        say(f"reachability: other peers reach this one at {peer.address}")
    return peer.address


def _device_words(device: str) -> str:
    """``device`` as a person checks it: a GPU by its index and its name."""
    import torch

    where = torch.device(device)
    if where.type == "cuda":
        return f"{where} ({torch.cuda.get_device_name(where)})"
    return str(where)


def _join_command(args: argparse.Namespace, address: str, run_id: str) -> str:
    """The command another machine runs to join this run: it names every run
    setting that differs from the default (the joiner would adopt them from the
    run anyway, see ``_run_settings``) and the run's end. A peer listening on
    loopback can only be joined from this machine, so the joiner listens there too."""
    parts = ["train", "--initial-peer", address, "--run-id", run_id]
    if _is_loopback(args.host):
        parts += ["--host", args.host]
    if args.swarm_key is not None:
        parts += ["--swarm-key", args.swarm_key]
    if args.task != DEFAULT_TASK:
        parts += ["--task", args.task]
    defaults = build_parser().parse_args(["train"])
    for option in (
        "target_batch_size",
        "matchmaking_time",
        "target_group_size",
        "diloco",
        "max_epochs",
    ):
        value = getattr(args, option)
        if value is not None and value != getattr(defaults, option):
            parts += [
                f"--{option.replace('_', '-')}",
                f"{value:g}" if isinstance(value, float) else str(value),
            ]
    parts += [flag for flag in ("--lossy", "--ring") if getattr(args, flag[2:])]
    return f"{_swarm_command()} {shlex.join(parts)}"


def _peers(count: int) -> str:
    return f"{count} peer" if count == 1 else f"{count} peers"


def _format_metric(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _eval_metrics(metrics: dict[str, float]) -> list[str]:
    """A peer's evaluation metrics, accuracy first; the evaluation's loss is
    ``eval loss``, never plain ``loss`` (that name is the training loss's)."""
    shown = []
    for name in sorted(metrics, key=lambda n: (n != "accuracy", n)):
        label = "eval loss" if name == "loss" else name
        spec = ".3f" if name == "accuracy" else ".4f"
        shown.append(f"{label} {metrics[name]:{spec}}")
    return shown


class _EpochReporter:
    """Prints one line per global step on stdout (diagnostics go to the log on
    stderr) and measures the swarm's real throughput (``ThroughputMeter``): the
    first line has none yet, since one epoch gives no interval to measure."""

    def __init__(
        self,
        target_batch_size: int,
        *,
        diloco: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.meter = ThroughputMeter(target_batch_size)
        #: DiLoCo: an epoch is every peer's local steps, not the target batch,
        #: so samples per epoch are unknown here and only s/epoch is shown
        self._diloco = diloco
        self._clock = clock
        #: the training loss at the last epoch line (None: no epoch yet)
        self.train_loss: float | None = None

    def __call__(self, opt: CollaborativeOptimizer, report: TrainingReport) -> None:
        self.meter.observe(opt.epoch, self._clock())
        swarm = opt.swarm_progress()
        self.train_loss = opt.loss
        parts = [f"train loss {_format_metric(opt.loss)}", *_eval_metrics(report.metrics)]
        line = f"epoch {opt.epoch}: " + ", ".join(parts)
        throughput = self.meter.recent()
        if throughput is not None:
            line += f"; swarm {self._rate(throughput)}{throughput.seconds_per_epoch:.2f} s/epoch"
        if swarm.samples_per_second > 0:  # 0: no peer has measured its rate yet
            line += f"; compute {swarm.samples_per_second:.0f} samples/s"
        line += f"; {_peers(swarm.num_peers)} alive"
        say(line)

    def final_line(self, how: str, report: TrainingReport) -> str:
        """``finished at epoch N: <evaluation>, train loss X; swarm ... samples/s ...``."""
        parts = [*_eval_metrics(report.metrics), f"train loss {_format_metric(self.train_loss)}"]
        line = f"{how} at epoch {report.epochs}: " + ", ".join(parts)
        overall = self.meter.overall()
        if overall is not None:
            line += (
                f"; swarm {self._rate(overall)}{overall.seconds_per_epoch:.2f} s/epoch over "
                f"{overall.epochs} epochs ({overall.seconds_per_epoch * overall.epochs:.1f} s)"
            )
        return line

    def _rate(self, throughput: Throughput) -> str:
        return "" if self._diloco else f"{throughput.samples_per_second:.0f} samples/s, "


class _StopOnSignal:
    """SIGINT/SIGTERM set ``stop`` so the training loop leaves after its step;
    a second SIGINT interrupts at once. Installed in the main thread (Python
    runs signal handlers only there), restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        log.info("received %s: leaving after this step", signal.Signals(signum).name)
        self.stop.set()

    def __enter__(self) -> _StopOnSignal:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _training_config(
    args: argparse.Namespace, run_id: str, seed: int, *, starts_run: bool
) -> TrainingConfig:
    """What this peer trains, from the options (after the run's settings were adopted).

    A peer that starts a run waits for a second one (up to ``--wait-for-peers``)
    unless ``--min-peers`` says otherwise, so that the command it prints can join
    before the run is over."""
    from trainer import PRECISIONS, resolve_device
    from trainer._loop import TrainingConfig

    min_peers = args.min_peers
    if min_peers is None:
        min_peers = 2 if starts_run and args.wait_for_peers > 0 else 1
    return TrainingConfig(
        run_id=run_id,
        target_batch_size=args.target_batch_size,
        batch_size=args.batch_size,
        max_epochs=args.max_epochs,
        eval_every=args.eval_every,
        data_seed=seed,
        min_peers=min_peers,
        min_peers_timeout=args.wait_for_peers,
        lr=args.lr,
        device=str(resolve_device(args.device)),
        dtype=PRECISIONS[args.precision],
        checkpoint_dir=None if args.checkpoint_dir is None else Path(args.checkpoint_dir),
        optimizer=_collaborative_config(args),
    )


def _agree_on_settings(
    peer: Peer, args: argparse.Namespace, given: frozenset[str], run_id: str, task: Task[Any]
) -> tuple[argparse.Namespace, Task[Any], bool]:
    """Join the run's settings (see ``_run_settings``): read them from the DHT,
    adopt those this peer did not set, refuse a conflict, and keep them published.

    Returns the options with the run's settings in place, the task to train
    (the run's, when this peer named none), and whether this peer starts the
    run (nobody had published its settings). Raises ``SettingsConflictError`` for
    a setting given with another value than the run's, and ``ConfigError`` when
    the run's task cannot be loaded here."""
    from trainer import load_task

    from ._run_settings import RunSettings, read_run_settings, reconcile, serve_run_settings

    dht = peer.async_peer.dht
    run = peer.run(read_run_settings, dht, run_id) if args.initial_peer else None
    mine = RunSettings(
        task=args.task,
        task_name=task.name,
        target_batch_size=args.target_batch_size,
        matchmaking_time=args.matchmaking_time,
        target_group_size=args.target_group_size,
        diloco=args.diloco,
        max_epochs=args.max_epochs,
        started=dht.now(),
        precision=args.precision,
        lossy=args.lossy,
        ring=args.ring,
    )
    settings = reconcile(run, mine, frozenset(given & RunSettings.OPTIONS.keys()))
    if settings.task_name != task.name:
        try:
            task = load_task(settings.task)
        except ConfigError as e:
            raise ConfigError(f"cannot load the run's task {settings.task!r}: {e}") from e
    adopted = argparse.Namespace(**vars(args))
    changed = []
    for name, option in RunSettings.OPTIONS.items():
        value = getattr(settings, name)
        if value != getattr(args, name):
            setattr(adopted, name, value)
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            changed.append(f"{option} {shown}")
    if changed:
        say(f"adopted the run's settings: {', '.join(changed)}")
    _check_train_args(adopted)
    peer.run(peer.async_peer.start_service, serve_run_settings, dht, run_id, settings)
    return adopted, task, run is None


def _waiting_line(config: TrainingConfig) -> str | None:
    """What a peer that waits for others says before it waits (None: it does not)."""
    if config.min_peers <= 1:
        return None
    return (
        f"waiting up to {config.min_peers_timeout:g} s for peers to join; training starts "
        f"once {config.min_peers} peers are in the run, or after the wait "
        "(--wait-for-peers 0: no wait)"
    )


def _run_train(args: argparse.Namespace, given: frozenset[str] = frozenset()) -> int:
    """``swarm train``: ``given`` names the options set on the command line
    (the others may be adopted from the run's settings)."""
    stop = threading.Event()
    with _StopOnSignal(stop):
        _check_train_args(args)
        _check_dashboard_args(args)
        _collaborative_config(args)  # this peer's own settings must be valid to begin with
        _startup_checks(args)
        _open_log_file(args)
        from trainer import load_task
        from trainer._loop import train

        from ._peer import Peer

        peer_config = _peer_config(args)
        task = load_task(args.task)
        run_id = args.run_id or task.name
        identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
        seed = args.seed
        if seed is None:
            seed = int.from_bytes(bytes(identity.peer_id)[:4], "big")
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        with Peer(identity, peer_config) as peer:
            say(f"peer {peer.peer_id} listening on {args.host}:{peer.async_peer.port}")
            args, task, starts_run = _agree_on_settings(peer, args, given, run_id, task)
            config = _training_config(args, run_id, seed, starts_run=starts_run)
            reporter = _EpochReporter(config.target_batch_size, diloco=args.diloco is not None)
            with _open_dashboard(args, config, reporter) as dashboard:
                dashboard.attach(peer)
                say(
                    f"training task {task.name} in run {run_id}"
                    f" on {_device_words(config.device)} in {args.precision}"
                )
                say(f"join with: {_join_command(args, _join_address(peer), run_id)}")
                waiting = _waiting_line(config)
                if waiting is not None:
                    say(waiting)
                report = train(
                    peer,
                    task,
                    config,
                    stop=stop,
                    on_epoch=dashboard.on_epoch,
                    on_start=dashboard.on_start,
                )
                dashboard.close()  # the live display ends before the last line
                dashboard.finish(report.epochs, report.metrics)
        say(reporter.final_line("stopped" if stop.is_set() else "finished", report))
    return EXIT_OK


# -- swarm status ---------------------------------------------------------------------


def _status_object(
    run_id: str,
    swarm: SwarmProgress,
    live: list[PeerProgress],
    now: float,
    settings: RunSettings | None,
    *,
    sampled: bool = False,
) -> dict[str, Any]:
    """``swarm status --json``. The totals (``epoch``, ``num_peers``, the
    rates) are the whole swarm's; ``peers`` lists every live peer, or, with
    ``peers_sampled`` true (a swarm larger than the progress directory), a
    uniform sample of them while the totals come from the progress tree
    (``trainer.observe_progress``). ``samples_per_second`` is the run's real
    throughput since it began (samples of completed global steps per second of
    wall time; null without the run's settings), ``compute_samples_per_second``
    the sum of the live peers' compute rates. Each peer's ``loss`` is its running
    training loss (also as ``train_loss``), its ``samples_per_second`` its
    compute rate (also as ``compute_samples_per_second``) and its ``device``
    where and in what precision it trains (``unknown`` for a peer too old to
    say)."""
    throughput: float | None = None
    # (DiLoCo: an epoch is H local steps of every peer, not the target batch)
    known = settings is not None and settings.diloco is None
    if settings is not None and known and swarm.epoch > 0 and now > settings.started:
        throughput = swarm.epoch * settings.target_batch_size / (now - settings.started)
    return {
        "run_id": run_id,
        "epoch": swarm.epoch,
        "samples_per_second": throughput,
        "compute_samples_per_second": swarm.samples_per_second,
        "seconds_since_start": None if settings is None else max(0.0, now - settings.started),
        "num_peers": swarm.num_peers,
        "peers_sampled": sampled,
        "settings": None if settings is None else settings.to_value(),
        "peers": [
            {
                "peer_id": str(record.peer_id),
                "epoch": record.epoch,
                "samples": record.samples,
                "samples_per_second": record.samples_per_second,
                "compute_samples_per_second": record.samples_per_second,
                "loss": record.loss,
                "train_loss": record.loss,
                "accuracy": record.accuracy,
                "client": record.client,
                "device": record.device,
                "reachability": record.reachability,
                "punched": record.punched,
                "age": max(0.0, now - record.time),
            }
            for record in live
        ],
    }


def _status_table(status: dict[str, Any]) -> str:
    head = f"run {status['run_id']}: epoch {status['epoch']}, {_peers(status['num_peers'])}"
    if status["samples_per_second"] is not None:
        head += (
            f", {status['samples_per_second']:.0f} samples/s since it began "
            f"{status['seconds_since_start']:.0f} s ago"
        )
    if status["compute_samples_per_second"] > 0:  # 0: no live peer measured its rate yet
        head += f", compute {status['compute_samples_per_second']:.0f} samples/s"
    lines = [head]
    if status.get("peers_sampled"):
        lines.append(
            f"totals from the progress tree; listed below: a sample of "
            f"{len(status['peers'])} of the {status['num_peers']} peers"
        )
    if status["peers"]:
        lines.append(
            f"{'peer':<40}  {'epoch':>5}  {'compute samples/s':>17}  {'train loss':>10}  "
            f"{'accuracy':>8}  {'age (s)':>7}  {'reachability':<12}  device"
        )
    for p in status["peers"]:
        lines.append(
            f"{p['peer_id']:<40}  {p['epoch']:>5}  {p['compute_samples_per_second']:>17.1f}  "
            f"{_format_metric(p['train_loss']):>10}  {_format_metric(p['accuracy'], '.3f'):>8}  "
            f"{p['age']:>7.1f}  {_reachability_cell(p):<12}  {p['device']}"
        )
    return "\n".join(lines)


def _reachability_cell(peer: dict[str, Any]) -> str:
    """A peer's reachability (``swarm._reachability``), and with how many
    peers it holds connections punched through NATs (``swarm._punch``), if
    any; for a record of an older peer, which has none, ``client`` or ``-``."""
    reachability: str | None = peer.get("reachability")
    if reachability is None:
        return "client" if peer["client"] else "-"
    punched = peer.get("punched", 0)
    return f"{reachability},punched:{punched}" if punched else reachability


async def _run_status(args: argparse.Namespace) -> int:
    initial = [parse_address(a) for a in args.initial_peer]
    if not (math.isfinite(args.stale_after) and args.stale_after > 0):
        raise ConfigError(f"--stale-after {args.stale_after} must be positive")
    from dht import DHTConfig, open_dht_node
    from trainer import observe_progress

    from ._run_settings import read_run_settings

    # A client: this process lives for one query, so it must not be left
    # behind as a dead contact in the routing tables of the peers it asked.
    config = DHTConfig(swarm_key=_swarm_key(args), client_mode=True)
    host = args.host
    if host is None:
        host = "127.0.0.1" if all(h.startswith("127.") for h, _ in initial) else "0.0.0.0"
    async with open_dht_node(
        Identity.generate(), host=host, initial_peers=initial, config=config
    ) as node:
        observed = await observe_progress(node, args.run_id, stale_after=args.stale_after)
        settings = await read_run_settings(node, args.run_id)
        now = node.now()
    status = _status_object(
        args.run_id, observed.swarm, observed.listed, now, settings, sampled=observed.sampled
    )
    say(json.dumps(status) if args.json else _status_table(status))
    return EXIT_OK


# -- swarm demo -----------------------------------------------------------------------


def _run_demo(args: argparse.Namespace) -> int:
    from ._demo import DemoConfig, run_demo

    config = DemoConfig(
        peers=args.peers,
        max_epochs=args.max_epochs,
        task=args.task,
        matchmaking_time=args.matchmaking_time,
        verbose=args.verbose,
    )
    return trio.run(run_demo, config)


# -- swarm keygen ---------------------------------------------------------------------


def _run_keygen(args: argparse.Namespace) -> int:
    from ._swarm_key import create_swarm_key

    create_swarm_key(args.swarm_key)
    say(
        f"created swarm key {args.swarm_key} (mode 0600); copy it to every peer of the swarm "
        f"and pass --swarm-key {args.swarm_key}"
    )
    return EXIT_OK


# -- config file and options of the dashboard (issue 20) -----------------------------

#: An argument group of a parser, where options are registered like on the parser.
_Group = argparse._ArgumentGroup


def _add_config_option(group: argparse.ArgumentParser | _Group) -> None:
    group.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read options from a TOML file: the long option names, with dashes or "
        "underscores (e.g. target-batch-size = 512); flags given here override it",
    )


def _parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, with a ``--config`` file's values as the command's defaults.

    Raises ``ConfigError`` (one line naming the file and key) for a bad file;
    argparse exits 2 for bad flags."""
    from ._config_file import parse_with_config

    commands = next(a for a in parser._actions if isinstance(a, _LazySubParsers))
    chosen = commands.command(argv[0]) if argv else None
    return parse_with_config(parser, {} if chosen is None else {argv[0]: chosen}, argv)


def _check_dashboard_args(args: argparse.Namespace) -> None:
    """The options of this section that can be checked before anything starts."""
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ConfigError(f"--lr {args.lr:g} must be a positive number")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {args.metrics_port} is outside 0-65535")


def _add_output_options(group: _Group) -> None:
    from ._log_file import LOG_FORMATS

    group.add_argument(
        "--log-file",
        metavar="PATH",
        help="also write the log to PATH (appended); without --checkpoint-dir the metric "
        "history goes beside it (PATH's name + .history.jsonl)",
    )
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text, or json: one JSON object per line, with time, level, logger, message "
        "and the record's fields (the log file's, else stderr's; default text)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on --host:PORT (0: any free port, logged)",
    )


def _open_log_file(args: argparse.Namespace) -> None:
    from ._log_file import configure_log_output

    configure_log_output(args.log_file, args.log_format)


def _open_dashboard(
    args: argparse.Namespace, config: TrainingConfig, lines: _EpochReporter
) -> contextlib.AbstractContextManager[Dashboard]:
    """The history, metrics and display of ``swarm train`` (``_dashboard``):
    a live display when stdout is a terminal, else the plain epoch ``lines``
    (which share the dashboard's throughput meter)."""
    from ._dashboard import PlainLines, open_dashboard
    from ._history import history_path

    def display(throughput: ThroughputMeter) -> Display:
        if sys.stdout.isatty():
            from ._live import LiveDisplay

            return LiveDisplay(
                target_batch_size=config.target_batch_size,
                max_epochs=config.max_epochs,
                throughput=throughput,
            )
        return PlainLines(lines)

    return open_dashboard(
        target_batch_size=config.target_batch_size,
        history_path=history_path(args.checkpoint_dir, args.log_file),
        metrics_address=None if args.metrics_port is None else (args.host, args.metrics_port),
        display=display,
        meter=lines.meter,
    )


# -- swarm status --watch -------------------------------------------------------------


def _add_status_watch_options(status: argparse.ArgumentParser) -> None:
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=STATUS_WATCH_INTERVAL,
        metavar="SECONDS",
        help="refresh the table every SECONDS (default %(const)g), in place on a terminal, "
        "until Ctrl-C",
    )
    status.add_argument(
        "--count", type=int, metavar="N", help="with --watch: leave after N refreshes"
    )


def _run_status_command(args: argparse.Namespace) -> int:
    if args.watch is None:
        if args.count is not None:
            raise ConfigError("--count needs --watch")
        return trio.run(_run_status, args)
    if not (math.isfinite(args.watch) and args.watch > 0):
        raise ConfigError(f"--watch {args.watch:g} must be a positive number of seconds")
    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count {args.count} must be at least 1")
    try:
        return trio.run(_watch_status, args)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how a watch ends


async def _watch_status(args: argparse.Namespace) -> int:
    """``swarm status`` every ``--watch`` seconds, ``--count`` times or until
    Ctrl-C. On a terminal each table replaces the last (the cursor moves up
    over it); otherwise the tables follow each other, a blank line apart."""
    import io

    redraw = sys.stdout.isatty() and not args.json
    shown = 0  # lines of the table on screen
    refreshes = 0
    while True:
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            await _run_status(args)
        text = table.getvalue()
        if redraw:
            # up to the first line of the last table, and clear from there down
            sys.stdout.write((f"\x1b[{shown}F" if shown else "") + "\x1b[J" + text)
            shown = text.count("\n")
        else:
            sys.stdout.write(("\n" if refreshes and not args.json else "") + text)
        sys.stdout.flush()
        refreshes += 1
        if args.count is not None and refreshes >= args.count:
            return EXIT_OK
        await trio.sleep(args.watch)


# -- swarm export ---------------------------------------------------------------------


def _add_export_command(commands: _LazySubParsers) -> None:
    export = commands.add_parser(
        "export",
        help="write the trained model's weights to a safetensors file",
        description="Write the model weights of the newest valid checkpoint in DIR to a "
        "safetensors file that loads without Swarm (names as in the model's state_dict).",
    )
    export.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="the peer's")
    export.add_argument("--out", required=True, metavar="FILE.safetensors", help="file to write")
    export.add_argument(
        "--task",
        default=DEFAULT_TASK,
        metavar="NAME|FILE.py:FACTORY",
        help=f"the task the run trained: its model names the weights (default {DEFAULT_TASK})",
    )
    export.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _run_export(args: argparse.Namespace) -> int:
    from trainer import export_model, load_task

    model, _, _ = load_task(args.task).build(seed=0)
    exported = export_model(args.checkpoint_dir, args.out, model)
    print(
        f"exported epoch {exported.epoch} ({exported.tensors} tensors) to {exported.path}",
        flush=True,
    )
    return EXIT_OK


# -- swarm plot -----------------------------------------------------------------------


def _add_plot_command(commands: _LazySubParsers) -> None:
    from ._plot import DEFAULT_HEIGHT, DEFAULT_WIDTH

    plot = commands.add_parser(
        "plot",
        help="draw a run's loss, accuracy and throughput over time as a PNG",
        description="Draw the metric history a training peer keeps (history.jsonl in its "
        "--checkpoint-dir, or beside its --log-file) as a PNG.",
    )
    source = plot.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", metavar="DIR", help="the peer's checkpoint directory")
    source.add_argument("--history", metavar="FILE", help="a history file (*.history.jsonl)")
    plot.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    plot.add_argument(
        "--width", type=int, default=DEFAULT_WIDTH, metavar="PIXELS", help="default %(default)s"
    )
    plot.add_argument(
        "--height", type=int, default=DEFAULT_HEIGHT, metavar="PIXELS", help="default %(default)s"
    )
    plot.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _run_plot(args: argparse.Namespace) -> int:
    from ._history import history_path, read_history
    from ._plot import plot_history

    path = Path(args.history) if args.history else history_path(args.checkpoint_dir, None)
    assert path is not None
    if not path.is_file():
        raise ConfigError(f"no metric history at {path}: train with --checkpoint-dir first")
    records = read_history(path)
    out = plot_history(records, args.out, width=args.width, height=args.height)
    print(f"plotted {len(records)} records to {out} ({args.width}x{args.height})", flush=True)
    return EXIT_OK


# -- entry point ----------------------------------------------------------------------


def _given_options(argv: list[str]) -> frozenset[str]:
    """The destinations of the options set on the command line ``argv`` (not
    left at their defaults): parsed again with every default suppressed."""
    parser = build_parser()
    if argv:
        # the chosen command's options are added lazily: add them now, so that
        # their defaults are suppressed too
        commands = next(a for a in parser._actions if isinstance(a, _LazySubParsers))
        commands.command(argv[0])

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            else:
                action.default = argparse.SUPPRESS

    suppress(parser)
    return frozenset(vars(parser.parse_args(argv))) - {"command"}


def _config_options(args: argparse.Namespace) -> frozenset[str]:
    """The destinations of the options a ``--config`` file sets: for the run's
    settings they count as given, like flags (a conflict is refused, not adopted)."""
    path = getattr(args, "config", None)
    if path is None:
        return frozenset()
    from ._config_file import read_config_file

    return frozenset(key.replace("-", "_") for key in read_config_file(path))


def _report_failure(command: str, error: SwarmError) -> None:
    """Say on stderr why ``swarm <command>`` failed; for a crash of the peer's
    thread (a bug to report), with the crash's traceback, also in the log file."""
    print(f"swarm {command}: failed: {error}", file=sys.stderr)
    if isinstance(error, PeerCrashedError):
        logging.getLogger("swarm").error("the peer's thread crashed", exc_info=error.crash)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parse_args(parser, arguments)
    except ConfigError as e:
        print(f"swarm {arguments[0]}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(args.verbose)
    given = _given_options(arguments) | _config_options(args)
    runners: dict[str, Callable[[argparse.Namespace], int]] = {
        "dht": lambda a: trio.run(_run_dht, a),
        "train": lambda a: _run_train(a, given),
        "status": _run_status_command,
        "demo": _run_demo,
        "keygen": _run_keygen,
        "export": _run_export,
        "plot": _run_plot,
    }
    try:
        with collapse_exception_groups():
            return runners[args.command](args)
    except (ConfigError, BootstrapError) as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SwarmError as e:
        _report_failure(args.command, e)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        # `swarm dht` leaves cleanly on SIGINT; a second Ctrl-C during training does not.
        return EXIT_OK if args.command == "dht" else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
