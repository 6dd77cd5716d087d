"""ARC-Top-K: Top-K compression that a group can all-reduce without indices.

Chen, Ma, Li, He, Dong, Yuan, "An All-Reduce Compatible Top-K Compressor for
Communication-Efficient Distributed Learning" (2025, arXiv:2510.26709): the
ARC-Top-K compressor and its contraction property are in the section that
introduces the compressor, its pairing with EF21M error feedback in the
convergence section (see ``trainer._ef21m``).

Plain Top-K cannot be all-reduced: each peer keeps different coordinates, so
peers must exchange (value, index) pairs with an all-gather. ARC-Top-K makes
every member of a group keep the *same* rows:

1. Every tensor of two or more dimensions is viewed as a matrix of dimension
   0 by the rest flattened (as the paper does for convolution kernels), and
   ``X`` (``n x m``, ``matrix_shape``) is that matrix or its transpose,
   whichever has more rows: ``n >= m``. 0-D and 1-D tensors (biases, norms)
   go dense. Rows along the longer side make the selection finer: a
   classifier head of 10 x 128 keeps, at ``rho = 0.1``, 13 of its 128 input
   columns rather than 1 of its 10 classes (the whole head for one class per
   step). On digits (``benchmarks/arctopk_digits.py``, rho 0.1, 5 seeds) this
   raised the accuracy from 0.820 to 0.861 after 30 epochs and from 0.921 to
   0.944 after 100 (dense: 0.943, 0.979); always transposing did worse
   (0.796 after 30). (Measured before the cap of step 2.)
   The sketch costs ``n * r`` elements, so this orientation sends more sketch
   for a wide, short matrix; step 2 caps ``r`` for such matrices.
2. Every member draws the same Gaussian projection ``V`` (``m x r``, ``r``
   small: ``sketch_rank``, the configured rank capped at ``rho * m``) from a
   ``torch.Generator`` seeded by the group id and the step (``projection_seed``;
   never the global generator), and sketches ``P = X V``.
3. The group all-reduces the sketches (``n x r`` each: small). By linearity
   the mean of the sketches is the sketch of the mean, ``mean(X) V``.
4. Every member ranks rows by the squared norm of the *averaged* sketch and
   keeps the top ``k = ceil(rho * n)`` rows (``select_rows``): the members
   hold the same bits of the averaged sketch (the all-reduce hands every
   member the reducer's result), so they choose the same rows.
5. The values of those rows, plus the dense tensors, travel through a second
   all-reduce, with no indices, and are scattered back into place
   (``RowSelection``); all other rows of the compressed tensor are zero.

Bytes. A matrix ``n x m`` sends ``n * r`` sketch and ``k * m`` value
elements (``payload_elements``). With ``r <= rho * m`` (``sketch_rank``) the
sketch is never larger than the values, so a compressed step sends at most
``2 * k * m``, about ``2 * rho`` of the matrix, and in FLOAT16 about ``rho``
of its dense float32 bytes: "rho 0.1 sends a tenth of the bytes" holds for
every matrix up to the rounding of ``k``, whatever its shape. Without the
cap a wide, short matrix pays for its fine selection in sketch: the digits
head (10 x 128, rows along the 128 side) at ``rho = 0.1`` and rank 4 sent
512 sketch for 130 values, and the step 11.1% of dense's bytes instead of
9.1% (``benchmarks/arctopk_digits.py``). The cap only touches matrices with
fewer than ``rank / rho`` columns; their rows are short, so a rank as small
as 1 still ranks them, if less sharply (the selection is exact Top-K in the
sketch space and the contraction bound below holds for every ``V``). What
that cost on digits (``--peers 4 --target 4096 --epochs 20 --seeds 5``, the
setting of ``benchmarks/compression.py``): rho 0.1 reached 0.841 with the
cap (head rank 1, 9.1% of dense's bytes), 0.855 with rank 2 for the head
(9.7%) and 0.867 uncapped (11.1%); rho 0.2 reached 0.906 with the cap (head
rank 2, 14.7%) and 0.897 uncapped (16.1%); dense 0.945. The seeds spread
over about 0.06, so these differences are within two spreads.

Both all-reduces may use an element-wise codec (``ArcTopKRound.codec``: NONE
or FLOAT16; ``trainer.ArcTopK`` defaults to FLOAT16). The reducer of each
part decodes the re-encoded mean itself, so every member still holds the same
bits of the averaged sketch (step 4), and each member rounds its own values
before sending (``on_the_wire``), so it knows exactly what it contributed.

When to use it: peers behind slow links (home connections of 10-100 Mbit/s)
training models whose gradients are dominated by large matrices (linear and
convolution layers), where the dense all-reduce is the bottleneck. It costs
two all-reduce round trips instead of one, so on fast links or with tiny
models the latency of the extra round outweighs the bytes saved. Use it with
error feedback (EF21M in ``trainer``), never on raw gradients: the rows left
out are carried over to later steps by the error feedback.

Contraction (what ``contraction_bound`` returns, proven here). Let ``x`` be
the vector the selection is computed for (the group's mean: step 3), one of
its matrices ``X`` with rows ``x_i``, sketch rows ``p_i = x_i V`` and
distortions ``d_i = ||p_i||^2 / ||x_i||^2`` (rows with ``x_i = 0`` have
``p_i = 0`` and drop out of every sum below). ``S`` holds the ``k`` rows of
largest ``||p_i||``, so their mean sketch energy is at least the mean over
all rows: ``sum_S ||p_i||^2 >= (k/n) ||P||^2``. Since ``||x_i||^2 >= ||p_i||^2
/ max_j d_j``::

    ||X - C(X)||^2 = ||X||^2 - sum_S ||x_i||^2 <= (1 - alpha_X) ||X||^2,
    alpha_X = (k / n) * ||P||^2 / (max_j d_j * ||X||^2)

``||P||^2 / ||X||^2`` is the energy-weighted mean distortion, so ``alpha_X``
is ``k/n`` (exact Top-K's guarantee for rows) scaled by mean over maximum
distortion: close to ``k/n`` when the projection preserves row norms evenly,
and never negative. Dense tensors have ``alpha = 1`` and the whole vector
``alpha = min`` over its tensors. This holds for every ``V``, deterministically
(the paper's contraction statement is about its random projection; this
module claims only the bound above, which the tests check). In the sketch
space the selection is exact Top-K: ``||(X - C(X)) V||^2 <= (1 - k/n) ||X
V||^2``. With ``rho = 1`` every row is kept: ``C(x) = x`` and ``alpha = 1``.

The bound is for the group's mean ``x``, which is what the group uses: under
one selection ``C`` is linear, so the mean of the members' ``C(x_j)`` (the
value all-reduce) is ``C(mean x_j)``. The selection comes from the averaged
float32 sketch, the sketch of the mean up to float32 rounding.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm import ConfigError

from ._averager import Averager, StepResult
from ._codecs import NONE, Codec, CodecKind
from ._group import Group

#: Largest projection rank: the sketch is meant to be a small fraction of the
#: gradient (the paper uses a handful of columns).
MAX_RANK = 1024
#: The version of the selection rule, part of every digest: peers that select
#: rows differently must never average values together.
_RULE = b"arctopk-v2"


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """``(rows, columns)`` of the matrix view of a tensor, or None for 0-D/1-D.

    The tensor is first viewed as ``shape[0] x (the rest flattened)``; rows
    run along the longer side of that (``rows >= columns``; module
    docstring, step 1).
    """
    if len(shape) < 2:
        return None
    first, rest = int(shape[0]), math.prod(int(s) for s in shape[1:])
    return (first, rest) if first >= rest else (rest, first)


def _transposed(shape: Sequence[int]) -> bool:
    """Do the rows of the matrix view run along the flattened trailing dimensions?"""
    view = matrix_shape(shape)
    return view is not None and view[0] != int(shape[0])


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """The ``matrix_shape`` view of a tensor of two or more dimensions (may be
    a transposed view, not a copy)."""
    m = t.reshape(t.shape[0], -1)
    return m.t() if _transposed(t.shape) else m


def from_matrix(matrix: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Undo ``as_matrix``: ``matrix`` (``matrix_shape(shape)``) as a tensor of ``shape``."""
    if _transposed(shape):
        matrix = matrix.t()
    return matrix.reshape(tuple(shape))


