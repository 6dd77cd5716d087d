"""The live progress display of ``swarm train`` on a terminal (``rich``).

One line at the bottom of the terminal, redrawn four times a second: the
epoch (and ``--max-epochs``), the swarm's progress toward the next global
batch as a bar with its samples, the live peers, the swarm's throughput, and
the estimated time to ``--max-epochs``. Each global step also prints a line
above it, so the terminal keeps the run's history. When stdout is not a
terminal the CLI prints the plain epoch lines instead (``PlainLines``).

The display reads the optimizer from rich's refresh thread through
attributes that are replaced whole (``epoch``, ``swarm_progress()``), so it
never sees a half-updated figure and never blocks training.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ._dashboard import summary
from ._history import EpochRecord
from ._throughput import ThroughputMeter


def format_eta(seconds: float | None) -> str:
    """``H:MM:SS``, or ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    whole = round(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class LiveDisplay:
    """A ``Display`` (see ``_dashboard``) drawn with rich while the run lasts."""

    def __init__(
        self,
        *,
        target_batch_size: int,
        max_epochs: int | None,
        throughput: ThroughputMeter,
        console: Console | None = None,
        refresh_per_second: float = 4.0,
    ) -> None:
        self.target_batch_size = target_batch_size
        self.max_epochs = max_epochs
        self.throughput = throughput
        self._opt: Any = None
        self._live = Live(
            console=console,
            get_renderable=self.render,
            refresh_per_second=refresh_per_second,
            redirect_stderr=False,
        )
        self._started = False

    def start(self, opt: Any) -> None:
        self._opt = opt
        self._live.start(refresh=True)
        self._started = True

    def epoch(self, opt: Any, report: Any, record: EpochRecord) -> None:
        self._live.console.print(f"epoch {record.epoch}: {summary(record)}", highlight=False)
        self._live.refresh()  # the line below shows the new epoch now, not at the next tick

    def close(self) -> None:
        if self._started:
            self._started = False
            self._live.stop()

    def eta(self) -> float | None:
        """Seconds until ``max_epochs`` at the measured rate (None: unknown or no end)."""
        opt = self._opt
        measured = self.throughput.recent()
        if self.max_epochs is None or opt is None or measured is None:
            return None
        per_step = measured.seconds_per_epoch
        swarm = opt.swarm_progress()
        done = min(1.0, swarm.samples / self.target_batch_size) if swarm.epoch == opt.epoch else 0
        return max(0.0, (self.max_epochs - opt.epoch - done) * per_step)

    def render(self) -> Group | Text:
        opt = self._opt
        if opt is None:
            return Text("starting...")
        swarm = opt.swarm_progress()
        samples = min(swarm.samples, self.target_batch_size) if swarm.epoch == opt.epoch else 0
        epochs = f"epoch {opt.epoch}" + ("" if self.max_epochs is None else f"/{self.max_epochs}")
        measured = self.throughput.recent()
        rate = None if measured is None else measured.samples_per_second
        grid = Table.grid(padding=(0, 1))
        for _ in range(6):
            grid.add_column(no_wrap=True)
        grid.add_row(
            Text(epochs, style="bold"),
            ProgressBar(total=self.target_batch_size, completed=samples, width=24),
            Text(f"{samples}/{self.target_batch_size} samples of the global batch"),
            Text(f"· {swarm.num_peers} {'peer' if swarm.num_peers == 1 else 'peers'} alive"),
            Text("· - samples/s" if rate is None else f"· {rate:.0f} samples/s"),
            Text(f"· ETA {format_eta(self.eta())}"),
        )
        return Group(grid)
