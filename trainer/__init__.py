"""Collaborative training: the ``CollaborativeOptimizer`` and its parts.

Modules:

- ``_task``: the task API (model, data stream, loss, evaluation) and ``load_task``
- ``_tasks_digits``: the built-in ``digits`` task (scikit-learn's bundled data set)
- ``_checkpoint``: atomic checkpoint files and checkpoint directories
- ``_export``: the newest checkpoint's model weights as a safetensors file
- ``_progress``: progress records in the DHT and the swarm's progress estimate
- ``_ef21m``: ``ArcTopK`` gradient compression with EF21M error feedback
- ``_diloco``: DiLoCo mode: local inner steps, then an outer Nesterov step
- ``_dropcompute``: DropCompute: a compute threshold per step, chosen from measured times
- ``_optimizer``: ``CollaborativeOptimizer``, one global step per target batch
"""

from ._checkpoint import Checkpoint, CheckpointDir, load_checkpoint, save_checkpoint
from ._diloco import DiLoCo
from ._dropcompute import DropCompute, choose_threshold
from ._ef21m import ArcTopK
from ._export import ExportedModel, export_model
from ._optimizer import CollaborativeConfig, CollaborativeOptimizer, GlobalStep
from ._progress import PeerProgress, SwarmProgress, estimate, parse_progress, progress_key
from ._task import Task, builtin_task_names, default_optimizer, load_task, shuffled_batches
from ._tasks_digits import make_digits_task

__all__ = [
    "ArcTopK",
    "Checkpoint",
    "CheckpointDir",
    "CollaborativeConfig",
    "CollaborativeOptimizer",
    "DiLoCo",
    "DropCompute",
    "ExportedModel",
    "GlobalStep",
    "PeerProgress",
    "SwarmProgress",
    "Task",
    "builtin_task_names",
    "choose_threshold",
    "default_optimizer",
    "estimate",
    "export_model",
    "load_checkpoint",
    "load_task",
    "make_digits_task",
    "parse_progress",
    "progress_key",
    "save_checkpoint",
    "shuffled_batches",
]
