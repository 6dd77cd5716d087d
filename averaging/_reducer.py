"""Bookkeeping of the butterfly all-reduce for one part: pure code, no network.

``PartReducer`` is what reducer i keeps for part i: a weighted sum per chunk,
fed chunk by chunk and in order by each sender. Chunk c is finished when every
sender that is still alive has delivered it. A sender that fails (its stream
broke, it missed ``sender_timeout``, it sent NaN/Inf or broke the protocol) is
excluded from every chunk it has not delivered, and those chunks are averaged
over the senders that did deliver them, weights renormalised. Whatever a
failed sender delivered before failing still counts: exclusion is chunk by
chunk (DESIGN.md, "Butterfly all-reduce").

``ReceivedParts`` is the sender side: which averaged chunks came back from
which reducer. A reducer that fails leaves the chunks it did not return at the
sender's local values, which is the same as averaging them over the sender
alone, and that is how they are recorded.

Because every sender delivers in order, finished chunks always form a prefix
``[0, completed)`` of the part.

A result is always finite: a chunk whose weighted sum overflows float32
(finite values of magnitude near 3e38) has no result, and every member keeps
its local values there, as when nobody delivered it. So a member that finds
NaN or Inf in a result knows the reducer lied, and its own reducer's results
need no check.

With ``aggregation=CenteredClip(...)`` (``_robust``) a chunk's result is the
CenteredClip of its contributors' values instead of their weighted mean. It
is applied per chunk, when the chunk finishes: the clipping radius bounds
every Byzantine sender's pull on each chunk separately, so on every chunk
(and so on every part) its influence is at most the bound of ``_robust``. The
reducer must then keep each sender's copy of each unfinished chunk: at most
``senders x part size`` float32 values (a sender can run ahead of the
slowest one by the whole part), i.e. about one extra copy of the whole
averaged vector for a group of equal members; each chunk's copies are freed
as soon as it finishes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from swarm import ProtocolError

from ._codecs import all_finite
from ._robust import CenteredClip, centered_clip


class PartReducer:
    """Weighted mean of one part over its senders, finished chunk by chunk.

    ``weights`` maps each expected sender (member index) to its weight, a
    finite number >= 0. A chunk whose contributors all have weight 0 (or that
    nobody delivered) has no result: every member keeps its local values there.
    ``buffer`` (float32, at least the part's size, any contents) is used as the
    accumulator instead of new memory. ``aggregation``: None for the weighted
    mean, or ``CenteredClip`` (see the module docstring).
    """

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        weights: Mapping[int, float],
        *,
        buffer: torch.Tensor | None = None,
        aggregation: CenteredClip | None = None,
    ) -> None:
        for sender, w in weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(f"weight of sender {sender} must be finite and >= 0, got {w}")
        self.chunk_sizes = tuple(chunk_sizes)
        self._offsets = [0]
        for size in self.chunk_sizes:
            self._offsets.append(self._offsets[-1] + size)
        total = self._offsets[-1]
        if buffer is not None and (buffer.dtype != torch.float32 or buffer.numel() < total):
            raise ValueError(f"buffer must be float32 with at least {total} elements")
        # A reused buffer saves page-faulting fresh memory in every round.
        self._acc = (
            buffer.view(-1)[:total]
            if buffer is not None
            else torch.empty(total, dtype=torch.float32)
        )
        self._weights = dict(weights)
        self._weight_sum = [0.0] * len(self.chunk_sizes)
        self._contributors: list[set[int]] = [set() for _ in self.chunk_sizes]
        self._delivered = dict.fromkeys(weights, 0)
        self._alive = set(weights)
        self._has_result = [False] * len(self.chunk_sizes)
        self._aggregation = aggregation
        #: CenteredClip only: each contributor's values of each unfinished chunk
        self._held: dict[int, dict[int, torch.Tensor]] = {}
        #: Chunks ``[0, completed)`` are finished.
        self.completed = 0
        self._advance()

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sizes)

    @property
    def done(self) -> bool:
        return self.completed == self.num_chunks

    @property
    def alive(self) -> frozenset[int]:
        """Senders not excluded (yet)."""
        return frozenset(self._alive)

    @property
    def failed(self) -> frozenset[int]:
        return frozenset(self._weights) - self._alive

    def set_weight(self, sender: int, weight: float) -> None:
        """Set ``sender``'s weight (it arrives with its stream); only before it delivers."""
        if sender not in self._weights:
            raise ProtocolError(f"member {sender} is not a sender of this part")
        if self._delivered[sender]:
            raise ValueError(f"sender {sender} already delivered data with its old weight")
        if not (math.isfinite(weight) and weight >= 0):
            raise ProtocolError(f"weight of sender {sender} must be finite and >= 0, got {weight}")
        self._weights[sender] = weight

    def delivered(self, sender: int) -> int:
        """How many chunks ``sender`` has delivered (they are chunks 0..n-1)."""
        return self._delivered[sender]

    def expects(self, sender: int) -> bool:
        """Whether ``sender`` is alive and has chunks left to deliver."""
        return sender in self._alive and self._delivered[sender] < self.num_chunks

    def add(
        self, sender: int, chunk: int, values: torch.Tensor, *, finite: bool = False
    ) -> range:
        """Accumulate ``sender``'s ``chunk``; return the chunks this finished.

        Data from a sender already excluded is ignored (empty range). Raises
        ``ProtocolError`` if ``sender`` is unknown, ``chunk`` is not the next
        chunk expected from it, or ``values`` has the wrong size; the caller
        then ``fail``s that sender. Values with NaN or Inf exclude the sender
        (as ``fail`` does) instead of being added. ``finite=True``: the caller
        has already checked that every value is finite (spares a pass).
        """
        if sender not in self._weights:
            raise ProtocolError(f"member {sender} is not a sender of this part")
        if sender not in self._alive:
            return range(self.completed, self.completed)
        expected = self._delivered[sender]
        if chunk != expected:
            raise ProtocolError(f"sender {sender} sent chunk {chunk}, expected chunk {expected}")
        if values.numel() != self.chunk_sizes[chunk]:
            raise ProtocolError(
                f"chunk {chunk} has {self.chunk_sizes[chunk]} values, got {values.numel()}"
            )
        if not finite and not all_finite(values):
            return self.fail(sender)
        w = self._weights[sender]
        if w == 0:
            # weight 0 (a member that joins only to receive): its data is in
            # no result, so it is no contributor either
            self._delivered[sender] = chunk + 1
            return self._advance()
        start, end = self._offsets[chunk], self._offsets[chunk + 1]
        acc = self._acc[start:end]
        contributors = self._contributors[chunk]
        if self._aggregation is not None:
            if w > 0:  # ``values`` may be the caller's scratch memory: keep a copy
                self._held.setdefault(chunk, {})[sender] = values.reshape(-1).clone()
        elif not contributors:
            # Kept unscaled: a chunk with one contributor is then exactly its
            # values, not values * w / w. Overwriting also spares zero-filling.
            acc.copy_(values.reshape(-1))
        else:
            if len(contributors) == 1:
                (first,) = contributors
                if self._weights[first] != 1.0:  # x * 1.0 is x: spare a pass
                    acc.mul_(self._weights[first])
            acc.add_(values.reshape(-1), alpha=w)
        self._weight_sum[chunk] += w
        self._contributors[chunk].add(sender)
        self._delivered[sender] = chunk + 1
        return self._advance()

    def fail(self, sender: int) -> range:
        """Exclude ``sender`` from every chunk it has not delivered; return finished chunks."""
        self._alive.discard(sender)
        return self._advance()

    def fail_all(self, senders: Iterable[int]) -> range:
        for s in senders:
            self._alive.discard(s)
        return self._advance()

    def _advance(self) -> range:
        first = self.completed
        while self.completed < self.num_chunks and all(
            self._delivered[s] > self.completed for s in self._alive
        ):
            c = self.completed
            total = self._weight_sum[c]
            held = self._held.pop(c, {})
            if total > 0:
                acc = self._acc[self._offsets[c] : self._offsets[c + 1]]
                if self._aggregation is not None:
                    acc.copy_(self._robust(held))
                elif len(self._contributors[c]) > 1:
                    acc.div_(total)
                # One contributor's values were checked when they came; a sum
                # of finite values can still overflow (checked while in cache).
                self._has_result[c] = len(self._contributors[c]) == 1 or all_finite(acc)
            self.completed += 1
        return range(first, self.completed)

    def _robust(self, held: Mapping[int, torch.Tensor]) -> torch.Tensor:
        assert self._aggregation is not None
        senders = sorted(held)  # the same order on every run: the same bits
        if len(senders) == 1:
            return held[senders[0]]
        clip = self._aggregation
        weights = torch.tensor(
            [self._weights[s] if clip.use_weights else 1.0 for s in senders], dtype=torch.float32
        )
        values = torch.stack([held[s] for s in senders])
        return centered_clip(values, weights, clip.tau, clip.iterations)

    def held_values(self) -> int:
        """Values kept for unfinished chunks (CenteredClip only; 0 otherwise)."""
        return sum(t.numel() for chunk in self._held.values() for t in chunk.values())

    def result(self, chunk: int) -> torch.Tensor | None:
        """The weighted mean of a finished chunk (a view), or None if it has no result."""
        if chunk >= self.completed:
            raise ValueError(f"chunk {chunk} is not finished")
        if not self._has_result[chunk]:
            return None
        return self._acc[self._offsets[chunk] : self._offsets[chunk + 1]]

    def contributors(self, chunk: int) -> frozenset[int]:
        """Senders whose data is in ``chunk``'s result (empty if it has none)."""
        if not self._has_result[chunk]:
            return frozenset()
        return frozenset(self._contributors[chunk])


class ReceivedParts:
    """Which averaged chunks a member got back, and whose data is in each.

    ``num_chunks[j]`` is the number of chunks of part j. Chunks not (yet)
    received are recorded as ``{local_index}``: they hold the local values.
    """

    def __init__(self, num_chunks: Sequence[int], local_index: int) -> None:
        self.local_index = local_index
        self._received = [0] * len(num_chunks)
        self._num_chunks = tuple(num_chunks)
        self._failed: set[int] = set()
        local = frozenset({local_index})
        self._contributors: list[list[frozenset[int]]] = [[local] * n for n in num_chunks]

    def next_chunk(self, part: int) -> int:
        return self._received[part]

    def is_complete(self, part: int) -> bool:
        return self._received[part] == self._num_chunks[part]

    def received(self, part: int, chunk: int, contributors: frozenset[int]) -> None:
        """Record that ``chunk`` of ``part`` arrived, averaged over ``contributors``.

        An empty ``contributors`` means the reducer had no result for it (the
        local values stay). Raises ``ProtocolError`` if it is not the next chunk.
        """
        if part in self._failed:
            raise ValueError(f"reducer of part {part} already failed")
        expected = self._received[part]
        if chunk != expected or chunk >= self._num_chunks[part]:
            raise ProtocolError(f"reducer of part {part} sent chunk {chunk}, expected {expected}")
        if contributors:
            self._contributors[part][chunk] = contributors
        self._received[part] = chunk + 1

    def reducer_failed(self, part: int) -> None:
        """The chunks of ``part`` not received keep their local values."""
        if not self.is_complete(part):
            self._failed.add(part)

    @property
    def failed_reducers(self) -> frozenset[int]:
        return frozenset(self._failed)

    def contributors(self) -> tuple[tuple[frozenset[int], ...], ...]:
        return tuple(tuple(chunks) for chunks in self._contributors)
