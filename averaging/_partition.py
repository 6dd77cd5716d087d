"""Cutting the averaged vector into parts and chunks: pure, deterministic code.

Butterfly all-reduce (DESIGN.md; Ryabinin et al. 2021, sec. 3.1) gives member i
part i of the flattened vector to reduce. Parts are sized in proportion to each
member's measured upload rate, or, when some member that reduces has none, to
each member's declared bandwidth (``part_weights``), so a fast link reduces
more; client-mode members get a part of size 0. Every member must compute the
same boundaries from the same ``Group``, so the arithmetic is exact: weights
become exact fractions (``fractions.Fraction`` of a float is exact) and the
remainder of the integer division goes to the largest fractional remainders,
ties to the lower index.

Around the ring (``AllReduceConfig.ring``) parts are cut equal where the
members' weights are alike within ``RING_UPLOAD_SPREAD`` (``part_weights``):
the ring runs only on parts alike within 1% (``_ring.ring_eligible``), and
measured uploads of equal links are never that close.

A part is streamed in chunks of ``chunk_elements`` elements (the last chunk of
a part may be shorter), so that sending, reducing and receiving overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from ._group import Group, GroupMember, MemberMode
from ._staging import require_host

#: Around the ring, a group whose smallest weight is at least this share of
#: its largest cuts equal parts. Every link of a ring carries 2(n-1)/n of
#: the vector whatever the parts, so equal parts run at the slowest uplink's
#: pace; the butterfly with proportional parts runs near the links' mean
#: rate. At 4 peers, one at 90% of the others' upload, the ring's link limit
#: is 1.083x the butterfly's (``benchmarks/allreduce.py``'s ``link_bound``),
#: about the ring's lead on 100 Mbit/s links unpaced (85-90% of the link
#: against 79-82%: 1.087x mid to mid); nearer, the ring wins. On equal
#: links the uploads the peers measure are 0.90-0.98 of each other (one
#: launch of the benchmark), so a closer bound (95%) left the ring to one
#: round in four there. Measured uploads are unpaced (pacing needs a
#: declared rate), which is where that lead holds; paced, the two are alike
#: (93% against 92-94%), and equal declared rates cut equal parts anyway.
RING_UPLOAD_SPREAD = 0.90


def part_weights(members: Sequence[GroupMember], *, ring: bool = False) -> list[float]:
    """The weights parts are cut in proportion to: one rule every member applies
    to the same ``Group``.

    Members that reduce (not client-mode, declared bandwidth > 0) weigh their
    measured upload rate (or the one they declared in bytes per second,
    ``AveragerConfig.upload_rate``) when every one of them published one, and their
    declared bandwidth otherwise; the others weigh 0. Upload, not the smaller
    of upload and download, because the download a member measures is bounded
    by the uploads of those sending to it (``_link_meter``). A member
    that declares its bandwidth publishes no measurement, so a declaration
    anywhere in the group makes the whole group use declared shares (the
    units of the two do not mix).

    With ``ring`` (the round would run around the ring), a group of two or
    more nodes whose weights are alike within ``RING_UPLOAD_SPREAD`` weighs
    every member 1: on such links the ring with equal parts beats the
    butterfly with proportional ones, and equal parts are what lets the ring
    run (``_ring.ring_eligible``).
    """
    weights = _proportional_weights(members)
    if ring and _alike_for_ring(members, weights):
        return [1.0] * len(members)
    return weights


def _proportional_weights(members: Sequence[GroupMember]) -> list[float]:
    reducing = [m.mode is not MemberMode.CLIENT and m.bandwidth > 0 for m in members]
    if any(reducing) and all(m.upload > 0 for m, r in zip(members, reducing, strict=True) if r):
        return [m.upload if r else 0.0 for m, r in zip(members, reducing, strict=True)]
    return [m.bandwidth for m in members]


def ring_members(members: Sequence[GroupMember]) -> bool:
    """Whether a ring could go round ``members``: two or more, each a node
    (one that accepts connections and has data)."""
    return len(members) >= 2 and all(m.mode is MemberMode.NODE for m in members)


def _alike_for_ring(members: Sequence[GroupMember], weights: Sequence[float]) -> bool:
    """Whether a ring could serve ``members`` (``ring_members``) and their
    ``weights`` are all positive and within ``RING_UPLOAD_SPREAD``."""
    return (
        ring_members(members)
        and min(weights) > 0
        and min(weights) >= RING_UPLOAD_SPREAD * max(weights)
    )


def part_sizes(total: int, bandwidths: Sequence[float], modes: Sequence[MemberMode]) -> list[int]:
    """Split ``total`` elements into one part per member, proportional to bandwidth.

    Client-mode members and members with bandwidth 0 get 0 elements. The sizes
    sum to ``total``. Raises ``ValueError`` if ``total`` is negative, the
    sequences differ in length, or no member can take a part while ``total > 0``.
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    if len(bandwidths) != len(modes):
        raise ValueError("one bandwidth and one mode per member")
    shares = [
        Fraction(b) if mode is not MemberMode.CLIENT and b > 0 else Fraction(0)
        for b, mode in zip(bandwidths, modes, strict=True)
    ]
    denominator = sum(shares, Fraction(0))
    if denominator == 0:
        if total == 0:
            return [0] * len(shares)
        raise ValueError("no member can reduce a part (all are client-mode or have bandwidth 0)")
    exact = [total * s / denominator for s in shares]
    sizes = [int(x) for x in exact]  # floor: every x >= 0
    remainder = total - sum(sizes)
    # Largest remainder first, ties to the lower index: the same on every member.
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:remainder]:
        sizes[i] += 1
    return sizes


