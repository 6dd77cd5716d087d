"""Collaborative training: the ``CollaborativeOptimizer`` and its parts.

Modules:

- ``_task``: the task API (model, data stream, loss, evaluation) and ``load_task``
- ``_tasks_digits``: the built-in ``digits`` task (scikit-learn's bundled data set)
- ``_checkpoint``: atomic checkpoint files and checkpoint directories

The collaborative optimizer itself (progress tracking, target-batch
accumulation, averaging) arrives with the trainer issue.
"""

from ._checkpoint import Checkpoint, CheckpointDir, load_checkpoint, save_checkpoint
from ._task import Task, builtin_task_names, default_optimizer, load_task, shuffled_batches
from ._tasks_digits import make_digits_task

__all__ = [
    "Checkpoint",
    "CheckpointDir",
    "Task",
    "builtin_task_names",
    "default_optimizer",
    "load_checkpoint",
    "load_task",
    "make_digits_task",
    "save_checkpoint",
    "shuffled_batches",
]
