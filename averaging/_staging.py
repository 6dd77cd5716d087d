"""Host staging: the one place where tensors cross between a device and the wire.

Everything the averaging layer sends (gradients, pseudo-gradients, parameters
and optimizer state) lives wherever the model lives: CPU, CUDA, MPS, in any
floating dtype. The wire (``_codecs``) only ever sees float32 CPU tensors.
``HostStaging`` owns one reused float32 host buffer for a fixed list of
tensors (pinned when CUDA is available, so copies can be asynchronous) and
copies the tensors into it once per global step (``to_host``) and back
(``from_host``). On CUDA the copies run on a side stream ordered after the
caller's current stream with events, never a device-wide synchronisation; on
the CPU they are plain copies, and for tensors that already are one float32
CPU vector (``float32_accumulators``' output) there is nothing to copy at all:
the host buffer is the tensors' own memory.

``float32_accumulators`` makes the accumulators the trainer adds gradients to:
float32 whatever the parameters' dtype (bf16/fp16 models lose nothing to
rounding while accumulating), on the parameters' device, back to back in one
buffer per device.

The copies block the calling thread (never the trio thread: callers run them
in the training thread or a worker thread) until the data is where it goes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarm import SwarmError


class LocalTensorError(SwarmError, ValueError):
    """A local tensor cannot go on the wire as it is (not a CPU tensor, or not
    floating point). This is a local bug or misuse, never a remote peer's
    fault: it raises in the peer that has it, and the all-reduce never counts
    it as a reducer's failure."""


