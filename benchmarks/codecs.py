"""Benchmark: CPU time to encode and decode one part with each all-reduce codec.

    python benchmarks/codecs.py [--size 1250000] [--repeats 41] [--json]

For each codec (``averaging._codecs``) it times ``encode_split`` and
``decode_split`` of ``--size`` float32 values (a part of a 5M-value vector in
a group of 4 by default; not a multiple of the 8-bit block size, as parts
rarely are), one torch thread, and prints the median process time of
``--repeats`` calls and the rate in float32 values per second. ``NONE`` is
the baseline in the same run: its encode is a view of the tensor's memory
and its decode a view of the buffer, so what a codec adds is the difference.
The machine may be shared: compare figures of one run, or medians of runs at
the same load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Python puts this script's directory first on sys.path, where benchmarks/dht.py
# would shadow the dht package that averaging imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def median_ms(call: Callable[[], object], repeats: int) -> float:
    call()  # warm up: first-touch of buffers, lazy initialisation
    times = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    from averaging import FLOAT16, NONE, UINT4, UINT8
    from averaging._codecs import decode_split, encode_split

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1_250_000)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.size < 1 or args.repeats < 1:
        parser.error("--size and --repeats must be at least 1")
    torch.set_num_threads(1)
    x = torch.randn(args.size, generator=torch.Generator().manual_seed(0))
    rows = []
    for name, codec in (("none", NONE), ("float16", FLOAT16), ("uint8", UINT8), ("uint4", UINT4)):
        header, payload = encode_split(x, codec)
        encode = median_ms(lambda codec=codec: encode_split(x, codec), args.repeats)
        decode = median_ms(
            lambda header=header, payload=payload: decode_split(header, payload), args.repeats
        )
        rows.append({"codec": name, "encode_ms": encode, "decode_ms": decode})
    if args.json:
        print(json.dumps({"size": args.size, "rows": rows}))
        return
    print(f"{args.size:,} float32 values, median process time of {args.repeats} calls")
    print(f"  {'codec':8} {'encode':>10} {'decode':>10}")
    for row in rows:
        print(f"  {row['codec']:8} {row['encode_ms']:8.2f}ms {row['decode_ms']:8.2f}ms")


if __name__ == "__main__":
    main()