def kept_rows(rho: float, rows: int) -> int:
    """``k = ceil(rho * n)``, at least 1 and at most ``n``.

    ``rho * n`` is rounded to 9 decimals first, so that ``0.1 * 30`` keeps 3
    rows, not 4.
    """
    return max(1, min(rows, math.ceil(round(rho * rows, 9))))


def check_parameters(rho: float, rank: int) -> None:
    """``ConfigError`` unless ``0 < rho <= 1`` and ``1 <= rank <= MAX_RANK``."""
    if not (math.isfinite(rho) and 0 < rho <= 1):
        raise ConfigError(f"rho={rho} must be in (0, 1]: the fraction of rows kept per matrix")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ConfigError(
            f"rank={rank!r} must be an integer in [1, {MAX_RANK}] (columns of the projection;"
            " a few suffice to rank rows)"
        )


#: Codecs a round may use: element-wise ones, whose decoded value a sender
#: knows exactly before it sends (``on_the_wire``). Error feedback must add
#: to a peer's estimate exactly the ``c`` the group averaged; a block-quantized
#: codec's error depends on how the all-reduce cuts the vector into chunks.
ELEMENTWISE_CODECS = (CodecKind.NONE, CodecKind.FLOAT16)
#: Largest finite float16 magnitude: values beyond it are clamped, not sent as Inf.
FLOAT16_MAX = 65504.0


