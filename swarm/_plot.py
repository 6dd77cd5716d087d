"""``swarm plot``: a PNG of a run's loss, accuracy and throughput over time,
drawn with matplotlib (Agg: no display needed) from a peer's metric history
(``_history``).

Three panels share the time axis (seconds or, from two minutes on, minutes
since the first record): training
and evaluation loss, evaluation accuracy, and the swarm's throughput in
samples per second. The image is ``width`` x ``height`` pixels exactly.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ._errors import ConfigError
from ._history import EpochRecord

#: The image's size in pixels when none is given (``swarm plot --width/--height``).
DEFAULT_WIDTH, DEFAULT_HEIGHT = 1200, 900
#: Dots per inch of the figure: sizes are given in pixels.
_DPI = 100


def plot_history(
    records: Sequence[EpochRecord],
    out: str | Path,
    *,
    width: int = DEFAULT_WIDTH,
    height: int = DEFAULT_HEIGHT,
    title: str | None = None,
) -> Path:
    """Draw ``records`` into the PNG file ``out`` (written atomically), of
    ``width`` x ``height`` pixels. Raises ``ConfigError`` for no records, a
    size below 200 x 200 pixels, or a file that cannot be written."""
    if not records:
        raise ConfigError("the metric history holds no records: nothing to plot")
    if width < 200 or height < 200:
        raise ConfigError(f"a plot of {width}x{height} pixels is too small (200x200 at least)")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    start = min(r.time for r in records)
    span = max(r.time for r in records) - start
    unit, scale = ("minutes", 60.0) if span >= 120 else ("seconds", 1.0)

    def series(name: str) -> tuple[list[float], list[float]]:
        points = [
            ((r.time - start) / scale, float(value))
            for r in records
            if (value := getattr(r, name)) is not None
        ]
        return [t for t, _ in points], [v for _, v in points]

    # A Figure of its own, not pyplot's global state: safe in any thread.
    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI, layout="constrained")
    loss, accuracy, throughput = figure.subplots(3, 1, sharex=True)
    for name, label in (("train_loss", "training loss"), ("eval_loss", "evaluation loss")):
        times, values = series(name)
        loss.plot(times, values, marker="." if name == "eval_loss" else None, label=label)
    loss.set_ylabel("loss")
    loss.legend(loc="upper right")
    times, values = series("accuracy")
    accuracy.plot(times, values, marker=".", color="tab:green")
    accuracy.set_ylabel("evaluation accuracy")
    times, values = series("samples_per_second")
    throughput.plot(times, values, color="tab:purple", label="swarm throughput")
    times, values = series("compute_samples_per_second")
    throughput.plot(times, values, color="tab:gray", linestyle="--", label="compute rate")
    throughput.set_ylabel("samples/s")
    throughput.set_xlabel(f"{unit} since the first record")
    throughput.legend(loc="upper right")
    for axes in (loss, accuracy, throughput):
        axes.grid(alpha=0.3)
    epochs = max(r.epoch for r in records)
    figure.suptitle(title or f"{len(records)} records, epoch {epochs}")

    target = Path(out)
    try:
        fd, temp_name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".png", dir=target.parent
        )
    except OSError as e:
        raise ConfigError(f"cannot write {target}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as file:
            figure.savefig(file, format="png", dpi=_DPI)
        os.replace(temp_name, target)
    except OSError as e:
        raise ConfigError(f"cannot write {target}: {e.strerror or e}") from e
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
    return target