def float32_accumulators(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """float32 zeros of the shapes of ``tensors``, each on its tensor's device;
    the ones of one device laid back to back in one buffer (so that a CPU
    model's accumulators are one vector the all-reduce averages in place)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for device, indices in by_device.items():
        total = sum(tensors[i].numel() for i in indices)
        buffer = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = buffer[offset : offset + n].view(tensors[i].shape)
            offset += n
    return [t for t in out if t is not None]


def _one_cpu_vector(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are float32 CPU tensors laid back to back in one storage."""
    end = storage = None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return False
        if t.numel() == 0:
            continue
        if end is None:
            storage = t.untyped_storage().data_ptr()
        elif t.data_ptr() != end or t.untyped_storage().data_ptr() != storage:
            return False
        end = t.data_ptr() + 4 * t.numel()
    return True


class HostStaging:
    """A reused float32 host copy of ``tensors`` for the wire.

    ``host`` are CPU float32 tensors of the shapes of ``tensors``, laid back to
    back in one buffer (pinned when CUDA is available and a tensor is not on
    the CPU). ``to_host`` copies ``tensors`` into them and ``from_host`` back;
    when ``tensors`` already are one float32 CPU vector, ``host`` *is*
    ``tensors`` and both are no-ops (``copies`` is False). Raises
    ``LocalTensorError`` for tensors that are not floating point.

    ``buffer`` (float32, CPU, at least as many values as ``tensors``) is used
    as the host buffer instead of new memory: several stagings that are never
    used at once may share one (``ChunkedStaging``). ``LocalTensorError`` if
    it does not fit.

    Not thread-safe: one caller at a time (the trainer's state lock or its
    single training thread).
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], *, buffer: torch.Tensor | None = None
    ) -> None:
        for t in tensors:
            if not t.is_floating_point():
                raise LocalTensorError(
                    f"only floating point tensors can be averaged, got {t.dtype} on {t.device}"
                )
        self.tensors = list(tensors)
        #: whether staging copies anything (False: ``host`` are ``tensors``)
        self.copies = not _one_cpu_vector(self.tensors)
        devices = {t.device for t in self.tensors if t.device.type != "cpu"}
        cuda = [d for d in devices if d.type == "cuda"]
        self._stream: torch.cuda.Stream | None = None
        if cuda:
            self._stream = torch.cuda.Stream(device=cuda[0])
        if not self.copies:
            self.host = self.tensors
            self.buffer = _as_vector(self.tensors)
            return
        total = sum(t.numel() for t in self.tensors)
        if buffer is not None:
            if buffer.dtype != torch.float32 or buffer.device.type != "cpu" or (
                buffer.numel() < total
            ):
                raise LocalTensorError(
                    f"a staging buffer must be float32 on the CPU with {total} values or more"
                )
            self.buffer = buffer.view(-1)[:total]
        else:
            pin = bool(devices) and torch.cuda.is_available()
            self.buffer = torch.zeros(total, dtype=torch.float32, pin_memory=pin)
        self.host = []
        offset = 0
        for t in self.tensors:
            self.host.append(self.buffer[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()

    @property
    def pinned(self) -> bool:
        return self.copies and self.buffer.is_pinned()

    def to_host(self) -> list[torch.Tensor]:
        """Copy ``tensors`` into ``host`` (converting to float32) and return
        ``host``, complete when this returns. On CUDA the copy waits for the
        work already queued on the caller's current stream, not for the device."""
        if not self.copies:
            return self.host
        with torch.no_grad():
            if self._stream is None:
                for dst, src in zip(self.host, self.tensors, strict=True):
                    dst.copy_(src)
                return self.host
            ready = torch.cuda.current_stream(self._stream.device).record_event()
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                for dst, src in zip(self.host, self.tensors, strict=True):
                    # the source must outlive the copy on the side stream
                    if src.is_cuda:
                        src.record_stream(self._stream)
                    dst.copy_(src, non_blocking=True)
                done = self._stream.record_event()
            done.synchronize()  # the host buffer is read right after: wait here
        return self.host

    def from_host(self) -> None:
        """Copy ``host`` back into ``tensors`` (converting to their dtypes).

        On CUDA the copy runs on the side stream and the caller's current stream
        waits for it (an event, not a synchronisation), so work the caller
        queues next sees the new values; this returns once the host buffer may
        be reused."""
        if not self.copies:
            return
        with torch.no_grad():
            if self._stream is None:
                for dst, src in zip(self.tensors, self.host, strict=True):
                    dst.copy_(src)
                return
            current = torch.cuda.current_stream(self._stream.device)
            self._stream.wait_stream(current)  # nobody still reads the old values
            with torch.cuda.stream(self._stream):
                for dst, src in zip(self.tensors, self.host, strict=True):
                    if dst.is_cuda:
                        dst.record_stream(self._stream)
                    dst.copy_(src, non_blocking=True)
                done = self._stream.record_event()
            current.wait_event(done)
            done.synchronize()  # the host buffer is written again next step


class ChunkedStaging:
    """``tensors`` in chunks of at most ``chunk_elements`` values, each staged
    through one reused host buffer: for a state too large to stage whole
    (parameters, optimizer state and buffers are several copies of a model),
    so that host memory holds one chunk of it, not all of it.

    Chunk k is a list of pieces: flat slices of the tensors, in order (a
    contiguous tensor may be cut across chunks; a non-contiguous one is one
    piece, whole, even if larger). ``to_host(k)`` copies chunk k into the
    buffer and returns its host pieces (float32 CPU, back to back: one vector
    for the all-reduce); ``from_host(k)`` copies them back into the tensors.
    As with ``HostStaging``, pieces that already are one float32 CPU vector are
    not copied at all. Peers that cut tensors of the same shapes with the same
    ``chunk_elements`` get the same chunks. Raises ``LocalTensorError`` for
    tensors that are not floating point, ``ValueError`` for ``chunk_elements``
    below 1. Not thread-safe.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], chunk_elements: int) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be at least 1, got {chunk_elements}")
        for t in tensors:
            if not t.is_floating_point():
                raise LocalTensorError(
                    f"only floating point tensors can be averaged, got {t.dtype} on {t.device}"
                )
        self.tensors = list(tensors)
        chunks: list[list[torch.Tensor]] = [[]]
        room = chunk_elements
        for t in self.tensors:
            if not t.is_contiguous():
                if chunks[-1]:
                    chunks.append([])
                chunks[-1].append(t)
                chunks.append([])
                room = chunk_elements
                continue
            flat, start = t.detach().view(-1), 0
            while start < flat.numel():
                if room == 0:
                    chunks.append([])
                    room = chunk_elements
                take = min(room, flat.numel() - start)
                chunks[-1].append(flat[start : start + take])
                start += take
                room -= take
        self.chunks = [c for c in chunks if c]
        largest = max((sum(p.numel() for p in c) for c in self.chunks), default=0)
        devices = {t.device for t in self.tensors if t.device.type != "cpu"}
        pin = bool(devices) and torch.cuda.is_available()
        self.buffer = torch.zeros(largest, dtype=torch.float32, pin_memory=pin)
        self._stagings = [HostStaging(c, buffer=self.buffer) for c in self.chunks]

    def __len__(self) -> int:
        return len(self.chunks)

    def to_host(self, chunk: int) -> list[torch.Tensor]:
        """Copy chunk ``chunk`` into the buffer; its host pieces (valid until
        the next ``to_host``). See ``HostStaging.to_host``."""
        return self._stagings[chunk].to_host()

    def from_host(self, chunk: int) -> None:
        """Copy chunk ``chunk``'s host pieces back into the tensors (after
        its ``to_host`` and before the next one). See ``HostStaging.from_host``."""
        self._stagings[chunk].from_host()


def _as_vector(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return torch.zeros(0, dtype=torch.float32)
    first = nonempty[0]
    total = sum(t.numel() for t in nonempty)
    return first.detach().as_strided((total,), (1,))


def require_host(tensor: torch.Tensor, what: str = "tensor") -> None:
    """Raise ``LocalTensorError`` unless ``tensor`` is a floating point CPU tensor.

    The codec boundary's check: a device tensor must pass through
    ``HostStaging`` first."""
    if tensor.device.type != "cpu":
        raise LocalTensorError(
            f"{what} is on {tensor.device}; only CPU tensors go on the wire"
            " (stage it with averaging.HostStaging)"
        )
    if not tensor.is_floating_point():
        raise LocalTensorError(f"{what} is {tensor.dtype}; only floating point tensors are sent")
