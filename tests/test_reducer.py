import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging._faults import FaultPlan, InjectedFault, MemberFault
from averaging._reducer import PartReducer, ReceivedParts
from swarm import ProtocolError


def data(sender: int, size: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(sender))


def test_all_deliver_weighted_mean() -> None:
    sizes = [3, 3, 2]
    weights = {0: 1.0, 1: 3.0}
    r = PartReducer(sizes, weights)
    x = {s: data(s, 8) for s in weights}
    assert r.add(0, 0, x[0][:3]) == range(0, 0)
    assert r.add(0, 1, x[0][3:6]) == range(0, 0)
    assert r.add(1, 0, x[1][:3]) == range(0, 1)
    assert r.add(1, 1, x[1][3:6]) == range(1, 2)
    r.add(1, 2, x[1][6:])
    assert r.add(0, 2, x[0][6:]) == range(2, 3)
    assert r.done
    mean = (x[0] + 3 * x[1]) / 4
    got = torch.cat([t for c in range(3) if (t := r.result(c)) is not None])
    assert torch.allclose(got, mean)
    assert all(r.contributors(c) == {0, 1} for c in range(3))


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_sender_of_weight_zero_is_waited_for_but_is_no_contributor(zero_first: bool) -> None:
    r = PartReducer([4], {0: 2.0, 1: 0.0, 2: 1.0})
    x = {s: data(s, 4) for s in range(3)}
    order = [1, 0, 2] if zero_first else [0, 2, 1]
    for s in order[:-1]:
        assert r.add(s, 0, x[s]) == range(0, 0)  # the last sender is still expected
    assert r.add(order[-1], 0, x[order[-1]]) == range(0, 1)
    result = r.result(0)
    assert result is not None
    torch.testing.assert_close(result, (2 * x[0] + x[2]) / 3)
    assert r.contributors(0) == {0, 2}


def test_a_chunk_only_senders_of_weight_zero_delivered_has_no_result() -> None:
    r = PartReducer([3], {0: 0.0, 1: 0.0})
    r.add(0, 0, data(0, 3))
    assert r.add(1, 0, data(1, 3)) == range(0, 1)
    assert r.result(0) is None and r.contributors(0) == frozenset()


def test_failed_sender_excluded_from_undelivered_chunks_only() -> None:
    r = PartReducer([2, 2, 2], {0: 1.0, 1: 1.0, 2: 2.0})
    x = {s: data(s, 6) for s in range(3)}
    for s in (0, 2):
        for c in range(3):
            r.add(s, c, x[s][2 * c : 2 * c + 2])
    r.add(1, 0, x[1][:2])
    assert r.completed == 1
    assert r.fail(1) == range(1, 3)
    assert r.contributors(0) == {0, 1, 2} and r.contributors(1) == {0, 2}
    res0, res2 = r.result(0), r.result(2)
    assert res0 is not None and res2 is not None
    assert torch.allclose(res0, (x[0][:2] + x[1][:2] + 2 * x[2][:2]) / 4)
    assert torch.allclose(res2, (x[0][4:] + 2 * x[2][4:]) / 3)
    assert r.failed == {1}


def test_nan_excludes_sender_and_late_data_is_ignored() -> None:
    r = PartReducer([2, 2], {0: 1.0, 1: 1.0})
    bad = torch.tensor([1.0, float("nan")])
    r.add(0, 0, torch.ones(2))
    assert r.add(1, 0, bad) == range(0, 1)
    assert r.contributors(0) == {0}
    assert r.add(1, 1, torch.ones(2)) == range(1, 1)  # ignored, already excluded
    r.add(0, 1, torch.full((2,), 5.0))
    res = r.result(1)
    assert res is not None and torch.equal(res, torch.full((2,), 5.0))


def test_nobody_delivered_means_no_result() -> None:
    r = PartReducer([2, 2], {0: 1.0, 1: 0.0})
    r.add(1, 0, torch.ones(2))
    r.fail_all([0, 1])
    assert r.done and r.result(0) is None and r.result(1) is None
    assert r.contributors(0) == frozenset()


def test_protocol_violations() -> None:
    r = PartReducer([2, 2], {0: 1.0})
    with pytest.raises(ProtocolError):
        r.add(5, 0, torch.ones(2))
    with pytest.raises(ProtocolError, match="expected chunk 0"):
        r.add(0, 1, torch.ones(2))
    with pytest.raises(ProtocolError, match="has 2 values"):
        r.add(0, 0, torch.ones(3))
    with pytest.raises(ValueError):
        PartReducer([1], {0: float("nan")})
    with pytest.raises(ValueError):
        r.result(0)


