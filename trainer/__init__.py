"""Collaborative training: the ``CollaborativeOptimizer`` and its parts.

Modules:

- ``_task``: the task API (model, data stream, loss, evaluation) and ``load_task``
- ``_tasks_digits``: the built-in ``digits`` (MLP) and ``digits-cnn`` (BatchNorm CNN) tasks
- ``_checkpoint``: atomic checkpoint files and checkpoint directories
- ``_export``: the newest checkpoint's model weights as a safetensors file
- ``_progress``: progress records in the DHT, the swarm's progress estimate, and
  ``ProgressTree``, the aggregation tree that scales it to thousands of peers
- ``_progress_tracker``: ``ProgressTracker``, the service that publishes this
  peer's progress and reads the swarm's; ``expected_peers``; ``observe_progress``,
  an observer's reading (``swarm status``)
- ``_global_batch``: whether the swarm has its target batch, estimated between
  readings from the others' records and rates (``Others``)
- ``_round_timing``: ``RoundTiming``, matchmaking time and averaging timeout from measured rounds
- ``_ef21m``: ``ArcTopK`` gradient compression with EF21M error feedback
- ``_diloco``: DiLoCo mode: local inner steps, then an outer Nesterov step
- ``_dropcompute``: DropCompute: a compute threshold per step, chosen from measured times
- ``_drift``: when the lossy data plane re-synchronises parameters (bounded drift)
- ``_amp``: mixed precision: batched finiteness checks, ``GradScaler`` unscaling
- ``_offload``: the inner optimizer on float32 host masters (``offload_optimizer``)
- ``_buffers``: a model's buffers by name, plain and ``torch.compile``d alike
- ``_strategy``: the modes of the global step (dense, ARC-Top-K/EF21M, DiLoCo)
  behind one interface: what is accumulated, averaged and applied
- ``_peer_protocol``: ``TrainerPeer`` / ``SyncTrainerPeer``, what the trainer uses of a peer
- ``_optimizer``: ``AsyncCollaborativeOptimizer``, one global step per target
  batch, as an async coordinator on the peer's trio thread
- ``_sync_optimizer``: ``CollaborativeOptimizer``, its synchronous facade (a
  ``torch.optim.Optimizer``) for a training loop in its own thread
"""

from ._buffers import load_plain_state_dict, model_buffers, plain_state_dict
from ._checkpoint import Checkpoint, CheckpointDir, load_checkpoint, save_checkpoint
from ._diloco import DiLoCo
from ._drift import ResyncSchedule, diverged_fraction, kept_own_fraction, lost_fraction
from ._dropcompute import DropCompute, choose_threshold
from ._ef21m import ArcTopK
from ._export import ExportedModel, export_model
from ._global_batch import Others, others_progress
from ._optimizer import AsyncCollaborativeOptimizer, CollaborativeConfig, GlobalStep, GradHook
from ._peer_protocol import SyncTrainerPeer, TrainerPeer
from ._progress import (
    MAX_DEVICE_LABEL,
    UNKNOWN_DEVICE,
    PeerProgress,
    ProgressSummary,
    ProgressTree,
    SwarmProgress,
    device_label,
    estimate,
    parse_progress,
    progress_key,
)
from ._progress_tracker import (
    Observation,
    ProgressTracker,
    Reading,
    TrackerConfig,
    expected_peers,
    observe_progress,
)
from ._round_timing import RoundTiming, RoundTimingConfig
from ._strategy import CompressedGradients, DenseGradients, LocalSGD, Strategy, Trainee
from ._sync_optimizer import CollaborativeOptimizer
from ._task import (
    PRECISIONS,
    Task,
    builtin_task_names,
    default_optimizer,
    load_task,
    model_device,
    model_dtype,
    resolve_device,
    shuffled_batches,
    to_device,
)
from ._tasks_digits import DigitsCNN, make_digits_cnn_task, make_digits_task

__all__ = [
    "MAX_DEVICE_LABEL",
    "PRECISIONS",
    "UNKNOWN_DEVICE",
    "ArcTopK",
    "AsyncCollaborativeOptimizer",
    "Checkpoint",
    "CheckpointDir",
    "CollaborativeConfig",
    "CollaborativeOptimizer",
    "CompressedGradients",
    "DenseGradients",
    "DiLoCo",
    "DigitsCNN",
    "DropCompute",
    "ExportedModel",
    "GlobalStep",
    "GradHook",
    "LocalSGD",
    "Observation",
    "Others",
    "PeerProgress",
    "ProgressSummary",
    "ProgressTracker",
    "ProgressTree",
    "Reading",
    "ResyncSchedule",
    "RoundTiming",
    "RoundTimingConfig",
    "Strategy",
    "SwarmProgress",
    "SyncTrainerPeer",
    "Task",
    "TrackerConfig",
    "Trainee",
    "TrainerPeer",
    "builtin_task_names",
    "choose_threshold",
    "default_optimizer",
    "device_label",
    "diverged_fraction",
    "estimate",
    "expected_peers",
    "export_model",
    "kept_own_fraction",
    "load_checkpoint",
    "load_plain_state_dict",
    "load_task",
    "lost_fraction",
    "make_digits_cnn_task",
    "make_digits_task",
    "model_buffers",
    "model_device",
    "model_dtype",
    "observe_progress",
    "others_progress",
    "parse_progress",
    "plain_state_dict",
    "progress_key",
    "resolve_device",
    "save_checkpoint",
    "shuffled_batches",
    "to_device",
]
