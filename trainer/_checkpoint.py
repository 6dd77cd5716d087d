"""Checkpoint files: atomic, pickle-free snapshots of a peer's training state.

A checkpoint holds the model, optimizer and scheduler ``state_dict``\\ s, the
epoch (global optimizer steps of the swarm) and free-form metadata. It is
written to a temporary file in the target directory, flushed and fsynced, then
renamed over the target with ``os.replace`` and the directory fsynced: a reader
sees the previous complete file or the new complete file, never a partial one,
even if the writer is killed mid-write. A trailing CRC-32 catches a file that
was damaged afterwards (a partial copy, a bad disk).

File layout (all integers little-endian)::

    b"SWARMCK1"                  magic and format version
    u32 header_size
    header                       msgpack: state_header, {"skeleton": ..., "tensors": [spec, ...]}
    tensor data                  each tensor's raw bytes, in spec order
    u32 crc32                    of every byte before it

The header is the ``flatten_state`` split of the state (see ``_state``), so the
same encoding serves the state transfer between peers. Loading never unpickles.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from swarm._errors import ConfigError, ProtocolError
from swarm._state import (
    flatten_state,
    parse_state_header,
    state_header,
    tensor_from_bytes,
    tensor_to_bytes,
    unflatten_state,
)
from swarm._wire import pack, unpack

from ._buffers import load_plain_state_dict, plain_state_dict

logger = logging.getLogger(__name__)

MAGIC = b"SWARMCK1"
#: Largest header a checkpoint may have (the skeleton and one spec per tensor).
MAX_HEADER_SIZE = 64 * 2**20
_U32 = struct.Struct("<I")
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)\.swarm$")
# save_checkpoint's temporary files for checkpoint-<epoch>.swarm, see _temp_prefix.
_CHECKPOINT_TEMP_NAME = re.compile(r"^\.checkpoint-\d+\.swarm\..*\.tmp$")
_TEMP_SUFFIX = ".tmp"
_FIELDS = {"epoch", "model", "optimizer", "scheduler", "extra"}


@dataclass(frozen=True)
class Checkpoint:
    """One peer's training state at the end of ``epoch`` global optimizer steps.

    ``model``, ``optimizer`` and ``scheduler`` are ``state_dict()``\\ s; ``extra``
    is metadata such as the run id or samples seen (anything ``flatten_state``
    accepts: scalars, strings, lists, dicts, tensors). The tensors are not copied:
    capture a checkpoint and save it before training changes them.
    """

    epoch: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"checkpoint epoch must be an integer >= 0, got {self.epoch!r}")
        for name in ("model", "optimizer", "extra"):
            if not isinstance(getattr(self, name), dict):
                raise ConfigError(f"checkpoint {name} must be a dict (a state_dict)")
        if self.scheduler is not None and not isinstance(self.scheduler, dict):
            raise ConfigError("checkpoint scheduler must be a state_dict or None")

    @classmethod
    def capture(
        cls,
        epoch: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Checkpoint:
        """The current state of ``model``, ``optimizer`` and ``scheduler`` (shared,
        not copied). The model's keys are plain: a ``torch.compile``d model's
        ``_orig_mod.`` prefixes are cut, so the checkpoint fits either kind."""
        return cls(
            epoch=epoch,
            model=plain_state_dict(dict(model.state_dict())),
            optimizer=optimizer.state_dict(),
            scheduler=None if scheduler is None else scheduler.state_dict(),
            extra={} if extra is None else dict(extra),
        )

    def restore(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> None:
        """Load this state into ``model``, ``optimizer`` and ``scheduler``.

        Raises ``ConfigError`` if the checkpoint has a scheduler state and no
        scheduler is given or the reverse, and whatever torch raises when a
        state_dict does not fit (``RuntimeError``, ``ValueError``, ``KeyError``).
        A plain model's checkpoint restores into a ``torch.compile``d one and
        the reverse.
        """
        if (scheduler is None) != (self.scheduler is None):
            have = "has" if self.scheduler is not None else "has no"
            raise ConfigError(f"the checkpoint {have} scheduler state, the task does not match")
        load_plain_state_dict(model, self.model)
        optimizer.load_state_dict(self.optimizer)
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(self.scheduler)

    def _tree(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "extra": self.extra,
        }


def save_checkpoint(path: str | os.PathLike[str], checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` to ``path`` atomically and durably.

    When this returns the file is complete and on disk. If it raises (or the
    process dies) a file that was at ``path`` before is untouched and no partial
    file is left under ``path``; the temporary file is removed unless the process
    was killed (``CheckpointDir`` sweeps those up). Raises ``TypeError`` for state
    that cannot be stored and ``OSError`` for I/O failures.
    """
    target = Path(path)
    flat = flatten_state(checkpoint._tree())
    header = pack(state_header(flat), max_size=MAX_HEADER_SIZE)
    fd, temp_name = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=_TEMP_SUFFIX, dir=target.parent
    )
    try:
        with os.fdopen(fd, "wb") as file:
            writer = _ChecksumWriter(file)
            writer.write(MAGIC)
            writer.write(_U32.pack(len(header)))
            writer.write(header)
            for tensor in flat.tensors:
                writer.write(tensor_to_bytes(tensor))
            file.write(_U32.pack(writer.crc))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    _fsync_directory(target.parent)


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read the checkpoint at ``path``.

    Raises ``ConfigError`` (naming the file, with the cause chained) if it is
    missing, unreadable, truncated, damaged or not a checkpoint. Never unpickles.
    """
    source = Path(path)
    try:
        with source.open("rb") as file:
            return _read(file, os.fstat(file.fileno()).st_size)
    except OSError as e:
        raise ConfigError(f"cannot read checkpoint {source}: {e}") from e
    except ProtocolError as e:
        raise ConfigError(f"checkpoint {source} is damaged ({e}): delete it") from e


def _read(file: IO[bytes], size: int) -> Checkpoint:
    reader = _ChecksumReader(file)
    if reader.read(len(MAGIC)) != MAGIC:
        raise ProtocolError("not a swarm checkpoint (bad magic)")
    (header_size,) = _U32.unpack(reader.read(_U32.size))
    if header_size > MAX_HEADER_SIZE:
        raise ProtocolError(f"header of {header_size} bytes exceeds {MAX_HEADER_SIZE}")
    header = unpack(reader.read(header_size), max_size=MAX_HEADER_SIZE)
    skeleton, specs = parse_state_header(header, max_total_bytes=size)
    expected = len(MAGIC) + _U32.size + header_size + sum(s.nbytes for s in specs) + _U32.size
    if expected != size:
        raise ProtocolError(f"file is {size} bytes, its header implies {expected}")
    tensors = [tensor_from_bytes(spec, reader.read_into_new(spec.nbytes)) for spec in specs]
    crc = reader.crc
    (stored_crc,) = _U32.unpack(reader.read(_U32.size))
    if crc != stored_crc:
        raise ProtocolError("checksum mismatch")
    tree = unflatten_state(skeleton, tensors)
    if not isinstance(tree, dict) or set(tree) != _FIELDS:
        raise ProtocolError("the state is not a checkpoint")
    try:
        return Checkpoint(**tree)
    except ConfigError as e:
        raise ProtocolError(str(e)) from e


class _ChecksumWriter:
    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.crc = 0

    def write(self, data: bytes) -> None:
        self.crc = zlib.crc32(data, self.crc)
        self._file.write(data)


class _ChecksumReader:
    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.crc = 0

    def read(self, size: int) -> bytes:
        data = self._file.read(size)
        if len(data) != size:
            raise ProtocolError("file is truncated")
        self.crc = zlib.crc32(data, self.crc)
        return data

    def read_into_new(self, size: int) -> bytearray:
        buffer = bytearray(size)
        if self._file.readinto(buffer) != size:  # type: ignore[attr-defined]
            raise ProtocolError("file is truncated")
        self.crc = zlib.crc32(buffer, self.crc)
        return buffer


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CheckpointDir:
    """A directory of numbered checkpoints, newest kept, oldest pruned.

    Files are named ``checkpoint-<epoch>.swarm``. One peer writes a directory;
    two peers sharing one would overwrite each other's files.
    """

    directory: Path
    keep: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep must be an integer >= 1 checkpoints, got {self.keep!r}")
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"checkpoint directory {self.directory} is not a directory")

    def path_for(self, epoch: int) -> Path:
        return self.directory / f"checkpoint-{epoch:010d}.swarm"

    def paths(self) -> list[Path]:
        """Complete checkpoint files, oldest epoch first (temporary files are ignored)."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _CHECKPOINT_NAME.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
        return [p for _, p in sorted(found)]

    def save(self, checkpoint: Checkpoint) -> Path:
        """Write ``checkpoint`` atomically, then delete all but the newest ``keep`` files.

        Also removes temporary files that a killed writer left behind. Returns
        the path written. Raises like ``save_checkpoint``.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        for entry in self.directory.iterdir():
            if _CHECKPOINT_TEMP_NAME.match(entry.name):
                with contextlib.suppress(OSError):
                    entry.unlink()
        path = self.path_for(checkpoint.epoch)
        save_checkpoint(path, checkpoint)
        for old in self.paths()[: -self.keep]:
            with contextlib.suppress(OSError):
                old.unlink()
        return path

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that loads, or ``None`` if there is none.

        A damaged file (which atomic writes alone cannot cause; a bad disk or a
        partial copy can) is logged and skipped in favour of the next older one.
        """
        for path in reversed(self.paths()):
            try:
                return load_checkpoint(path)
            except ConfigError as e:
                logger.warning("skipping checkpoint: %s", e)
        return None
