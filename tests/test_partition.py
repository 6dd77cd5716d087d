import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from averaging._group import Group, GroupMember, MemberMode
from averaging._partition import (
    RING_UPLOAD_SPREAD,
    Partition,
    flat_zeros_like,
    flatten,
    part_sizes,
    part_weights,
    unflatten_into,
)
from averaging._ring import ring_eligible
from swarm import ConfigError, PeerID

N, C, A = MemberMode.NODE, MemberMode.CLIENT, MemberMode.AUX


def make_group(modes: list[MemberMode], bandwidths: list[float], local: int = 0) -> Group:
    members = tuple(
        GroupMember(PeerID(bytes([i]) * 20), "127.0.0.1", 1000 + i, bw, mode)
        for i, (mode, bw) in enumerate(zip(modes, bandwidths, strict=True))
    )
    return Group(b"g", members, local)


def test_equal_bandwidths_split_evenly_remainder_to_lowest() -> None:
    assert part_sizes(10, [1.0, 1.0, 1.0], [N, N, N]) == [4, 3, 3]
    assert part_sizes(9, [1.0, 1.0, 1.0], [N, N, N]) == [3, 3, 3]


def test_proportional_to_bandwidth() -> None:
    assert part_sizes(100, [1.0, 3.0], [N, N]) == [25, 75]
    assert part_sizes(7, [0.1, 0.2, 0.7], [N, N, N]) == [1, 1, 5]


def test_client_and_zero_bandwidth_get_nothing() -> None:
    assert part_sizes(10, [5.0, 1.0, 1.0], [C, N, A]) == [0, 5, 5]
    assert part_sizes(10, [1.0, 0.0], [N, N]) == [10, 0]


def test_no_reducer_is_an_error() -> None:
    with pytest.raises(ValueError):
        part_sizes(10, [1.0, 1.0], [C, C])
    assert part_sizes(0, [1.0], [C]) == [0]
    with pytest.raises(ConfigError, match="no member can reduce"):
        make_group([C, C], [1.0, 1.0])


@given(
    st.integers(0, 10**9),
    st.lists(
        st.tuples(st.floats(0, 1e6, allow_nan=False), st.sampled_from([N, C, A])),
        min_size=1,
        max_size=20,
    ),
)
def test_sizes_sum_and_are_near_proportional(total: int, members: list) -> None:
    bws = [b for b, _ in members]
    modes = [m for _, m in members]
    eligible = [b if m is not C else 0.0 for b, m in members]
    if sum(eligible) == 0:
        if total:
            with pytest.raises(ValueError):
                part_sizes(total, bws, modes)
        return
    sizes = part_sizes(total, bws, modes)
    assert sum(sizes) == total
    s = sum(eligible)
    for size, b in zip(sizes, eligible, strict=True):
        assert abs(size - total * b / s) < 1 + 1e-6 * total
        if b == 0:
            assert size == 0
    # Deterministic: the same answer every time, and the order of evaluation does not matter.
    assert part_sizes(total, bws, modes) == sizes


def measured_group(uploads: list[float], modes: list[MemberMode] | None = None) -> Group:
    """A group whose members published these measured uploads (bytes/s)."""
    modes = modes or [N] * len(uploads)
    members = tuple(
        GroupMember(PeerID(bytes([i]) * 20), "127.0.0.1", 1000 + i, 1.0, mode, upload=up)
        for i, (mode, up) in enumerate(zip(modes, uploads, strict=True))
    )
    return Group(b"g", members, 0)


#: measured uploads of four equal 100 Mbit/s links, 3% apart (noise)
ALIKE = [12.5e6, 12.2e6, 12.4e6, 12.575e6]
#: the same with one link 30% slower
APART = [12.5e6, 8.75e6, 12.4e6, 12.575e6]


def test_ring_cuts_equal_parts_for_uploads_alike_within_the_spread() -> None:
    group = measured_group(ALIKE)
    ring = Partition.for_group(group, 1001, 16, ring=True)
    assert [ring.part_size(j) for j in range(4)] == [251, 250, 250, 250]
    assert ring_eligible(group, ring)
    # without the ring: in proportion to the uploads, as before, and no ring
    butterfly = Partition.for_group(group, 1001, 16)
    assert butterfly.part_bounds == Partition.for_group(group, 1001, 16, ring=False).part_bounds
    sizes = part_sizes(1001, ALIKE, [N] * 4)
    assert [butterfly.part_size(j) for j in range(4)] == sizes == [252, 246, 250, 253]
    assert not ring_eligible(group, butterfly)


def test_ring_keeps_proportional_parts_for_uploads_far_apart() -> None:
    group = measured_group(APART)
    partition = Partition.for_group(group, 1001, 16, ring=True)
    sizes = [partition.part_size(j) for j in range(4)]
    assert sizes == part_sizes(1001, APART, [N] * 4) == [271, 189, 269, 272]
    assert not ring_eligible(group, partition)  # the butterfly, which gives the slow one less


