"""Export a trained model out of Swarm: the newest valid checkpoint's weights as
a ``safetensors`` file, which PyTorch, JAX, Hugging Face and others load
without Swarm (and without unpickling anything).

A checkpoint holds the trainable parameters in the order of
``model.parameters()``, under their index; the task's model gives them their
names. The file holds the model's whole ``state_dict`` under its own names
(the ``_orig_mod.`` that ``torch.compile`` puts in front of them removed), so
it loads into the plain model with ``load_state_dict``. The file is written
beside its target and renamed over it, so a reader never sees a partial file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from swarm import ConfigError

from ._buffers import BUFFER_KEY, plain_name
from ._checkpoint import Checkpoint, CheckpointDir, load_checkpoint

log = logging.getLogger(__name__)

#: What ``torch.compile`` prefixes to the names of the module it wraps.
_COMPILED_PREFIX = "_orig_mod."


@dataclass(frozen=True)
class ExportedModel:
    """What ``export_model`` wrote: the file, the checkpoint's epoch, the tensors."""

    path: Path
    epoch: int
    tensors: int


def plain_state_dict(state: dict[str, object]) -> dict[str, torch.Tensor]:
    """``state`` (a model ``state_dict``) with plain names and contiguous tensors
    that share no memory, as ``safetensors`` requires.

    Raises ``ConfigError`` naming the entry for a value that is not a tensor
    and for two entries that become the same name.
    """
    plain: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        short = name.replace(_COMPILED_PREFIX, "")
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"model state entry {name!r} is a {type(value).__name__}, not a tensor: "
                "safetensors holds tensors only"
            )
        if short in plain:
            raise ConfigError(f"model state entries {name!r} and {short!r} have the same name")
        # A copy: tied weights share storage, which safetensors refuses.
        plain[short] = value.detach().to("cpu").contiguous().clone()
    return plain


def named_model_state(model: nn.Module, entries: dict[str, torch.Tensor]) -> dict[str, object]:
    """``model``'s ``state_dict`` with the values of a checkpoint's model
    ``entries``: its trainable parameters by position (``{"0": ..., "1": ...}``
    in the order of ``model.parameters()``) and its buffers by plain name
    (``BUFFER_KEY`` + name). ``model`` itself is not changed.

    Entries the checkpoint does not hold (frozen parameters, and buffers in a
    checkpoint written before buffers were saved) keep the model's values,
    with a warning naming them. Raises ``ConfigError`` if the counts or shapes
    differ (the checkpoint is of another model).
    """
    parameters = {k: v for k, v in entries.items() if not k.startswith(BUFFER_KEY)}
    buffers = {k[len(BUFFER_KEY) :]: v for k, v in entries.items() if k.startswith(BUFFER_KEY)}
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    if len(names) != len(parameters) or set(parameters) != {str(i) for i in range(len(names))}:
        raise ConfigError(
            f"the checkpoint holds {len(parameters)} parameters, the task's model "
            f"{len(names)}: pass the --task the run trained"
        )
    state: dict[str, object] = dict(model.state_dict())
    for i, name in enumerate(names):
        value, current = parameters[str(i)], state[name]
        assert isinstance(current, torch.Tensor)
        if tuple(value.shape) != tuple(current.shape):
            raise ConfigError(
                f"checkpoint parameter {i} has shape {tuple(value.shape)}, the task's {name!r} "
                f"{tuple(current.shape)}: pass the --task the run trained"
            )
        state[name] = value
    by_plain_name = {plain_name(key): key for key in state}
    for name, value in buffers.items():
        key = by_plain_name.get(name)
        current = None if key is None else state[key]
        if not isinstance(current, torch.Tensor) or current.shape != value.shape:
            raise ConfigError(
                f"checkpoint buffer {name!r} does not fit the task's model: "
                "pass the --task the run trained"
            )
        state[by_plain_name[name]] = value
    kept = sorted(set(state) - set(names) - {by_plain_name[name] for name in buffers})
    if kept:
        log.warning(
            "the checkpoint does not hold %s: exported as the model builds them", ", ".join(kept)
        )
    return state


def export_model(
    checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], model: nn.Module
) -> ExportedModel:
    """Write the weights of ``model`` (the task's, freshly built) as of the
    newest valid checkpoint in ``checkpoint_dir`` to ``out`` (safetensors),
    atomically (see ``named_model_state``).

    The file's metadata holds ``epoch`` and ``format`` ("pt"). A damaged
    checkpoint is passed over for the next older one. Raises
    ``ConfigError`` if the directory holds no valid checkpoint, if the
    checkpoint does not fit ``model``, if the model state holds something
    other than tensors, or if ``out`` cannot be written; ``out`` is then
    untouched.
    """
    from safetensors.torch import save_file

    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ConfigError(f"checkpoint directory {directory} does not exist")
    checkpoint: Checkpoint | None = None
    damaged: list[str] = []
    # Newest first, like CheckpointDir.latest, but the damaged files are named
    # in the one-line error rather than logged one by one.
    for path in reversed(CheckpointDir(directory).paths()):
        try:
            checkpoint = load_checkpoint(path)
            break
        except ConfigError:
            damaged.append(path.name)
    if checkpoint is None:
        found = f" ({len(damaged)} damaged: {', '.join(damaged)})" if damaged else ""
        raise ConfigError(f"no valid checkpoint in {directory}{found}: nothing to export")
    tensors = plain_state_dict(named_model_state(model, checkpoint.model))
    target = Path(out)
    try:
        fd, temp_name = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
        )
    except OSError as e:
        raise ConfigError(f"cannot write {target}: {e.strerror or e}") from e
    os.close(fd)
    try:
        save_file(tensors, temp_name, metadata={"format": "pt", "epoch": str(checkpoint.epoch)})
        os.replace(temp_name, target)
    except OSError as e:
        raise ConfigError(f"cannot write {target}: {e.strerror or e}") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
    return ExportedModel(target, checkpoint.epoch, len(tensors))
