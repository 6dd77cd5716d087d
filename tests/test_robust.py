"""CenteredClip: the math without a network, then a real all-reduce with a Byzantine peer.

The bound asserted is the one derived in ``averaging/_robust.py``: with 1 of 4
equally counted senders Byzantine, honest vectors within ``r`` of their mean
``mu`` and ``tau >= 3 r``, the result after ``T`` iterations is within
``tau / 3 + 4**-T * sqrt(3) * r`` of ``mu``, however large the Byzantine vector.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_allreduce import CONFIG, make_groups, open_peers, run_round

from averaging import AllReduceConfig, CenteredClip
from averaging._reducer import PartReducer
from averaging._robust import centered_clip
from swarm import ConfigError


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _honest_and_byzantine(n: int, seed: int, scale: float) -> torch.Tensor:
    """Rows 0..2 honest (a shared direction plus noise), row 3 scaled by ``scale``."""
    g = torch.randn(n, generator=_gen(seed))
    rows = g + 0.1 * torch.randn(4, n, generator=_gen(seed + 1))
    rows[3] *= scale
    return rows


def bound(tau: float, r: float, iterations: int) -> float:
    return tau / 3 + 4.0**-iterations * math.sqrt(3) * r


def test_without_clipping_it_is_the_weighted_mean() -> None:
    x = torch.randn(5, 40, generator=_gen(0))
    w = torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0])
    mean = (w[:, None] * x).sum(0) / w.sum()
    # tau beyond every distance: one update from any start lands on the mean
    result = centered_clip(x, w, tau=1e6, iterations=1)
    assert torch.allclose(result, mean, atol=1e-5)


@pytest.mark.parametrize("scale", [1000.0, -1000.0, 1e30])
def test_one_scaled_sender_of_four_stays_within_the_bound(scale: float) -> None:
    rows = _honest_and_byzantine(200, 1, scale)
    mu = rows[:3].mean(0)
    r = max(float(torch.linalg.vector_norm(x - mu)) for x in rows[:3])
    tau, iterations = 3 * r, 10
    result = centered_clip(rows, torch.ones(4), tau, iterations)
    assert float(torch.linalg.vector_norm(result - mu)) <= bound(tau, r, iterations)
    plain = rows.mean(0)
    assert float(torch.linalg.vector_norm(plain - mu)) > 100 * bound(tau, r, iterations)


def test_random_noise_sender_is_bounded_too_and_order_does_not_matter() -> None:
    rows = _honest_and_byzantine(100, 2, 1.0)
    rows[3] = 1e4 * torch.randn(100, generator=_gen(9))
    mu = rows[:3].mean(0)
    r = max(float(torch.linalg.vector_norm(x - mu)) for x in rows[:3])
    result = centered_clip(rows, torch.ones(4), 3 * r, 10)
    assert float(torch.linalg.vector_norm(result - mu)) <= bound(3 * r, r, 10)
    shuffled = centered_clip(rows[[2, 3, 0, 1]], torch.ones(4), 3 * r, 10)
    assert torch.allclose(result, shuffled, atol=1e-5)


def test_bad_arguments_and_configs_are_refused() -> None:
    with pytest.raises(ValueError):
        centered_clip(torch.ones(2, 3), torch.tensor([1.0, 0.0]), 1.0, 1)
    with pytest.raises(ValueError):
        centered_clip(torch.ones(2, 3), torch.ones(3), 1.0, 1)
    for tau in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="tau"):
            CenteredClip(tau=tau)
    with pytest.raises(ConfigError, match="iterations"):
        CenteredClip(tau=1.0, iterations=0)
    with pytest.raises(ConfigError, match="aggregation"):
        AllReduceConfig(aggregation="median")  # type: ignore[arg-type]


def test_part_reducer_clips_each_chunk_and_frees_what_it_held() -> None:
    rows = _honest_and_byzantine(10, 3, 1000.0)
    clip = CenteredClip(tau=0.5, iterations=10)
    reducer = PartReducer([6, 4], {0: 1.0, 1: 1.0, 2: 1.0, 3: 100.0}, aggregation=clip)
    for sender in (3, 0, 1):  # the Byzantine one first, all chunks
        reducer.add(sender, 0, rows[sender, :6])
        reducer.add(sender, 1, rows[sender, 6:])
    assert reducer.completed == 0
    assert reducer.held_values() == 3 * 10  # every sender's copy of both chunks
    reducer.add(2, 0, rows[2, :6])
    assert reducer.completed == 1 and reducer.held_values() == 3 * 4
    reducer.add(2, 1, rows[2, 6:])
    assert reducer.done and reducer.held_values() == 0
    for chunk, (a, b) in enumerate([(0, 6), (6, 10)]):
        # its declared weight of 100 does not count: every sender counts once
        want = centered_clip(rows[:, a:b], torch.ones(4), 0.5, 10)
        assert torch.equal(reducer.result(chunk), want)  # type: ignore[arg-type]
        assert reducer.contributors(chunk) == frozenset(range(4))


def test_part_reducer_with_failures_and_zero_weights() -> None:
    clip = CenteredClip(tau=1.0)
    reducer = PartReducer([3, 3], {0: 1.0, 1: 0.0, 2: 1.0}, aggregation=clip)
    x = torch.arange(6, dtype=torch.float32)
    reducer.add(0, 0, x[:3])
    reducer.add(1, 0, x[:3] + 100)  # weight 0: nothing of it counts
    reducer.add(2, 0, x[:3] + 1)
    assert reducer.completed == 1
    assert torch.allclose(reducer.result(0), x[:3] + 0.5)  # type: ignore[arg-type]
    reducer.add(0, 1, x[3:])
    reducer.fail(2)
    reducer.fail(1)
    assert torch.equal(reducer.result(1), x[3:])  # type: ignore[arg-type]
    assert reducer.held_values() == 0


async def test_byzantine_peer_scaling_by_1000_in_a_real_all_reduce() -> None:
    """4 peers on 127.0.0.1, member 3 sends its gradient times 1000. The plain
    mean lands far from the honest mean; with CenteredClip every chunk of every
    honest member is within the bound of the honest mean of that chunk."""
    total, chunk = 1000, 64
    rows = _honest_and_byzantine(total, 4, 1000.0)
    inputs = [rows[i].clone() for i in range(4)]
    mu = rows[:3].mean(0)
    # r over the whole vector bounds r over every chunk
    r = max(float(torch.linalg.vector_norm(x - mu)) for x in rows[:3])
    tau, iterations = 3 * r, 10
    robust = AllReduceConfig(
        sender_timeout=CONFIG.sender_timeout,
        reducer_timeout=CONFIG.reducer_timeout,
        round_timeout=CONFIG.round_timeout,
        chunk_elements=chunk,
        aggregation=CenteredClip(tau=tau, iterations=iterations),
    )
    async with open_peers(4) as nets:
        groups = make_groups(nets)
        plain = await run_round(nets, groups, [1.0] * 4, inputs=inputs)
        clipped = await run_round(nets, groups, [1.0] * 4, inputs=inputs, config=robust)
    for i in range(3):
        far = float(torch.linalg.vector_norm(plain.outputs[i] - mu))
        assert far > 1000 * bound(tau, r, iterations)
        result = clipped.results[i]
        assert not isinstance(result, BaseException) and result is not None
        for part, (start, end) in enumerate(result.part_bounds):
            for c in range(len(result.contributors[part])):
                a = start + c * result.chunk_elements
                b = min(a + result.chunk_elements, end)
                assert result.contributors[part][c] == frozenset(range(4))
                error = float(torch.linalg.vector_norm(clipped.outputs[i][a:b] - mu[a:b]))
                assert error <= bound(tau, r, iterations), (i, part, c, error)
        assert torch.equal(clipped.outputs[i], clipped.outputs[0])
    assert sum(len(c) for c in clipped.results[0].contributors) > 4  # type: ignore[union-attr]