def test_empty_part_is_done_at_once() -> None:
    assert PartReducer([], {0: 1.0}).done


@given(
    st.integers(1, 5),
    st.integers(1, 6),
    st.lists(st.floats(0.1, 10.0), min_size=5, max_size=5),
    st.lists(st.integers(0, 7), min_size=5, max_size=5),
    st.randoms(use_true_random=False),
)
@settings(max_examples=300)
def test_any_interleaving_gives_mean_over_deliverers(
    n: int, chunks: int, weights: list[float], stop_at: list[int], rnd: object
) -> None:
    import random

    assert isinstance(rnd, random.Random)
    sizes = [3] * chunks
    w = {s: weights[s] for s in range(n)}
    x = {s: data(s, 3 * chunks) for s in range(n)}
    r = PartReducer(sizes, w)
    # Each sender delivers stop_at[s] chunks (all if >= chunks) and then fails.
    pending = {s: [c for c in range(min(stop_at[s], chunks))] for s in range(n)}
    done = 0
    while any(pending.values()) or any(s in r.alive and stop_at[s] < chunks for s in range(n)):
        choices = [s for s in range(n) if pending[s]]
        failing = [s for s in range(n) if not pending[s] and s in r.alive and stop_at[s] < chunks]
        s = rnd.choice(choices + failing)
        if pending[s]:
            c = pending[s].pop(0)
            got = r.add(s, c, x[s][3 * c : 3 * c + 3])
        else:
            got = r.fail(s)
        assert got.start == done
        done = got.stop
    assert r.done and done == chunks
    for c in range(chunks):
        deliverers = {s for s in range(n) if stop_at[s] > c}
        assert r.contributors(c) == deliverers
        res = r.result(c)
        if not deliverers:
            assert res is None
            continue
        total = sum(w[s] for s in deliverers)
        expected = sum(w[s] * x[s][3 * c : 3 * c + 3] for s in deliverers) / total
        assert res is not None and torch.allclose(res, expected, atol=1e-5)


def test_received_parts_records_local_for_missing_chunks() -> None:
    rp = ReceivedParts([2, 0, 3], local_index=1)
    rp.received(0, 0, frozenset({0, 1}))
    rp.received(0, 1, frozenset({0, 1, 2}))
    rp.received(2, 0, frozenset({1, 2}))
    rp.reducer_failed(2)
    rp.reducer_failed(0)  # complete: not a failure
    with pytest.raises(ProtocolError):
        rp.received(0, 0, frozenset({0}))
    assert rp.failed_reducers == {2}
    assert rp.contributors() == (
        (frozenset({0, 1}), frozenset({0, 1, 2})),
        (),
        (frozenset({1, 2}), frozenset({1}), frozenset({1})),
    )


async def test_fault_plan_hooks() -> None:
    plan = FaultPlan({2: MemberFault(fail_after_sending=1, fail_after_reducing=0)})
    ok = plan.for_member(0)
    await ok.before_send(100)
    await ok.before_reply(100)
    bad = plan.for_member(2)
    await bad.before_send(0)
    with pytest.raises(InjectedFault):
        await bad.before_send(1)
    with pytest.raises(InjectedFault):
        await bad.before_reply(0)
    with pytest.raises(ValueError):
        MemberFault(cancel_before_chunk=0)


def test_single_contributor_is_exact() -> None:
    x = data(0, 4) / 3
    r = PartReducer([4], {0: 3.0, 1: 1.0})
    r.add(0, 0, x)
    r.fail(1)
    res = r.result(0)
    assert res is not None and torch.equal(res, x)


def test_a_sum_that_overflows_float32_gives_no_result() -> None:
    """Finite values whose weighted sum overflows: that chunk has no result (all
    members keep their local values), the other chunk is averaged as usual."""
    r = PartReducer([2, 2], {0: 1.0, 1: 1.0})
    big = torch.tensor([3e38, 1.0, 1.0, 2.0])
    r.add(0, 0, big[:2])
    r.add(0, 1, big[2:])
    r.add(1, 0, big[:2])
    assert r.add(1, 1, big[2:] * 3) == range(1, 2)
    assert r.result(0) is None and r.contributors(0) == frozenset()
    assert torch.equal(r.result(1), torch.tensor([2.0, 4.0]))
    assert r.failed == frozenset()