def check_codec(codec: Codec) -> None:
    """``ConfigError`` unless ``codec`` is element-wise (NONE or FLOAT16)."""
    if not isinstance(codec, Codec) or codec.kind not in ELEMENTWISE_CODECS:
        raise ConfigError(
            f"codec={codec!r}: ARC-Top-K sends its sketch and values with NONE or FLOAT16 only"
            " (error feedback needs to know the exact values it sent; block-quantized codecs"
            " round differently depending on the all-reduce's chunks)"
        )


def on_the_wire(values: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``values`` (float32) as every member decodes them after ``codec``, a new tensor.

    FLOAT16 rounds to half precision and first clamps to +-65504: a value
    beyond it would otherwise travel as Inf and fail its sender's whole chunk
    (error feedback keeps what the clamp cut off). Encoding the result again
    is exact, so the all-reduce delivers these very bits.
    """
    check_codec(codec)
    x = values.detach().to(torch.float32)
    if codec.kind is CodecKind.NONE:
        return x.clone()
    return x.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16).to(torch.float32)


def payload_elements(shapes: Sequence[Sequence[int]], rho: float, rank: int) -> tuple[int, int]:
    """``(sketch, values)``: the elements each member contributes to the sketch
    all-reduce and to the value all-reduce for tensors of ``shapes``.

    A matrix ``n x m`` costs ``n * sketch_rank(rho, rank, m)`` sketch and ``kept_rows(rho, n) * m``
    value elements, a dense tensor all its elements; the dense all-reduce
    would carry ``sum(n * m)``. Exact, from the shapes alone.
    """
    check_parameters(rho, rank)
    sketched = values = 0
    for shape in shapes:
        view = matrix_shape(shape)
        if view is None:
            values += math.prod(int(s) for s in shape)
        else:
            sketched += view[0] * sketch_rank(rho, rank, view[1])
            values += kept_rows(rho, view[0]) * view[1]
    return sketched, values


def projection_seed(group_id: bytes, step: int) -> int:
    """The seed of the projection every member of ``group_id`` draws at ``step``."""
    digest = hashlib.blake2b(
        struct.pack("<Q", step) + group_id, digest_size=8, person=b"swarm.arctopk"
    ).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sketch_rank(rho: float, rank: int, columns: int) -> int:
    """Columns of the projection of a matrix with ``columns`` columns:
    ``min(rank, floor(rho * columns))``, at least 1.

    The sketch (``n x r``) then never holds more elements than the values the
    selection keeps (about ``rho * n * m``), so a compressed matrix costs at
    most about ``2 * rho`` of its dense elements, and in FLOAT16 about ``rho``
    of its dense float32 bytes (module docstring, "Bytes"). ``rho * columns``
    is rounded to 9 decimals first, so that ``0.1 * 10`` gives 1.
    """
    return max(1, min(rank, math.floor(round(rho * columns, 9))))


def projections(
    shapes: Sequence[Sequence[int]], seed: int, rank: int, rho: float
) -> list[torch.Tensor | None]:
    """One Gaussian ``m x sketch_rank(rho, rank, m)`` float32 projection per
    matrix tensor (None for dense ones), all drawn in order from one
    generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    result: list[torch.Tensor | None] = []
    for shape in shapes:
        view = matrix_shape(shape)
        if view is None:
            result.append(None)
        else:
            r = sketch_rank(rho, rank, view[1])
            result.append(torch.randn(view[1], r, generator=generator, dtype=torch.float32))
    return result


def sketch(
    tensors: Sequence[torch.Tensor], projected: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """``X V`` (``n x r``, float32) for every matrix tensor, in order; dense
    tensors have no sketch."""
    out = []
    for t, v in zip(tensors, projected, strict=True):
        if v is not None:
            out.append(as_matrix(t.detach()).to(torch.float32) @ v)
    return out


def row_scores(averaged: torch.Tensor) -> torch.Tensor:
    """Squared row norms of a sketch, summed column by column.

    Element-wise float32 operations are correctly rounded, so equal sketch bits
    give equal scores on every machine (a reduction kernel might add in
    another order on another CPU).
    """
    scores = torch.zeros(averaged.shape[0], dtype=torch.float32)
    for column in averaged.to(torch.float32).unbind(dim=1):
        scores = scores + column * column
    return scores


@dataclass(frozen=True)
class RowSelection:
    """The rows each tensor keeps: sorted row indices, or None for a dense tensor.

    Pure bookkeeping: ``gather`` packs the kept values into one vector (the
    payload of the all-reduce, the same layout on every member), ``scatter``
    puts such a vector back into tensors of the original shapes, zero outside
    the kept rows.
    """

    shapes: tuple[torch.Size, ...]
    rows: tuple[torch.Tensor | None, ...]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.rows):
            raise ValueError("one row set per tensor")
        for shape, rows in zip(self.shapes, self.rows, strict=True):
            if (matrix_shape(shape) is None) != (rows is None):
                raise ValueError(f"rows must be given exactly for matrix tensors ({shape})")

    @classmethod
    def dense(cls, shapes: Sequence[torch.Size]) -> RowSelection:
        """Every row of every tensor (what ``rho = 1`` selects)."""
        rows = []
        for shape in shapes:
            view = matrix_shape(shape)
            rows.append(None if view is None else torch.arange(view[0]))
        return cls(tuple(shapes), tuple(rows))

    def numel(self) -> int:
        """Elements of the gathered vector."""
        total = 0
        for shape, rows in zip(self.shapes, self.rows, strict=True):
            view = matrix_shape(shape)
            total += math.prod(shape) if view is None or rows is None else len(rows) * view[1]
        return total

    def digest(self) -> bytes:
        """16 bytes naming exactly this selection (and the selection rule)."""
        h = hashlib.blake2b(_RULE, digest_size=16)
        for shape, rows in zip(self.shapes, self.rows, strict=True):
            h.update(struct.pack(f"<{len(shape) + 1}q", len(shape), *shape))
            if rows is not None:
                h.update(rows.to(torch.int64).numpy().astype("<i8").tobytes())
        return h.digest()

    def gather(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The kept values of ``tensors`` (shaped as ``shapes``) as one float32 vector."""
        pieces = []
        for t, shape, rows in zip(tensors, self.shapes, self.rows, strict=True):
            if t.shape != shape:
                raise ValueError(f"tensor of shape {tuple(t.shape)}, expected {tuple(shape)}")
            flat = t.detach().to(torch.float32)
            if rows is None:
                pieces.append(flat.reshape(-1))
            else:
                pieces.append(as_matrix(flat).index_select(0, rows).reshape(-1))
        if not pieces:
            return torch.zeros(0, dtype=torch.float32)
        return torch.cat(pieces)

    def scatter(self, values: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
        """Write ``values`` (from ``gather``) into ``out`` in place: kept rows
        get their values, every other row of a matrix tensor becomes zero."""
        if values.numel() != self.numel():
            raise ValueError(f"{values.numel()} values, the selection holds {self.numel()}")
        offset = 0
        with torch.no_grad():
            for t, shape, rows in zip(out, self.shapes, self.rows, strict=True):
                if t.shape != shape:
                    raise ValueError(f"tensor of shape {tuple(t.shape)}, expected {tuple(shape)}")
                if rows is None:
                    n = math.prod(shape)
                    t.copy_(values[offset : offset + n].view(shape))
                else:
                    view = matrix_shape(shape)
                    assert view is not None  # __post_init__: rows only for matrices
                    n = len(rows) * view[1]
                    matrix = torch.zeros(view, dtype=t.dtype)
                    matrix.index_copy_(0, rows, values[offset : offset + n].view(-1, view[1]))
                    t.copy_(from_matrix(matrix, shape))
                offset += n


def select_rows(
    shapes: Sequence[torch.Size], averaged: Sequence[torch.Tensor], rho: float
) -> RowSelection:
    """Keep the ``kept_rows(rho, n)`` rows of largest averaged-sketch norm.

    ``averaged`` holds one sketch per matrix tensor, in order. Ties go to the
    lower row index (a stable sort), so equal sketches select equal rows on
    every member. Raises ``ValueError`` if the sketches do not fit ``shapes``.
    """
    sketches = iter(averaged)
    rows: list[torch.Tensor | None] = []
    for shape in shapes:
        view = matrix_shape(shape)
        if view is None:
            rows.append(None)
            continue
        p = next(sketches, None)
        if p is None or p.dim() != 2 or p.shape[0] != view[0]:
            raise ValueError(f"no sketch of {view[0]} rows for the tensor of shape {shape}")
        order = torch.sort(row_scores(p), descending=True, stable=True).indices
        rows.append(order[: kept_rows(rho, view[0])].sort().values)
    if next(sketches, None) is not None:
        raise ValueError("more sketches than matrix tensors")
    return RowSelection(tuple(torch.Size(s) for s in shapes), tuple(rows))


def arc_topk_compress(
    tensors: Sequence[torch.Tensor], *, seed: int, rho: float, rank: int
) -> tuple[list[torch.Tensor], RowSelection]:
    """ARC-Top-K of ``tensors`` on their own (a group of one): ``C(x)`` as new
    tensors, and the selection it used. The group version selects from the
    averaged sketch instead; this is the same rule applied to one member."""
    check_parameters(rho, rank)
    shapes = [t.shape for t in tensors]
    selection = select_rows(shapes, sketch(tensors, projections(shapes, seed, rank, rho)), rho)
    out = [torch.empty(t.shape, dtype=torch.float32) for t in tensors]
    selection.scatter(selection.gather(tensors), out)
    return out, selection


def exact_group_round(
    xs: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    *,
    seed: int,
    rho: float,
    rank: int,
    codec: Codec = NONE,
) -> tuple[RowSelection, list[list[torch.Tensor]], list[torch.Tensor]]:
    """What a group whose two all-reduces both succeed computes, without a network.

    ``xs[j]`` are member j's tensors, ``weights[j]`` its weight. Returns the
    shared selection, every member's own ``C(x_j)`` and the weighted mean of
    those (what every member holds after the value all-reduce). Sketches,
    values and means pass through ``codec`` as in ``ArcTopKRound``. The
    means are exact float32 sums here, where the all-reduce adds in chunks;
    the two agree up to rounding. For tests and simulations.
    """
    check_parameters(rho, rank)
    check_codec(codec)
    total = float(sum(weights))
    if not xs or len(xs) != len(weights) or total <= 0:
        raise ValueError("one weight per member, and a positive total weight")
    shapes = [t.shape for t in xs[0]]
    projected = projections(shapes, seed, rank, rho)
    sketches = [[on_the_wire(p, codec) for p in sketch(x, projected)] for x in xs]
    averaged = [
        on_the_wire(
            sum((w * s[i] for s, w in zip(sketches, weights, strict=True)), torch.zeros(()))
            / total,
            codec,
        )
        for i in range(len(sketches[0]))
    ]
    selection = select_rows(shapes, averaged, rho)
    values = [on_the_wire(selection.gather(x), codec) for x in xs]
    own: list[list[torch.Tensor]] = []
    for v in values:
        out = [torch.empty(shape, dtype=torch.float32) for shape in shapes]
        selection.scatter(v, out)
        own.append(out)
    mean_values = sum((w * v for v, w in zip(values, weights, strict=True)), torch.zeros(()))
    mean = [torch.empty(shape, dtype=torch.float32) for shape in shapes]
    selection.scatter(on_the_wire(mean_values / total, codec), mean)
    return selection, own, mean


def contraction_bound(
    tensors: Sequence[torch.Tensor], *, seed: int, rho: float, rank: int
) -> float:
    """The ``alpha`` for which ``||C(x) - x||^2 <= (1 - alpha) ||x||^2`` is proven
    (module docstring) for these tensors and the projection drawn from ``seed``.

    1.0 for a vector of only dense tensors or with ``rho = 1``; 1.0 also for
    a zero vector (nothing to lose).
    """
    check_parameters(rho, rank)
    shapes = [t.shape for t in tensors]
    alpha = 1.0
    for t, v in zip(tensors, projections(shapes, seed, rank, rho), strict=True):
        view = matrix_shape(t.shape)
        if v is None or view is None:
            continue
        k = kept_rows(rho, view[0])
        if k == view[0]:
            continue
        x = as_matrix(t.detach()).to(torch.float64)
        p = x @ v.to(torch.float64)
        x_norms = (x * x).sum(dim=1)
        p_norms = (p * p).sum(dim=1)
        nonzero = x_norms > 0
        if not bool(nonzero.any()):
            continue
        max_distortion = float((p_norms[nonzero] / x_norms[nonzero]).max())
        if max_distortion == 0.0:
            return 0.0  # the projection sees nothing of this matrix
        energy = float(p_norms.sum()) / (max_distortion * float(x_norms.sum()))
        alpha = min(alpha, k / view[0] * energy)
    return alpha


#: Sub-round tags (``Averager.average_with``) of the two all-reduces.
SKETCH_TAG = b"arctopk.sketch"
VALUES_TAG = b"arctopk.values."


@dataclass(eq=False)
class ArcTopKRound:
    """One member's ARC-Top-K averaging of ``tensors`` in one group, in place.

    Build it with the tensors to compress, then ``await run(...)``. Afterwards
    (also after a cancellation or a failure part-way):

    - ``tensors`` hold the group's weighted mean of the compressed vectors,
      ``mean(C(x))``, chunk by chunk as the value all-reduce delivered it (a
      chunk whose reducer failed holds this member's own ``C(x)``);
    - ``local`` holds this member's own ``C(x)`` under the group's selection.

    Until a selection exists (no sketch round finished) both are ``x``
    itself: nothing was compressed, nothing was averaged. Members whose
    sketch all-reduce went wrong may select other rows; the value round's tag
    carries the selection's digest, so only members that selected the same
    rows average values together, and nobody mixes misaligned rows.
    """

    tensors: list[torch.Tensor]
    rho: float
    rank: int
    #: the codec of both all-reduces (element-wise: ``check_codec``)
    codec: Codec = NONE
    local: list[torch.Tensor] = field(init=False)
    selection: RowSelection | None = field(init=False, default=None)
    sketch_result: StepResult | None = field(init=False, default=None)
    values_result: StepResult | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        check_parameters(self.rho, self.rank)
        check_codec(self.codec)
        self.local = [t.detach().clone() for t in self.tensors]

    async def run(self, averager: Averager, group: Group, weight: float, step: int) -> StepResult:
        """Average the sketches, select rows, average their values: two
        all-reduces of ``group`` (sub-rounds of the averager's round), then
        the averager moves to the next round's cell.

        ``step`` (with the group id) seeds the projection: every member passes
        the same. Returns the value round's result. Each all-reduce returns
        within its round deadline; on cancellation ``tensors`` and ``local``
        are as the class docstring says.
        """
        shapes = [t.shape for t in self.tensors]
        codec = self.codec
        sketches = [
            on_the_wire(p, codec)
            for p in sketch(
                self.tensors,
                projections(shapes, projection_seed(group.group_id, step), self.rank, self.rho),
            )
        ]
        # Members whose sketches are laid out otherwise (another sketch_rank
        # for some matrix) or in another codec must not average with us:
        # both are in the tags.
        settings = struct.pack("<B", codec.kind)
        layout = b"".join(struct.pack("<H", p.shape[1]) for p in sketches)
        tag = (
            SKETCH_TAG
            + struct.pack("<HQ", self.rank, step)
            + settings
            + hashlib.blake2b(layout, digest_size=8).digest()
        )
        if sketches:
            self.sketch_result = await averager.average_with(
                group, sketches, weight, tag=tag, codec=codec
            )
        selection = select_rows(shapes, sketches, self.rho)
        # Our own c is what the others decode of it, so error feedback adds
        # exactly the c that was averaged.
        values = on_the_wire(selection.gather(self.tensors), codec)
        selection.scatter(values, self.local)
        selection.scatter(values, self.tensors)
        self.selection = selection
        try:
            self.values_result = await averager.average_with(
                group,
                [values],
                weight,
                tag=VALUES_TAG + settings + selection.digest(),
                last=True,
                codec=codec,
            )
        finally:
            # Averaged chunks, or local ones where the round failed: whole
            # chunks either way, so the result is well defined.
            selection.scatter(values, self.tensors)
        return self.values_result