@dataclass(frozen=True)
class Partition:
    """Part and chunk boundaries of one flattened vector for one group."""

    total: int
    part_bounds: tuple[tuple[int, int], ...]
    chunk_elements: int

    @classmethod
    def for_group(
        cls, group: Group, total: int, chunk_elements: int, *, ring: bool = False
    ) -> Partition:
        """The parts of ``group`` (``part_weights``; ``ring``: the round
        would run around the ring, if the parts allow)."""
        if chunk_elements < 1:
            raise ValueError("chunk_elements must be >= 1")
        weights = part_weights(group.members, ring=ring)
        sizes = part_sizes(total, weights, [m.mode for m in group.members])
        bounds: list[tuple[int, int]] = []
        start = 0
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        return cls(total, tuple(bounds), chunk_elements)

    def part_size(self, part: int) -> int:
        start, end = self.part_bounds[part]
        return end - start

    def num_chunks(self, part: int) -> int:
        return -(-self.part_size(part) // self.chunk_elements)

    def chunk_sizes(self, part: int) -> list[int]:
        size, step = self.part_size(part), self.chunk_elements
        return [min(step, size - start) for start in range(0, size, step)]

    def chunk_bounds(self, part: int, chunk: int) -> tuple[int, int]:
        """Bounds of ``chunk`` within ``part``, relative to the start of the part."""
        start = chunk * self.chunk_elements
        return start, min(start + self.chunk_elements, self.part_size(part))


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float32 vector holding ``tensors`` in order.

    If the tensors already are one vector (float32, contiguous, each starting
    where the one before ends in the same memory: a single such tensor, or
    ``flat_zeros_like``'s), the result is a view of them: no copy, and writing
    the vector writes the tensors. Otherwise it is a new vector, and
    ``unflatten_into`` copies it back. Raises ``LocalTensorError`` (a
    ``ValueError``) for tensors that are not floating point CPU tensors: the
    all-reduce then fails in this peer before anything is sent.
    """
    for t in tensors:
        require_host(t, "an averaged tensor")
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    view = _as_one_vector(tensors)
    if view is not None:
        return view
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _as_one_vector(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The vector that ``tensors`` are, laid back to back in one storage, if they are."""
    first: torch.Tensor | None = None  # the first that holds a value
    storage = end = 0
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous():
            return None
        if t.numel() == 0:  # holds nothing, and its address may be anything
            continue
        if first is None:
            first, storage, end = t, t.untyped_storage().data_ptr(), t.data_ptr()
        elif t.data_ptr() != end or t.untyped_storage().data_ptr() != storage:
            return None
        end += 4 * t.numel()
    if first is None:
        return torch.zeros(0, dtype=torch.float32)
    return first.detach().as_strided(((end - first.data_ptr()) // 4,), (1,))


def flat_zeros_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros of the shapes and dtypes of ``tensors``; float32 ones laid back to
    back in one buffer.

    ``flatten`` of float32 ones is then a view, so ``all_reduce`` and
    ``Averager`` average them in place, without copying them into a new
    vector and back each round. For 25M values in 200 tensors that is a
    quarter less CPU per round and 180 MiB less peak memory per peer
    (``benchmarks/allreduce.py`` against ``--split 200``). If any tensor is of
    another dtype, each gets its own zeros, which are copied.
    """
    if any(t.dtype != torch.float32 for t in tensors):
        return [torch.zeros_like(t) for t in tensors]
    buffer = torch.zeros(sum(t.numel() for t in tensors), dtype=torch.float32)
    views, offset = [], 0
    for t in tensors:
        views.append(buffer[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return views


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write ``flat`` back into ``tensors`` in place (a no-op if ``flat`` is their view).

    Raises ``ValueError`` if the sizes do not match.
    """
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"vector has {flat.numel()} elements, tensors hold {total}")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            piece = flat[offset : offset + n]
            if piece.data_ptr() != t.data_ptr() or t.dtype != torch.float32:
                t.copy_(piece.view(t.shape))
            offset += n
