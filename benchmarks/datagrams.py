"""Micro-benchmark: CPU per datagram of the lossy data plane, no network.

    python benchmarks/datagrams.py [--pieces 3000] [--repeat 5] [--json]

What one datagram costs the CPU on each side of the lossy all-reduce
(``averaging._lossy``), in microseconds, the best of ``--repeat`` passes over
``--pieces`` full pieces (the per-pass minimum filters out other processes of
a shared machine):

- ``seal``: the sender's ``DatagramSealer.seal_bytes`` (header + AES-GCM);
- ``open``: the receiver's ``DatagramOpener.open`` (checks, AES-GCM, finiteness);
- ``add``: ``PieceReducer.add`` of an opened piece (weight 0.5);
- ``receive``: ``open`` then ``add``, the reducer's whole work per datagram
  after the socket.

To compare with an earlier commit, run this script against that commit's
packages (``PYTHONPATH=<its checkout>``): it measures whatever ``averaging``
imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
# Python puts this script's directory first on sys.path, where benchmarks/dht.py
# would shadow the dht package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from averaging._datagrams import (  # noqa: E402
    PIECE_ELEMENTS,
    DatagramOpener,
    DatagramSealer,
    Kind,
    Pair,
)
from averaging._pieces import PieceReducer  # noqa: E402


def best(passes: int, run: Callable[[], int]) -> float:
    """Microseconds per item of the fastest of ``passes`` calls of ``run``
    (which returns how many items it did)."""
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        items = run()
        times.append((time.perf_counter() - start) / items * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pieces", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.pieces < 1 or args.repeat < 1:
        parser.error("--pieces and --repeat must be >= 1")
    key = os.urandom(32)
    size = PIECE_ELEMENTS * args.pieces
    pair = Pair(Kind.PART, b"benchmrk", 7, part=1, sender=2, part_size=size)
    values = np.random.default_rng(0).standard_normal(size).astype("<f4")
    data = memoryview(values.data).cast("B")
    step = 4 * PIECE_ELEMENTS

    def seal() -> int:
        sealer = DatagramSealer(key, pair)
        for piece in range(args.pieces):
            sealer.seal_bytes(piece, data[piece * step : (piece + 1) * step])
        return args.pieces

    sealer = DatagramSealer(key, pair)
    datagrams = [
        sealer.seal_bytes(p, data[p * step : (p + 1) * step]) for p in range(args.pieces)
    ]

    def open_() -> int:
        opener = DatagramOpener(key, pair)
        for datagram in datagrams:
            opener.open(datagram)
        return args.pieces

    opener = DatagramOpener(key, pair)
    opened = [opener.open(d) for d in datagrams]
    pieces = [o for o in opened if o is not None]
    assert len(pieces) == args.pieces, "every sealed datagram opens"

    def add() -> int:
        reducer = PieceReducer(size, {0: 1.0, 2: 0.5})
        for piece, piece_values in pieces:
            reducer.add(2, piece, piece_values)
        return args.pieces

    def receive() -> int:
        opener = DatagramOpener(key, pair)
        reducer = PieceReducer(size, {0: 1.0, 2: 0.5})
        for datagram in datagrams:
            got = opener.open(datagram)
            if got is not None:
                reducer.add(2, *got)
        return args.pieces

    figures = {
        name: best(args.repeat, run)
        for name, run in (("seal", seal), ("open", open_), ("add", add), ("receive", receive))
    }
    print(f"CPU per datagram ({PIECE_ELEMENTS} float32 values), best of {args.repeat} passes:")
    for name, micros in figures.items():
        print(f"  {name:>8}: {micros:6.2f} us")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
