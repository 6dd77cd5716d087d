"""ARC-Top-K: the pure compressor, then a real group of three peers on 127.0.0.1."""

from __future__ import annotations

import math

import pytest
import torch
import trio
from peer_harness import averager_config, open_peers

from averaging import (
    FLOAT16,
    NONE,
    UINT8,
    ArcTopKRound,
    Averager,
    Codec,
    Group,
    GroupMember,
    RowSelection,
    arc_topk_compress,
    contraction_bound,
    select_rows,
)
from averaging._arctopk import (
    as_matrix,
    exact_group_round,
    kept_rows,
    matrix_shape,
    on_the_wire,
    payload_elements,
    projection_seed,
    projections,
    sketch,
    sketch_rank,
)
from averaging._moshpit import MoshpitGrid
from swarm import ConfigError, PeerID

#: a conv kernel, two linear layers, a bias and a scalar: every shape rule
SHAPES = [(16, 3, 3, 3), (40, 27), (10, 40), (40,), ()]


def _random_tensors(gen: torch.Generator, scale: float = 1.0) -> list[torch.Tensor]:
    # rows of very different norms, so that the choice of rows matters
    out = []
    for shape in SHAPES:
        t = torch.randn(shape, generator=gen) * scale
        if len(shape) >= 2:
            t = t * torch.rand(shape[0], generator=gen).pow(3).view(-1, *[1] * (len(shape) - 1))
        out.append(t)
    return out


def _mean(vectors: list[list[torch.Tensor]], weights: list[float]) -> list[torch.Tensor]:
    total = sum(weights)
    return [
        sum(w * v[j] for v, w in zip(vectors, weights, strict=True)) / total
        for j in range(len(vectors[0]))
    ]


def _sq(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors)


def test_sub_rounds_of_a_group_have_their_own_ids() -> None:
    members = tuple(GroupMember(PeerID(bytes([i]) * 20), "127.0.0.1", 1000 + i) for i in range(3))
    group = Group(b"formed-group", members, 1)
    sketches, values = group.sub_round(b"sketch"), group.sub_round(b"values")
    assert len({group.group_id, sketches.group_id, values.group_id}) == 3
    assert sketches.members == members and sketches.local_index == 1
    # every member derives the same id
    assert Group(b"formed-group", members, 2).sub_round(b"sketch").group_id == sketches.group_id
    assert group.sub_round(b"sketch") == sketches
    for bad in (b"", b"x" * 256):
        with pytest.raises(ConfigError):
            group.sub_round(bad)


def test_kept_rows_rounds_up_without_float_noise() -> None:
    assert kept_rows(0.1, 30) == 3  # 0.1 * 30 is 3.0000000000000004
    assert kept_rows(0.2, 128) == 26
    assert kept_rows(0.1, 10) == 1
    assert kept_rows(0.01, 10) == 1
    assert kept_rows(1.0, 7) == 7


def test_payload_sizes_follow_from_the_shapes() -> None:
    # the digits model: 64-128-10
    digits = [(128, 64), (128,), (10, 128), (10,)]
    assert sum(math.prod(s) for s in digits) == 9610
    # rows along the longer side: the 10 x 128 head is sketched as 128 x 10
    assert matrix_shape((10, 128)) == (128, 10) and matrix_shape((128, 64)) == (128, 64)
    assert matrix_shape((16, 3, 3, 3)) == (27, 16) and matrix_shape((64, 3, 3, 3)) == (64, 27)
    # the head's sketch rank is capped at rho * 10 columns (sketch_rank): 2, then 1
    assert payload_elements(digits, 0.2, 4) == (512 + 256, 26 * 64 + 128 + 26 * 10 + 10)
    assert payload_elements(digits, 0.1, 4) == (512 + 128, 13 * 64 + 128 + 13 * 10 + 10)
    assert payload_elements(digits, 1.0, 4) == (1024, 9610)
    gen = torch.Generator().manual_seed(9)
    x = _random_tensors(gen)
    _, selection = arc_topk_compress(x, seed=1, rho=0.3, rank=3)
    sketched = sum(v.numel() for v in sketch(x, projections([t.shape for t in x], 1, 3, 0.3)))
    assert payload_elements(SHAPES, 0.3, 3) == (sketched, selection.numel())


