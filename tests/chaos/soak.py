"""The chaos soak: more peers, faults and epochs than CI, over a range of seeds.

Run from the repository root (one run at a time; each takes a few minutes)::

    .venv/bin/python tests/chaos/soak.py --seeds 0-19

Each seed prints its schedule, then one line saying which faults it survived;
a failing seed prints the assertion and keeps its directory (every peer's
stdout.log, stderr.log and checkpoints). ``--seed N --config JSON``, as printed
by any run, replays one run exactly (the CI test prints the same line).
Exit code 0 if every seed passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # chaos_harness, then cli_harness

import trio  # noqa: E402
from chaos_harness import ChaosConfig, run_chaos  # noqa: E402

#: The soak's run: one more peer, twice the kills and freezes, a longer run.
SOAK = {"peers": 4, "kills": 2, "freezes": 2, "joiners": 1, "max_epochs": 60, "quiet_epochs": 25}


def _seeds(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=_seeds, metavar="A-B", help="every seed from A to B")
    which.add_argument("--seed", type=int, help="one seed")
    parser.add_argument(
        "--config", type=json.loads, default=SOAK, help="ChaosConfig fields as JSON (a replay)"
    )
    parser.add_argument("--keep", action="store_true", help="keep passing runs' directories too")
    args = parser.parse_args()
    # Ctrl-C (SIGINT) ends the soak cleanly, also when a shell started it in the
    # background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    seeds = args.seeds if args.seeds is not None else [args.seed]
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in args.config.items()}
    failed: list[int] = []
    for seed in seeds:
        config = ChaosConfig(seed=seed, **fields)
        directory = Path(tempfile.mkdtemp(prefix=f"swarm-chaos-{seed}-"))
        started = time.monotonic()
        try:
            report = trio.run(run_chaos, config, directory)
        except BaseException as e:  # a whole run is the boundary: report it, go on
            if isinstance(e, KeyboardInterrupt) or (
                isinstance(e, BaseExceptionGroup) and e.subgroup(KeyboardInterrupt) is not None
            ):
                raise  # Ctrl-C: the harness has reaped every process on the way out
            traceback.print_exc()
            failed.append(seed)
            print(f"seed {seed}: FAILED; logs in {directory}", flush=True)
            continue
        survived = ", ".join(f"{f.kind} {f.peer}" for f in report.schedule)
        accuracy = min(report.accuracies.values())
        print(
            f"seed {seed}: passed in {time.monotonic() - started:.0f}s; survived {survived}; "
            f"{len(report.accuracies)} finished, accuracy >= {accuracy:.3f}, "
            f"{len(report.identical)} identical",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{len(seeds) - len(failed)} of {len(seeds)} seeds passed; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
