"""A training peer's metric history: one JSON object per line, one line per
global step (and one at the end of the run), appended as the run goes.

The file lives in the checkpoint directory (``history.jsonl``) or, without
one, beside the ``--log-file`` (``run.log`` -> ``run.history.jsonl``); a
restarted peer appends to it, so the history of a resumed run is whole.
``swarm plot`` reads it. A line that does not parse (the last one of a
writer killed mid-line) is skipped, never fatal.

Names carry their meaning and unit: ``train_loss`` is the mean loss of this
peer's batches, ``eval_loss`` the task's evaluation; ``samples_per_second`` is
the swarm's throughput (samples of completed global steps per second of wall
time), ``compute_samples_per_second`` the rate the peers compute at, which
leaves averaging out; ``time`` is Unix seconds.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ._errors import ConfigError

#: The history's file name in a checkpoint directory.
HISTORY_NAME = "history.jsonl"


@dataclass(frozen=True)
class EpochRecord:
    """One line of the history: the peer's view of the run after ``epoch``."""

    #: Unix seconds
    time: float
    #: global steps of the swarm completed
    epoch: int
    #: mean training loss of this peer's latest batches
    train_loss: float | None = None
    #: the task's evaluation, when it ran at this epoch
    eval_loss: float | None = None
    accuracy: float | None = None
    #: the swarm's throughput: samples of completed global steps per wall second
    samples_per_second: float | None = None
    #: what the peers compute per second, averaging left out
    compute_samples_per_second: float | None = None
    #: live peers of the run, this one included
    peers: int = 1
    #: seconds this peer spent averaging in this global step
    averaging_seconds: float | None = None
    #: members of this step's averaging group (0: none formed)
    group_size: int = 0
    #: True for the line written when the run ends (its evaluation)
    final: bool = False

    def to_json(self) -> str:
        # NaN/Inf are not JSON: a diverged figure is written as null
        return json.dumps(
            {k: _finite_or_none(v) for k, v in asdict(self).items()}, separators=(",", ":")
        )

    @classmethod
    def from_json(cls, line: str) -> EpochRecord:
        """Parse one line; raises ``ValueError`` if it is not a record."""
        value = json.loads(line)
        if not isinstance(value, dict):
            raise ValueError("a history line is a JSON object")
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in value.items() if k in known})
        if isinstance(record.epoch, bool) or not isinstance(record.epoch, int):
            raise ValueError("epoch must be an integer")
        if not isinstance(record.time, int | float) or isinstance(record.time, bool):
            raise ValueError("time must be a number")
        for name in ("train_loss", "eval_loss", "accuracy", "samples_per_second"):
            item = getattr(record, name)
            if item is not None and (isinstance(item, bool) or not isinstance(item, int | float)):
                raise ValueError(f"{name} must be a number or null")
        return record


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def history_path(checkpoint_dir: str | Path | None, log_file: str | Path | None) -> Path | None:
    """Where a peer keeps its history: in ``checkpoint_dir``, else beside
    ``log_file``, else nowhere (None)."""
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / HISTORY_NAME
    if log_file is not None:
        log = Path(log_file)
        return log.with_name(f"{log.stem}.history.jsonl")
    return None


class HistoryFile:
    """Appends records to a history file, one flushed line each.

    The file is opened (and its directory made) on construction, so a path
    that cannot be written is found at start: ``ConfigError``. ``append``
    raises ``OSError`` (a full disk) and writes nothing partial that
    ``read_history`` would not skip.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a+", encoding="utf-8")
            # A writer killed mid-line left a torn last line: end it, so the
            # next record starts a line of its own.
            if self._file.tell() > 0:
                self._file.seek(self._file.tell() - 1)
                if self._file.read(1) != "\n":
                    self._file.write("\n")
        except OSError as e:
            raise ConfigError(
                f"cannot write the metric history {self.path}: {e.strerror or e}"
            ) from e

    def append(self, record: EpochRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; a record that could not be written (``append``
        raised) is given up here, not retried."""
        with contextlib.suppress(OSError):
            self._file.close()

    def __enter__(self) -> HistoryFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_history(path: str | Path) -> list[EpochRecord]:
    """The records of the history at ``path``, in file order; lines that do not
    parse are skipped. Raises ``ConfigError`` if the file cannot be read."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read the metric history {source}: {e.strerror or e}") from e
    records = []
    for line in text.splitlines():
        try:
            records.append(EpochRecord.from_json(line))
        except (ValueError, TypeError):
            continue
    return records