def test_the_sketch_is_never_larger_than_the_values_it_selects() -> None:
    assert [sketch_rank(0.1, 4, m) for m in (1, 9, 10, 19, 20, 40, 64)] == [1, 1, 1, 1, 2, 4, 4]
    assert sketch_rank(0.3, 4, 10) == 3 and sketch_rank(1.0, 4, 2) == 2
    for rho in (0.05, 0.1, 0.2, 0.5, 1.0):
        for n, m in ((128, 10), (128, 64), (27, 16), (1000, 3), (50, 50)):
            r = sketch_rank(rho, 4, m)
            assert 1 <= r <= 4
            # n * r <= k * m unless r is the floor of 1 (fewer than 1 / rho columns)
            assert n * r <= kept_rows(rho, n) * m or r == 1
            sketched, values = payload_elements([(n, m)], rho, 4)
            assert (sketched, values) == (n * r, kept_rows(rho, n) * m)
    # digits at rho 0.1 in float16: under a tenth of dense float32's bytes
    digits = [(128, 64), (128,), (10, 128), (10,)]
    assert 2 * sum(payload_elements(digits, 0.1, 4)) <= 0.1 * 4 * 9610


def test_peers_with_different_gradients_select_identical_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    peers = [_random_tensors(gen, scale=i + 1.0) for i in range(4)]
    weights = [64.0, 32.0, 96.0, 8.0]
    shapes = [torch.Size(s) for s in SHAPES]
    seed = projection_seed(b"group-7", 12)
    # each peer sketches its own gradient with the shared projection ...
    local = [sketch(p, projections(shapes, seed, 4, 0.2)) for p in peers]
    # ... alone, they would keep different rows
    alone = {select_rows(shapes, s, 0.2).digest() for s in local}
    assert len(alone) > 1
    # the group averages the sketches (what the all-reduce hands every member)
    averaged = _mean(local, weights)
    selections = [select_rows(shapes, [a.clone() for a in averaged], 0.2) for _ in peers]
    assert len({s.digest() for s in selections}) == 1
    for rows in zip(*(s.rows for s in selections), strict=True):
        assert all(r is None for r in rows) or all(torch.equal(r, rows[0]) for r in rows)
    # by linearity, that is the selection for the sketch of the mean itself
    mean = _mean(peers, weights)
    direct = select_rows(shapes, sketch(mean, projections(shapes, seed, 4, 0.2)), 0.2)
    assert direct.digest() == selections[0].digest()
    # the averaged values under that selection are exactly C(mean)
    values = _mean([[selections[0].gather(p)] for p in peers], weights)[0]
    out = [torch.empty(s) for s in shapes]
    selections[0].scatter(values, out)
    compressed, _ = arc_topk_compress(mean, seed=seed, rho=0.2, rank=4)
    for a, b in zip(out, compressed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # the simulation helper computes the same round
    selection, own, simulated = exact_group_round(peers, weights, seed=seed, rho=0.2, rank=4)
    assert selection.digest() == selections[0].digest()
    for a, b in zip(out, simulated, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for x, c in zip(peers, own, strict=True):
        expected = [torch.empty(s) for s in shapes]
        selection.scatter(selection.gather(x), expected)
        assert all(torch.equal(a, b) for a, b in zip(c, expected, strict=True))


def test_the_projection_depends_on_group_and_step_only() -> None:
    shapes = [torch.Size(s) for s in SHAPES]
    a = projections(shapes, projection_seed(b"g", 3), 4, 0.2)
    b = projections(shapes, projection_seed(b"g", 3), 4, 0.2)
    c = projections(shapes, projection_seed(b"g", 4), 4, 0.2)
    torch.manual_seed(123)  # the global generator plays no part
    d = projections(shapes, projection_seed(b"g", 3), 4, 0.2)
    for x, y, z, w in zip(a, b, c, d, strict=True):
        if x is None:
            assert y is None and z is None and w is None
            continue
        assert y is not None and z is not None and w is not None
        assert torch.equal(x, y) and torch.equal(x, w) and not torch.equal(x, z)


def test_rho_one_is_the_identity_and_dense_tensors_travel_whole() -> None:
    gen = torch.Generator().manual_seed(1)
    x = _random_tensors(gen)
    out, selection = arc_topk_compress(x, seed=5, rho=1.0, rank=4)
    assert all(torch.equal(a, b) for a, b in zip(out, x, strict=True))
    assert selection.numel() == sum(t.numel() for t in x)
    assert contraction_bound(x, seed=5, rho=1.0, rank=4) == 1.0
    small, _ = arc_topk_compress(x, seed=5, rho=0.1, rank=4)
    assert torch.equal(small[3], x[3]) and torch.equal(small[4], x[4])  # bias and scalar


def test_the_compressor_is_contractive_with_the_alpha_it_claims() -> None:
    gen = torch.Generator().manual_seed(2)
    alphas = []
    for trial in range(200):
        x = _random_tensors(gen, scale=float(torch.rand(1, generator=gen)) * 10 + 0.01)
        for rho, rank in [(0.1, 4), (0.2, 4), (0.5, 2), (0.2, 1)]:
            out, _ = arc_topk_compress(x, seed=trial, rho=rho, rank=rank)
            alpha = contraction_bound(x, seed=trial, rho=rho, rank=rank)
            assert 0.0 <= alpha <= 1.0
            error = _sq([a - b for a, b in zip(out, x, strict=True)])
            assert error <= (1 - alpha) * _sq(x) * (1 + 1e-6) + 1e-12, (trial, rho, alpha)
            # kept rows are whole rows of x, the rest is zero
            assert _sq(out) + error == pytest.approx(_sq(x), rel=1e-6)
            alphas.append(alpha)
            # in the sketch space the choice is exact Top-K: at least k/n of the energy
            shapes = [t.shape for t in x]
            for t, c, v in zip(x, out, projections(shapes, trial, rank, rho), strict=True):
                if v is None:
                    continue
                n = as_matrix(t).shape[0]
                p = as_matrix(t).double() @ v.double()
                q = as_matrix(t - c).double() @ v.double()
                k = kept_rows(rho, n)
                assert float(q.pow(2).sum()) <= (1 - k / n) * float(p.pow(2).sum()) * (1 + 1e-6)
    # the bound is not vacuous: it is positive on every input
    assert min(alphas) > 0


def test_selection_bookkeeping_rejects_what_does_not_fit() -> None:
    shapes = [torch.Size((4, 3)), torch.Size((5,))]
    with pytest.raises(ValueError):
        select_rows(shapes, [], 0.5)  # no sketch for the matrix
    with pytest.raises(ValueError):
        select_rows(shapes, [torch.zeros(4, 2), torch.zeros(4, 2)], 0.5)  # one too many
    with pytest.raises(ValueError):
        RowSelection(tuple(shapes), (None, None))  # the matrix needs rows
    selection = select_rows(shapes, [torch.tensor([[0.0], [3.0], [3.0], [1.0]])], 0.5)
    row_sets = selection.rows
    assert row_sets[0] is not None and row_sets[0].tolist() == [1, 2]  # a tie: lower index
    with pytest.raises(ValueError):
        selection.scatter(torch.zeros(3), [torch.zeros(4, 3), torch.zeros(5)])
    for bad in [(0.0, 4), (1.5, 4), (float("nan"), 4), (0.2, 0), (0.2, 1025)]:
        with pytest.raises(ConfigError):
            arc_topk_compress([torch.zeros(4, 3)], seed=0, rho=bad[0], rank=bad[1])


# -- a real group ---------------------------------------------------------------

CONFIG = averager_config(group_size=3)


async def _groups(averagers: list[Averager]) -> list[Group]:
    groups: list[Group | None] = [None] * len(averagers)

    async def find(i: int) -> None:
        groups[i] = await averagers[i].find_group(round=0, expected_peers=len(averagers))

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(find, i)
    assert all(g is not None and g.size == len(averagers) for g in groups)
    return [g for g in groups if g is not None]


def test_only_element_wise_codecs_and_float16_saturates() -> None:
    x = torch.tensor([1.0 / 3.0, -1e6, 7e4, 2.0, float("nan")])
    wire = on_the_wire(x, FLOAT16)
    assert wire.dtype == torch.float32 and wire[3] == 2.0 and wire[0] != x[0]
    assert wire[1] == -65504.0 and wire[2] == 65504.0  # clamped, not Inf
    assert torch.equal(on_the_wire(wire[:4], FLOAT16), wire[:4])  # exact the second time
    assert torch.equal(on_the_wire(x[:4], NONE), x[:4])
    with pytest.raises(ConfigError, match="NONE or FLOAT16"):
        on_the_wire(x, UINT8)
    with pytest.raises(ConfigError):
        ArcTopKRound([x], 0.5, 4, UINT8)


@pytest.mark.parametrize("codec", [NONE, FLOAT16], ids=["float32", "float16"])
async def test_a_group_of_three_averages_the_same_rows_over_the_network(codec: Codec) -> None:
    gen = torch.Generator().manual_seed(3)
    peers_x = [_random_tensors(gen, scale=i + 1.0) for i in range(3)]
    weights = [64.0, 128.0, 32.0]
    async with open_peers(3, seed=4) as peers:
        averagers = [
            Averager(p, [torch.zeros(1)], prefix="arc", config=CONFIG, grid=MoshpitGrid(1, 1))
            for p in peers.alive
        ]
        groups = await _groups(averagers)
        rounds = [ArcTopKRound([t.clone() for t in x], 0.2, 4, codec) for x in peers_x]
        dense = [[t.clone() for t in x] for x in peers_x]

        async def run(i: int) -> None:
            await rounds[i].run(averagers[i], groups[i], weights[i], step=9)
            # rho = 1 in the same group (another step: its own sub-rounds)
            await ArcTopKRound(dense[i], 1.0, 4, codec).run(averagers[i], groups[i], weights[i], 10)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(run, i)
    digests = set()
    sketched, values = payload_elements(SHAPES, 0.2, 4)
    for r in rounds:
        assert r.selection is not None and r.values_result is not None
        assert r.sketch_result is not None and r.sketch_result.allreduce is not None
        assert r.values_result.allreduce is not None
        # what went through the two all-reduces, in elements
        assert r.sketch_result.allreduce.part_bounds[-1][1] == sketched
        assert r.values_result.allreduce.part_bounds[-1][1] == values
        assert r.values_result.group_id == groups[0].group_id  # the formed group
        assert r.values_result.contributors == frozenset(r.values_result.members)
        digests.add(r.selection.digest())
    assert len(digests) == 1
    # every member ends with the same bits: C of the weighted mean (up to
    # half precision: float16 keeps 11 significant bits)
    tolerance = 1e-5 if codec == NONE else 2e-2
    mean = _mean(peers_x, weights)
    expected, _ = arc_topk_compress(
        mean, seed=projection_seed(groups[0].group_id, 9), rho=0.2, rank=4
    )
    for r in rounds:
        for a, b, c in zip(r.tensors, rounds[0].tensors, expected, strict=True):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, atol=tolerance, rtol=0)
    # each member's own c is C(x_i) under the shared selection, as sent
    selection = rounds[0].selection
    assert selection is not None
    for r, x in zip(rounds, peers_x, strict=True):
        own = [torch.empty(t.shape) for t in x]
        selection.scatter(on_the_wire(selection.gather(x), codec), own)
        assert all(torch.equal(a, b) for a, b in zip(r.local, own, strict=True))
    # rho = 1 is the dense weighted mean
    for d in dense:
        for a, b in zip(d, mean, strict=True):
            torch.testing.assert_close(a, b, atol=tolerance, rtol=0)


async def test_members_that_selected_other_rows_never_mix_values() -> None:
    gen = torch.Generator().manual_seed(5)
    xs = [_random_tensors(gen, scale=i + 1.0) for i in range(3)]
    async with open_peers(3, seed=6) as peers:
        averagers = [
            Averager(p, [torch.zeros(1)], prefix="odd", config=CONFIG, grid=MoshpitGrid(1, 1))
            for p in peers.alive
        ]
        groups = await _groups(averagers)
        # member 2 keeps more rows (a misconfigured or out-of-sync peer): its
        # value vector is laid out differently from the others', its sketch
        # alike (the same sketch_rank for every matrix at rho 0.2 and 0.24)
        rounds = [
            ArcTopKRound([t.clone() for t in x], rho, 4)
            for x, rho in zip(xs, [0.2, 0.2, 0.24], strict=True)
        ]

        async def run(i: int) -> None:
            await rounds[i].run(averagers[i], groups[i], 1.0, step=0)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(run, i)
    # the odd one averaged with nobody: it holds its own C(x)
    assert all(torch.equal(a, b) for a, b in zip(rounds[2].tensors, rounds[2].local, strict=True))
    # the two that agree averaged with each other only: member 2 is in no
    # chunk of theirs (group indices follow the group's order, not ours), and
    # where it was their reducer they kept their own c
    pair = _mean([rounds[0].local, rounds[1].local], [1.0, 1.0])
    odd = groups[2].local_index
    for r in rounds[:2]:
        assert r.values_result is not None and r.values_result.allreduce is not None
        for part in r.values_result.allreduce.contributors:
            assert all(odd not in chunk for chunk in part)
        assert r.values_result.allreduce.failed_reducers == {odd}
        for a, own, b in zip(r.tensors, r.local, pair, strict=True):
            averaged = torch.isclose(a, b, atol=1e-6, rtol=0)
            kept = torch.isclose(a, own, atol=0, rtol=0)
            assert bool((averaged | kept).all())
