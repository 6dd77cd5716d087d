"""What a relay costs: one stream's throughput through a relay against a direct
connection, measured in the same run on 127.0.0.1 (``swarm._relay``).

Three peers in this one process: R relays, X is dialed through R, D sends X
``--megabytes`` MiB in 1 MiB raw frames and waits for X's one-line reply. The
same transfer goes over a direct connection first (the baseline), then
through the relay (rate limit off unless ``--limit`` bytes/s is given). It
reports for each the seconds, MiB/s and the process's CPU seconds; for the
relayed run also the bytes the relay forwarded (both directions) and its
share of the CPU: relayed CPU minus direct CPU, since all three peers share
this process. Loopback has no bandwidth limit, so this measures the relay's
copying and the extra hops, not a home uplink.

    python benchmarks/relay.py                    # 256 MiB, encrypted
    python benchmarks/relay.py --megabytes 64 --limit 20e6 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
# this script's directory first on sys.path would shadow the dht package with benchmarks/dht.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import trio  # noqa: E402

from swarm import (  # noqa: E402
    EndOfStreamError,
    Identity,
    Stream,
    keep_relay,
    open_connections,
    serve_relay,
)
from swarm._relay import RelayConfig  # noqa: E402

HOST = "127.0.0.1"
_CHUNK = 2**20


async def _sink(stream: Stream) -> None:
    buffer = bytearray(_CHUNK)
    total = 0
    while True:
        try:
            total += await stream.receive_into(buffer)
        except EndOfStreamError:  # the sender is done
            break
    await stream.send(total)


async def _measure(megabytes: int, limit: float) -> dict[str, Any]:
    r_id, x_id, d_id, e_id = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3, 4))
    payload = bytes(_CHUNK)
    results: dict[str, Any] = {"megabytes": megabytes}
    async with (
        open_connections(r_id, HOST) as r,
        serve_relay(r, RelayConfig(max_bytes_per_second=limit)) as relay,
        open_connections(x_id, HOST) as x,
        open_connections(d_id, HOST) as d,
        open_connections(e_id, HOST) as e,
        trio.open_nursery() as nursery,
    ):
        x.set_handler("sink", _sink)
        circuit = await nursery.start(keep_relay, x, r_id.peer_id, (HOST, r.port))
        # two dialers, so that the relayed run cannot reuse the direct connection
        e.set_relay_route(x_id.peer_id, circuit)
        for name, dialer in (("direct", d), ("relayed", e)):
            cpu, wall = time.process_time(), time.perf_counter()
            async with dialer.open_stream(x_id.peer_id, (HOST, x.port), "sink") as stream:
                for _ in range(megabytes):
                    await stream.send_bytes(payload)
                await stream.send_eof()
                received = await stream.receive()
            seconds = time.perf_counter() - wall
            if received != megabytes * _CHUNK:
                raise RuntimeError(f"{name}: X received {received} bytes")
            results[name] = {
                "seconds": round(seconds, 3),
                "mib_per_s": round(megabytes / seconds, 1),
                "cpu_s": round(time.process_time() - cpu, 3),
            }
        results["relay_bytes"] = relay.bytes_relayed
        results["relay_cpu_s"] = round(results["relayed"]["cpu_s"] - results["direct"]["cpu_s"], 3)
        nursery.cancel_scope.cancel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--limit", type=float, default=1e12, help="relay bytes/s (default: off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = trio.run(_measure, args.megabytes, args.limit)
    if args.json:
        print(json.dumps(results))
        return
    for name in ("direct", "relayed"):
        row = results[name]
        print(
            f"{name:8} {row['seconds']:8.3f} s {row['mib_per_s']:8.1f} MiB/s  cpu {row['cpu_s']} s"
        )
    print(f"relay forwarded {results['relay_bytes']} bytes, ~{results['relay_cpu_s']} s CPU")


if __name__ == "__main__":
    main()
