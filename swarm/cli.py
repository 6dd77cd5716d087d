"""The ``swarm`` command.

Exit codes: 0 done, 1 runtime failure, 2 bad usage or bad configuration (with a
one-line message that says what to change).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from ._address import parse_address
from ._errors import BootstrapError, ConfigError, SwarmError, collapse_exception_groups
from ._identity import Identity

log = logging.getLogger("swarm")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_peer_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=0, help="UDP+TCP port (default: any free port)")
    parser.add_argument(
        "--initial-peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a peer already in the swarm (repeat for several)",
    )
    parser.add_argument("--identity", metavar="PATH", help="key file, created 0600 if missing")
    parser.add_argument(
        "--announce", metavar="HOST:PORT", help="address others should dial, if not --host:--port"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="swarm", description="Train one model on many unreliable machines.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    dht = commands.add_parser("dht", help="run a DHT-only peer (e.g. a long-lived bootstrap node)")
    _add_peer_options(dht)
    dht.add_argument(
        "--report-interval",
        type=float,
        default=60.0,
        help="seconds between routing/storage reports in the log",
    )
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        for noisy in ("kademlia", "rpcudp", "asyncio", "trio_asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _announce_host(host: str) -> str:
    if host not in ("0.0.0.0", "::"):
        return host
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


async def _run_dht(args: argparse.Namespace) -> int:
    from dht import open_dht_node

    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    initial = [parse_address(a) for a in args.initial_peer]
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is outside 0-65535")
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_dht_node(
            identity, host=args.host, port=args.port, initial_peers=initial
        ) as node:
            announce = args.announce or f"{_announce_host(args.host)}:{node.port}"
            print(f"peer {node.peer_id} listening on {args.host}:{node.port}", flush=True)
            print(f"join with: swarm dht --initial-peer {announce}", flush=True)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    runners = {"dht": _run_dht}
    try:
        with collapse_exception_groups():
            return trio.run(runners[args.command], args)
    except (ConfigError, BootstrapError) as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SwarmError as e:
        print(f"swarm {args.command}: failed: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
