"""benchmarks/loss.py reads what ``swarm train`` prints: each run's final
metric comes from the line the CLI writes when it finishes, so these tests
build that line with the CLI's own reporter rather than typing it out."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from swarm.cli import _EpochReporter
from trainer._loop import TrainingReport

ROOT = Path(__file__).resolve().parents[1]


def _load_benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("loss_benchmark", ROOT / "benchmarks" / "loss.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def _final_line(metrics: dict[str, float], *, train_loss: float | None = 2.0) -> str:
    """The line ``swarm train`` prints at the end of a run of 20 global steps,
    with a throughput part after the ``;`` (observed at 0.5 s per epoch)."""
    reporter = _EpochReporter(256)
    reporter.train_loss = train_loss
    for epoch in range(1, 21):
        reporter.meter.observe(epoch, 0.5 * epoch)
    report = TrainingReport(epochs=20, metrics=metrics)
    return "some prefix: " + reporter.final_line("finished", report)


def test_a_language_model_is_judged_by_its_highest_perplexity() -> None:
    line = _final_line({"loss": 1.875, "perplexity": 6.5208})
    figures = bench.final_figures(line)
    assert figures == {"eval loss": 1.875, "perplexity": 6.5208, "train loss": 2.0}
    metric = bench.metric_of(figures)
    assert metric.name == "perplexity"
    assert metric.worst([6.5, 6.7, 6.6]) == 6.7
    # within 1% of the baseline's perplexity, relative
    assert metric.within(6.56, 6.5)
    assert not metric.within(6.57, 6.5)
    assert metric.within(6.0, 6.5)
    assert metric.target() == "perplexity at most 1% above the baseline"


def test_a_classifier_is_judged_by_its_lowest_accuracy() -> None:
    figures = bench.final_figures(_final_line({"accuracy": 0.931, "loss": 0.25}))
    assert figures == {"accuracy": 0.931, "eval loss": 0.25, "train loss": 2.0}
    metric = bench.metric_of(figures)
    assert metric.name == "accuracy"
    assert metric.worst([0.93, 0.91, 0.92]) == 0.91
    # within 1 accuracy point, absolute
    assert metric.within(0.921, 0.93)
    assert not metric.within(0.919, 0.93)
    assert metric.within(0.95, 0.93)


def test_only_an_eval_loss_is_judged_by_it_and_unmeasured_figures_are_left_out() -> None:
    figures = bench.final_figures(_final_line({"loss": 0.5}, train_loss=None))
    assert figures == {"eval loss": 0.5}
    metric = bench.metric_of(figures)
    assert metric.name == "eval loss"
    assert metric.within(0.51, 0.5) and not metric.within(0.52, 0.5)


def test_lines_without_a_metric_are_refused() -> None:
    with pytest.raises(ValueError, match="not the final line"):
        bench.final_figures("epoch 20: train loss 2.0000, accuracy 0.931")
    with pytest.raises(ValueError, match="reports none of accuracy, perplexity, eval loss"):
        bench.metric_of(bench.final_figures(_final_line({"top5": 0.99})))


def test_a_task_file_is_found_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    absolute = f"{ROOT / 'examples' / 'tiny_lm.py'}:make_task"
    assert bench.task_argument("examples/tiny_lm.py:make_task") == absolute
    assert bench.task_argument("digits") == "digits"
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tiny_lm.py").write_text("")
    here = f"{tmp_path / 'examples' / 'tiny_lm.py'}:make_task"
    assert bench.task_argument("examples/tiny_lm.py:make_task") == here
    with pytest.raises(FileNotFoundError, match=r"no examples/none\.py here or in"):
        bench.task_argument("examples/none.py:make_task")


def test_the_allreduce_share_counts_the_rounds_between_the_first_and_last_step(
    tmp_path: Path,
) -> None:
    """Lines as the peers' text log writes them (``swarm._log_file.TEXT_FORMAT``)."""
    log = tmp_path / "peer0.log"
    log.write_text(
        "2026-11-27 09:32:25,000 INFO averaging._allreduce: all-reduce 0a: data of 4 of 4"
        " senders in every part in 0.900 s\n"
        "2026-11-27 09:32:26,000 INFO swarm.metrics: global step epoch 1: train loss 2.9\n"
        "2026-11-27 09:32:26,500 INFO averaging._allreduce: all-reduce 1b: data of 3 of 4"
        " senders in every part in 0.250 s\n"
        "2026-11-27 09:32:27,900 INFO averaging._allreduce: all-reduce 2c: data of 4 of 4"
        " senders in every part in 0.750 s (around the ring)\n"
        "2026-11-27 09:32:28,000 INFO swarm.metrics: global step epoch 3: train loss 2.8\n"
    )
    other = tmp_path / "peer1.log"
    other.write_text("2026-11-27 09:32:26,000 INFO swarm.metrics: global step epoch 1: x\n")
    measured, steps = bench.measured_peer([other, log])
    assert measured == log
    assert bench.rate(steps) == 1.0  # 2 epochs in 2 s
    # the round that ended before the first step is not counted
    assert bench.allreduce_share(log, steps) == 0.5


def _set(
    base_rate: float, lossy_rate: float, base_accuracy: float, lossy_accuracy: float
) -> list[dict[str, Any]]:
    """One set's rows, as ``run`` returns them: the lossless TCP baseline and
    the lossy plane at 10% loss."""

    def row(loss: float, plane: str, rate: float, accuracy: float) -> dict[str, Any]:
        return {"loss": loss, "plane": plane, "metric": "accuracy", "value": accuracy,
                "steps_per_s": rate}  # fmt: skip

    return [
        row(0.0, "tcp", base_rate, base_accuracy),
        row(0.1, "lossy", lossy_rate, lossy_accuracy),
    ]


def test_the_targets_are_judged_on_the_medians_of_paired_sets() -> None:
    """Each lossy run is compared with its own set's baseline, and the targets
    with the median of those comparisons: a slow set's baseline does not make
    another set's lossy run look fast or slow, and one set far off (the
    second's accuracy) decides nothing."""
    sets = [
        _set(10.0, 7.0, 0.93, 0.925),  # 70%, -0.5 points
        _set(6.0, 5.4, 0.91, 0.88),  # 90%, -3.0 points
        _set(8.0, 6.8, 0.92, 0.917),  # 85%, -0.3 points
    ]
    pairs = bench.paired(sets, 0.1)
    assert [round(share, 3) for _, share, _ in pairs] == [0.7, 0.9, 0.85]
    assert [ok for _, _, ok in pairs] == [True, False, True]
    difference, share, metric_ok, speed_ok = bench.judge(sets, 0.1)
    assert round(difference, 4) == -0.005 and metric_ok
    assert round(share, 3) == 0.85 and speed_ok
    # two sets of three under 80%: missed, whatever the third
    difference, share, metric_ok, speed_ok = bench.judge(
        [sets[0], _set(9.0, 6.9, 0.92, 0.90), sets[2]], 0.1
    )
    assert round(share, 3) == 0.767 and not speed_ok
    assert round(difference, 4) == -0.005 and metric_ok
