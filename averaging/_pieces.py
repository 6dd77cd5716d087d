"""Bookkeeping and averaging of the lossy all-reduce's pieces: pure code, no network.

A part is cut into pieces of ``PIECE_ELEMENTS`` values (``_datagrams``), one
datagram each. ``PieceMask`` records which pieces of a part arrived (from one
sender, or back from the reducer), and travels as a bit mask on the reliable
stream: "which pieces each member received" is control, never lost.

``PieceReducer`` is the reducer of one part under loss. The estimator, for
piece p with ``A_p`` the senders whose piece p arrived (the reducer's own
contribution always does)::

    x̂_p = sum_{s in A_p} w_s x_{s,p} / sum_{s in A_p} w_s          (A_p not empty,
                                                                       some w_s > 0)

and no result (every member keeps its own values) when no weight arrived.

Why it is unbiased. Losses are random and do not depend on the values they
drop, so ``A_p`` is independent of the ``x_{s,p}``. Then, conditioned on any
``A_p``, ``E[x̂_p | A_p] = sum_{A_p} w_s E[x_{s,p}] / sum_{A_p} w_s``. In data
parallel training each sender's accumulated gradient is an unbiased estimate
of the same expected gradient ``g`` (``E[x_s] = g``), so ``E[x̂_p | A_p] = g``
for every arrival pattern, hence ``E[x̂_p] = g``: the estimator is unbiased
whatever the loss rate, and per piece, because the weights are renormalised
over exactly the contributions that are in it. This is the paper's estimator
(Weintraub, Banner, Orda 2025, "unbiased gradient aggregation": each worker
reconstructs the gradient from whatever packets arrive, averaging over the
received shards). Where we differ: the paper averages equal-weight workers;
we keep DeDLOC's per-member weights (samples accumulated), renormalised per
piece, which reduces to the paper's mean for equal weights. About the exact
mean of *this group's* values rather than the expected gradient: with equal
weights and exchangeable losses it is unbiased too (every member is equally
likely to be in ``A_p``), but the reducer's own contribution is never lost,
so on its part it is over-represented by a factor of at most ``1 / (1 - loss)``
relative to the others; each member reduces a different part, so no member's
data is favoured over the whole vector. We keep that rather than throw away
data that did arrive.

Variance, not bias, is what loss costs: a piece averaged over fewer
contributions is noisier, and a lost result leaves a member's own value,
which makes members drift apart; ``trainer._drift`` bounds that drift.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from swarm import ProtocolError

from ._datagrams import PIECE_ELEMENTS


def num_pieces(part_size: int) -> int:
    return -(-part_size // PIECE_ELEMENTS)


class PieceMask:
    """Which of ``n`` pieces arrived; bit i of byte i // 8 is piece i."""

    def __init__(self, n: int) -> None:
        if n < 0:
            raise ValueError("a negative number of pieces")
        self.n = n
        self._bits = bytearray(-(-n // 8))
        self.count = 0

    def add(self, piece: int) -> bool:
        """Mark ``piece``; False if it was already marked."""
        if not 0 <= piece < self.n:
            raise ValueError(f"piece {piece} out of range (0..{self.n - 1})")
        byte, bit = divmod(piece, 8)
        if self._bits[byte] >> bit & 1:
            return False
        self._bits[byte] |= 1 << bit
        self.count += 1
        return True

    def __contains__(self, piece: int) -> bool:
        byte, bit = divmod(piece, 8)
        return 0 <= piece < self.n and bool(self._bits[byte] >> bit & 1)

    @property
    def complete(self) -> bool:
        return self.count == self.n

    def to_bytes(self) -> bytes:
        return bytes(self._bits)

    @classmethod
    def full(cls, n: int) -> PieceMask:
        mask = cls(n)
        mask._bits[:] = b"\xff" * len(mask._bits)
        if n % 8:
            mask._bits[-1] = (1 << (n % 8)) - 1
        mask.count = n
        return mask

    @classmethod
    def from_bytes(cls, data: bytes, n: int) -> PieceMask:
        """The mask ``to_bytes`` wrote. ``ProtocolError`` if ``data`` is not
        exactly the bytes of ``n`` pieces, padding bits clear."""
        mask = cls(n)
        if len(data) != len(mask._bits):
            raise ProtocolError(f"a mask of {n} pieces is {len(mask._bits)} bytes, got {len(data)}")
        if n % 8 and data[-1] >> (n % 8):
            raise ProtocolError("bits set beyond the last piece")
        mask._bits[:] = data
        mask.count = sum(bin(b).count("1") for b in data)
        return mask

    def pieces(self) -> list[int]:
        return [i for i in range(self.n) if i in self]

    def array(self) -> np.ndarray:
        """The mask as ``n`` booleans, piece i at index i."""
        bits = np.unpackbits(np.frombuffer(bytes(self._bits), dtype=np.uint8), bitorder="little")
        return bits[: self.n].astype(bool)


def _as_array(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return values.detach().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


def contributor_codes(masks: Mapping[int, PieceMask], n: int) -> np.ndarray:
    """Per piece, the senders whose mask holds it as one integer (bit s for
    sender s): the contributor sets of a whole part at once, vectorised."""
    if any(sender >= 62 for sender in masks):  # beyond int64: Python integers
        codes = np.zeros(n, dtype=object)
        for sender, mask in masks.items():
            codes |= mask.array().astype(object) * (1 << sender)
        return codes
    codes = np.zeros(n, dtype=np.int64)
    for sender, mask in masks.items():
        codes |= mask.array().astype(np.int64) << sender
    return codes


class PieceReducer:
    """The per-piece renormalised weighted mean of one part (module docstring).

    ``weights`` maps each sender (member index) to its weight, finite and
    >= 0. ``add`` a piece as it arrives; ``finish`` once the phase is over;
    then ``result`` and ``contributors``.
    """

    def __init__(self, part_size: int, weights: Mapping[int, float]) -> None:
        for sender, w in weights.items():
            if not (math.isfinite(w) and w >= 0):
                raise ValueError(f"weight of sender {sender} must be finite and >= 0, got {w}")
        self.part_size = part_size
        self.num_pieces = num_pieces(part_size)
        self._weights = dict(weights)
        self._acc = torch.zeros(part_size, dtype=torch.float32)
        # Pieces arrive one datagram at a time: numpy and plain lists cost a
        # few microseconds per piece where torch's dispatch costs tens.
        self._acc_np = self._acc.numpy()
        self._scratch = np.empty(PIECE_ELEMENTS, dtype=np.float32)  # a weighted piece
        self._weight_sum = [0.0] * self.num_pieces
        self.masks = {s: PieceMask(self.num_pieces) for s in weights}
        self._finished = False

    def set_weight(self, sender: int, weight: float) -> None:
        """``sender``'s weight, before any of its pieces. ``ProtocolError`` for
        an unknown sender, a bad weight, or one that comes after its pieces."""
        if sender not in self._weights:
            raise ProtocolError(f"member {sender} is not a sender of this part")
        if not (math.isfinite(weight) and weight >= 0):
            raise ProtocolError(f"weight of sender {sender} must be finite and >= 0, got {weight}")
        if self.masks[sender].count:
            raise ProtocolError(f"sender {sender}'s weight came after its pieces")
        self._weights[sender] = weight

    def weight(self, sender: int) -> float:
        return self._weights[sender]

    def add(self, sender: int, piece: int, values: torch.Tensor | np.ndarray) -> bool:
        """Add ``sender``'s ``piece``; False (and nothing added) if it already
        arrived or the phase is finished. ``ValueError`` for a piece out of
        range or of the wrong size: the caller checked both (``_datagrams``).

        The hot path of a lossy round's reducer (one call per datagram): a
        few Python operations around one or two numpy calls.
        """
        mask = self.masks[sender]
        if self._finished or piece in mask:
            return False
        start = piece * PIECE_ELEMENTS
        end = start + PIECE_ELEMENTS
        if end > self.part_size:
            end = self.part_size
        array = values if type(values) is np.ndarray else _as_array(values)
        if array.size != end - start:
            raise ValueError(f"piece {piece} has {end - start} values, got {array.size}")
        mask.add(piece)
        w = self._weights[sender]
        if w > 0:
            acc = self._acc_np[start:end]
            if w == 1.0:
                np.add(acc, array.reshape(-1), out=acc)
            else:
                scratch = self._scratch[: end - start]
                np.multiply(array.reshape(-1), np.float32(w), out=scratch)
                np.add(acc, scratch, out=acc)
            self._weight_sum[piece] += w
        return True

    def add_all(self, sender: int, values: torch.Tensor) -> None:
        """Every piece of ``sender`` at once (the reducer's own part), before
        any other piece of it. ``ValueError`` otherwise or for a wrong size."""
        if values.numel() != self.part_size:
            raise ValueError(f"a part of {self.part_size} values, got {values.numel()}")
        if self._finished or self.masks[sender].count:
            raise ValueError(f"sender {sender} already delivered pieces")
        self.masks[sender] = PieceMask.full(self.num_pieces)
        w = self._weights[sender]
        if w > 0:
            self._acc.add_(values.reshape(-1).to(torch.float32), alpha=w)
            self._weight_sum = [total + w for total in self._weight_sum]

    def complete(self, senders: Iterable[int]) -> bool:
        """Whether every piece of each of ``senders`` arrived."""
        return all(self.masks[s].complete for s in senders)

    def finish(self) -> None:
        """Divide each piece by the weight that arrived for it; no more ``add``."""
        if self._finished:
            return
        self._finished = True
        sums = torch.tensor(self._weight_sum, dtype=torch.float64)
        # 1 / weight per piece (0 where none arrived: those hold zeros anyway)
        inverse = torch.where(sums > 0, 1.0 / sums.clamp_min(1e-300), 0.0).float()
        self._acc.mul_(inverse.repeat_interleave(PIECE_ELEMENTS)[: self.part_size])

    def has_result(self, piece: int) -> bool:
        return self._weight_sum[piece] > 0

    def contributor_codes(self) -> np.ndarray:
        """``contributors`` of every piece at once, as ``contributor_codes``
        writes them (0 for a piece without result)."""
        weighted = {s: m for s, m in self.masks.items() if self._weights[s] > 0}
        codes = contributor_codes(weighted, self.num_pieces)
        codes[np.asarray(self._weight_sum) <= 0] = 0
        return codes

    def result(self) -> torch.Tensor:
        """The averaged part (pieces without result hold zeros: check
        ``has_result``). Only after ``finish``."""
        if not self._finished:
            raise ValueError("the phase is not finished")
        return self._acc

    def contributors(self, piece: int) -> frozenset[int]:
        """Senders with weight > 0 whose ``piece`` is in the result."""
        if not self.has_result(piece):
            return frozenset()
        return frozenset(s for s, m in self.masks.items() if piece in m and self._weights[s] > 0)