def test_ring_spread_boundary_and_members_the_ring_cannot_serve() -> None:
    at = [10.0, 10.0 * RING_UPLOAD_SPREAD]
    below = [10.0, 10.0 * RING_UPLOAD_SPREAD * 0.999]
    assert part_weights(measured_group(at).members, ring=True) == [1.0, 1.0]
    assert part_weights(measured_group(below).members, ring=True) == below
    # a client or auxiliary member keeps every group off the ring: proportional
    for mode in (C, A):
        group = measured_group(ALIKE, [N, N, N, mode])
        weights = part_weights(group.members, ring=True)
        assert weights == part_weights(group.members)
        assert weights != [1.0] * 4
    # one member alone has no ring to run
    assert part_weights(measured_group([5.0]).members, ring=True) == [5.0]


def test_partition_chunks() -> None:
    group = make_group([N, C, N], [1.0, 1.0, 3.0])
    p = Partition.for_group(group, 21, chunk_elements=4)
    assert p.part_bounds == ((0, 5), (5, 5), (5, 21))
    assert p.chunk_sizes(0) == [4, 1]
    assert p.num_chunks(1) == 0 and p.chunk_sizes(1) == []
    assert p.chunk_sizes(2) == [4, 4, 4, 4]
    assert p.chunk_bounds(0, 1) == (4, 5)


def test_flatten_single_tensor_is_a_view() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    flat = flatten([t])
    flat[5] = -1
    assert t[1, 1] == -1
    unflatten_into(flat, [t])
    assert t[1, 1] == -1


def test_flatten_of_tensors_laid_back_to_back_is_a_view() -> None:
    shapes = [torch.empty(0), torch.empty(3, 4), torch.empty(5), torch.empty(0), torch.empty(2, 2)]
    tensors = flat_zeros_like(shapes)
    assert [t.shape for t in tensors] == [t.shape for t in shapes]
    assert all(t.dtype == torch.float32 and not t.any() for t in tensors)
    flat = flatten(tensors)
    assert flat.shape == (21,)
    flat.copy_(torch.arange(21, dtype=torch.float32))
    assert torch.equal(tensors[1], torch.arange(12, dtype=torch.float32).view(3, 4))
    assert torch.equal(tensors[4], torch.tensor([[17.0, 18.0], [19.0, 20.0]]))
    unflatten_into(flat, tensors)  # a no-op
    assert torch.equal(tensors[2], torch.arange(12, 17, dtype=torch.float32))
    assert torch.equal(flatten(tensors[2:]), torch.arange(12, 21, dtype=torch.float32))
    assert flatten(tensors[2:]).data_ptr() == tensors[2].data_ptr()


@pytest.mark.parametrize(
    "pick",
    [
        lambda t: [t[2], t[1]],  # out of order
        lambda t: [t[0], t[2]],  # a gap
        lambda t: [t[0], t[1].double()],  # another dtype
        lambda t: [t[0], t[1].t()],  # not contiguous
        lambda t: [t[0], t[1].clone()],  # another buffer
        lambda t: [t[1], t[1]],  # the same twice
    ],
    ids=["reordered", "gap", "dtype", "strided", "other-buffer", "repeated"],
)
def test_flatten_copies_tensors_that_are_not_one_vector(
    pick: Callable[[list[torch.Tensor]], list[torch.Tensor]],
) -> None:
    tensors = pick(flat_zeros_like([torch.empty(3, 2), torch.empty(2, 3), torch.empty(4)]))
    for i, t in enumerate(tensors):
        t.copy_(torch.full_like(t, float(i + 1)))
    before = [t.clone() for t in tensors]
    flat = flatten(tensors)
    assert torch.equal(flat, torch.cat([t.reshape(-1).float() for t in before]))
    flat.mul_(10)
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    unflatten_into(flat, tensors)
    assert all(torch.equal(t, b * 10) for t, b in zip(tensors, before, strict=True))


def test_flatten_and_back() -> None:
    rng = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 4, generator=rng),
        torch.randn(5, generator=rng).double(),
        torch.randn(2, 2, generator=rng).t(),
    ]
    flat = flatten(tensors)
    assert flat.shape == (12 + 5 + 4,) and flat.dtype == torch.float32
    assert torch.equal(flat[:12], tensors[0].reshape(-1))
    assert torch.equal(flat[17:], tensors[2].reshape(-1))
    flat.mul_(2)
    expected = [t.clone() * 2 for t in tensors]
    unflatten_into(flat, tensors)
    for t, e in zip(tensors, expected, strict=True):
        assert torch.allclose(t, e)
    with pytest.raises(ValueError):
        unflatten_into(flat[:-1], tensors)
    with pytest.raises(ValueError):
        flatten([torch.zeros(2, dtype=torch.int64)])


def test_same_boundaries_on_every_member() -> None:
    rnd = random.Random(1)
    bws = [rnd.uniform(0.1, 100.0) for _ in range(7)]
    modes = [rnd.choice([N, N, C, A]) for _ in range(7)]
    modes[0] = N
    parts = {
        Partition.for_group(make_group(modes, bws, i), 10**7 + 3, 1 << 16).part_bounds
        for i in range(7)
    }
    assert len(parts) == 1
