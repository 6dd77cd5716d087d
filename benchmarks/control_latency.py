"""Benchmark: how long a control message's request and reply take on a lossy link.

Two peers, each in a network namespace of its own (``tests/netbed.py``; needs
root), on links of ``--link-rate`` each way that each drop ``--loss`` of the
packets crossing them (so a packet between the two is lost with probability
``1 - (1 - loss)**2``: 19% at 10%). One peer serves an echo stream; the other
opens one stream to it and sends ``--exchanges`` small messages (100 bytes),
each after the reply to the last and a pause of ``--pause`` seconds, timing
each request and reply. Both run this tree's ``swarm._connections``, with the
nudge behind control frames (``ConnectionConfig.nudge``) and without it, the
two alternating ``--launches`` times each on the same bed, so they meet the
same machine. A lost control message that TCP can only resend on a timer is
what the tail (p90, p99, the exchanges over 100 ms) shows.

    python benchmarks/control_latency.py                  # 10% loss, 400 exchanges
    python benchmarks/control_latency.py --loss 0.01 --launches 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SERVER_SEED, CLIENT_SEED = b"S" * 32, b"C" * 32
PORT = 5555
MESSAGE = "m" * 100


async def _serve(host: str, nudge: bool) -> None:
    import trio

    from swarm import Identity
    from swarm._connections import ConnectionConfig, Stream, open_connections
    from swarm._errors import EndOfStreamError

    async def echo(stream: Stream) -> None:
        while True:
            try:
                message = await stream.receive()
            except EndOfStreamError:
                return
            await stream.send(message)

    config = ConnectionConfig(nudge=nudge)
    async with open_connections(Identity.from_seed(SERVER_SEED), host, PORT, config) as net:
        net.set_handler("echo", echo)
        print("ready", flush=True)
        await trio.sleep_forever()


async def _ask(host: str, server: str, nudge: bool, exchanges: int, pause: float) -> None:
    import trio

    from swarm import Identity
    from swarm._connections import ConnectionConfig, open_connections

    config = ConnectionConfig(nudge=nudge)
    server_id = Identity.from_seed(SERVER_SEED).peer_id
    times = []
    async with (
        open_connections(Identity.from_seed(CLIENT_SEED), host, 0, config) as net,
        net.open_stream(server_id, (server, PORT), "echo") as stream,
    ):
        await stream.send("warm up")
        await stream.receive()
        for _ in range(exchanges):
            start = time.perf_counter()
            await stream.send(MESSAGE)
            if await stream.receive() != MESSAGE:
                raise RuntimeError("the echo differs")
            times.append(time.perf_counter() - start)
            await trio.sleep(pause)
    print(json.dumps(times), flush=True)


def _summary(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)

    def quantile(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return {
        "mean": statistics.mean(ms),
        "p50": quantile(0.5),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": ms[-1],
        "over 100 ms": sum(m > 100 for m in ms) / len(ms),
    }


def _launch(bed: Any, nudge: bool, args: argparse.Namespace) -> list[float]:
    me = [sys.executable, str(Path(__file__).resolve())]
    flag = "--nudge" if nudge else "--no-nudge"
    server = bed.popen(
        1, [*me, "--role", "server", "--host", bed.addresses[1], flag], stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError("the server did not start")
        argv = [*me, "--role", "client", "--host", bed.addresses[0], flag]
        argv += ["--server", bed.addresses[1], "--exchanges", str(args.exchanges)]
        argv += ["--pause", str(args.pause)]
        done = subprocess.run(
            bed.exec(0, argv), capture_output=True, text=True, timeout=args.timeout, check=True
        )
        times: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
        return times
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", type=float, default=0.1, help="on each of the two links")
    parser.add_argument("--link-rate", default="20mbit")
    parser.add_argument("--exchanges", type=int, default=400)
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between exchanges")
    parser.add_argument("--launches", type=int, default=2, help="of each variant, alternating")
    parser.add_argument("--timeout", type=float, default=600.0, help="per launch, seconds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--nudge", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        import trio

        if args.role == "server":
            trio.run(_serve, args.host, args.nudge)
        else:
            trio.run(_ask, args.host, args.server, args.nudge, args.exchanges, args.pause)
        return
    if not 0 <= args.loss < 1 or args.exchanges < 1 or args.launches < 1:
        parser.error("--loss in [0, 1), --exchanges and --launches at least 1")

    from netbed import Link, NetBed

    rows = []
    with NetBed([Link(args.link_rate, args.link_rate, loss=args.loss)] * 2) as bed:
        for launch in range(args.launches):
            for nudge in (launch % 2 == 0, launch % 2 == 1):
                summary = _summary(_launch(bed, nudge, args))
                rows.append({"nudge": nudge, "launch": launch + 1, **summary})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"request and reply of {len(MESSAGE)} bytes on one stream, 2 peers on {args.link_rate} "
        f"links, {args.loss:.0%} loss on each; {args.exchanges} exchanges a launch, ms"
    )
    columns = ("mean", "p50", "p90", "p99", "max")
    print(f"  {'nudge':>5} {'launch':>6} " + " ".join(f"{c:>7}" for c in columns) + "  >100 ms")
    for row in rows:
        print(
            f"  {'yes' if row['nudge'] else 'no':>5} {row['launch']:>6} "
            + " ".join(f"{row[c]:>7.1f}" for c in columns)
            + f"  {row['over 100 ms']:>6.1%}"
        )


if __name__ == "__main__":
    main()
