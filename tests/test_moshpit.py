"""The Moshpit grid schedule, simulated without a network.

A round of the simulation is what the matchmaking will do over the DHT: alive
peers that share ``group_key`` form a group, average, and move with
``next_coordinates_of_group``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from averaging._moshpit import MoshpitGrid, MoshpitState
from swarm import ConfigError

PREFIX = "run.grads"


def peer_ids(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(20) for _ in range(count)]


def simulate_round(
    grid: MoshpitGrid,
    ids: list[bytes],
    states: list[MoshpitState],
    values: np.ndarray,
    alive: list[bool],
) -> list[list[int]]:
    """One round in place; returns the groups (peer indices, ordered by peer id)."""
    groups: dict[str, list[int]] = {}
    for peer, state in enumerate(states):
        if alive[peer]:
            groups.setdefault(state.key(grid, PREFIX), []).append(peer)
        else:
            states[peer] = state.after_missed_round()
    for key, peers in groups.items():
        peers.sort(key=ids.__getitem__)
        members = [ids[peer] for peer in peers]
        group_id = hashlib.sha256(key.encode() + b"".join(members)).digest()
        values[peers] = values[peers].mean()
        for index, peer in enumerate(peers):
            states[peer] = states[peer].after_group(grid, group_id, members, index)
    return list(groups.values())


def full_grid(grid: MoshpitGrid, seed: int) -> tuple[list[bytes], list[MoshpitState]]:
    """One peer in every cell of the grid."""
    cells = list(itertools.product(range(grid.size), repeat=grid.dimensions))
    ids = peer_ids(len(cells), seed)
    return ids, [MoshpitState(0, cell) for cell in cells]


grids = st.builds(MoshpitGrid, dimensions=st.integers(1, 3), size=st.integers(1, 5)).filter(
    lambda grid: grid.capacity <= 125
)


# --- configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("dimensions", "size", "hint"),
    [
        (0, 8, "dimensions must be between 1 and 16"),
        (17, 2, "dimensions must be between 1 and 16"),
        (2, 0, "size (cells per axis"),
        (2, 2**16 + 1, "size (cells per axis"),
        (16, 2**16, "lower dimensions or size"),
        (2.0, 8, "dimensions must be an int"),
        (2, True, "size must be an int"),
    ],
)
def test_invalid_grid_says_what_to_change(dimensions: int, size: int, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint.replace("(", r"\(")):
        MoshpitGrid(dimensions=dimensions, size=size)


@pytest.mark.parametrize(
    ("peers", "target", "dimensions", "size"),
    [
        (1024, 32, 2, 32),  # the paper's 32x32 grid
        (900, 32, 2, 30),
        (1100, 32, 3, 11),  # not 32^3 with one peer per group
        (32, 32, 1, 32),  # one group: plain all-reduce
        (1, 8, 1, 1),
        (4096, 16, 3, 16),
    ],
)
def test_for_swarm(peers: int, target: int, dimensions: int, size: int) -> None:
    assert MoshpitGrid.for_swarm(peers, target) == MoshpitGrid(dimensions, size)


@given(st.integers(1, 10**7), st.integers(3, 300))
def test_for_swarm_is_the_fullest_grid_with_groups_within_target(peers: int, target: int) -> None:
    grid = MoshpitGrid.for_swarm(peers, target)
    assert grid.size <= target
    assert target ** (grid.dimensions - 1) < peers or grid.dimensions == 1
    assert grid.capacity >= peers > (grid.size - 1) ** grid.dimensions


@pytest.mark.parametrize(
    ("peers", "target", "hint"),
    [
        (0, 32, "expected_peers must be at least 1"),
        (100, 1, "target_group_size must be at least 2"),
        (2**16 + 1, 2, "raise target_group_size"),
    ],
)
def test_for_swarm_rejects_bad_input(peers: int, target: int, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        MoshpitGrid.for_swarm(peers, target)


# --- keys and assignments --------------------------------------------------------


def test_group_key_format() -> None:
    grid = MoshpitGrid(3, 8)
    assert grid.group_key("run", 0, (1, 2, 3)) == "run.moshpit.r0.*.2.3"
    assert grid.group_key("run", 4, (1, 2, 3)) == "run.moshpit.r4.1.*.3"
    assert grid.group_key("run", 5, (1, 2, 3)) == "run.moshpit.r5.1.2.*"
    assert MoshpitGrid(1, 8).group_key("run", 3, (5,)) == "run.moshpit.r3.*"


def test_known_values_do_not_change() -> None:
    """Peers on different versions must agree: pin the hashes and the schedule."""
    grid = MoshpitGrid(2, 32)
    assert grid.initial_coordinates(bytes(range(20))) == (9, 27)
    members = [bytes([i]) * 20 for i in range(4)]
    assert grid.next_coordinates_of_group(5, (3, 17), b"group", members) == [
        (3, 8),
        (3, 5),
        (3, 6),
        (3, 7),
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda g: g.group_key("", 0, (0, 0)), "prefix"),
        (lambda g: g.group_key("p", -1, (0, 0)), "round"),
        (lambda g: g.group_key("p", 0, (0,)), "needs 2 coordinates"),
        (lambda g: g.group_key("p", 0, (0, 4)), "outside"),
        (lambda g: g.next_coordinates_of_group(0, (0, 0), b"g", []), "at least one member"),
        (lambda g: g.next_coordinates_of_group(0, (0, 0), b"g", [b"a", b"a"]), "more than once"),
        (lambda g: g.next_coordinates(0, (0, 0), b"g", [b"a", b"b"], 2), "not a position"),
    ],
)
def test_bad_arguments_raise_value_error(
    call: Callable[[MoshpitGrid], object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call(MoshpitGrid(2, 4))


@settings(max_examples=200)
@given(
    grid=grids,
    round=st.integers(0, 2**63),
    seed=st.integers(0, 2**32),
    group_id=st.binary(min_size=0, max_size=32),
    data=st.data(),
)
def test_members_agree_and_scatter(
    grid: MoshpitGrid, round: int, seed: int, group_id: bytes, data: st.DataObject
) -> None:
    """Every member computes the same assignment; group-mates never share a key next round."""
    axis = grid.axis(round)
    size = data.draw(st.integers(1, grid.size))
    shared = data.draw(st.tuples(*[st.integers(0, grid.size - 1)] * grid.dimensions))
    members = peer_ids(size, seed)
    # Members share every coordinate but the round's axis, where each may sit anywhere.
    own = [
        tuple(
            data.draw(st.integers(0, grid.size - 1)) if i == axis else c
            for i, c in enumerate(shared)
        )
        for _ in members
    ]
    assert len({grid.group_key(PREFIX, round, c) for c in own}) == 1

    agreed = grid.next_coordinates_of_group(round, shared, group_id, members)
    for index, coordinates in enumerate(own):
        assert grid.next_coordinates(round, coordinates, group_id, members, index) == agreed[index]
        assert grid.next_coordinates(round, coordinates, group_id, members, index) == agreed[index]
    # Only the round's axis moves, and onto distinct cells.
    for new in agreed:
        assert [c for i, c in enumerate(new) if i != axis] == [
            c for i, c in enumerate(shared) if i != axis
        ]
    assert len({new[axis] for new in agreed}) == size
    if grid.dimensions >= 2:
        assert len({grid.group_key(PREFIX, round + 1, new) for new in agreed}) == size


@given(grid=grids, seed=st.integers(0, 2**32), group_id=st.binary(max_size=16))
def test_assignment_does_not_depend_on_member_order(
    grid: MoshpitGrid, seed: int, group_id: bytes
) -> None:
    members = peer_ids(grid.size, seed)
    shuffled = members[::-1]
    first = dict(
        zip(
            members,
            grid.next_coordinates_of_group(3, (0,) * grid.dimensions, group_id, members),
            strict=True,
        )
    )
    second = dict(
        zip(
            shuffled,
            grid.next_coordinates_of_group(3, (0,) * grid.dimensions, group_id, shuffled),
            strict=True,
        )
    )
    assert first == second


def test_initial_coordinates_are_deterministic_and_spread() -> None:
    grid = MoshpitGrid(2, 8)
    ids = peer_ids(6400, seed=1)
    cells = [grid.initial_coordinates(peer_id) for peer_id in ids]
    assert cells == [grid.initial_coordinates(peer_id) for peer_id in ids]
    counts = np.bincount([x * 8 + y for x, y in cells], minlength=64)
    assert counts.min() > 60 and counts.max() < 140  # about 100 each
    assert MoshpitState.join(grid, ids[0], round=7) == MoshpitState(7, cells[0])


def test_missed_round_keeps_the_cell() -> None:
    state = MoshpitState(4, (1, 2))
    assert state.after_missed_round() == MoshpitState(5, (1, 2))


# --- averaging ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(grid=grids, seed=st.integers(0, 2**32))
def test_full_grid_gives_exact_mean_after_d_rounds(grid: MoshpitGrid, seed: int) -> None:
    ids, states = full_grid(grid, seed)
    values = np.random.default_rng(seed).normal(0, 1, len(ids))
    mean = values.mean()
    for _ in range(grid.dimensions):
        groups = simulate_round(grid, ids, states, values, [True] * len(ids))
        # Every group is a full line and the grid stays one peer per cell.
        assert all(len(group) == grid.size for group in groups)
        assert len({state.coordinates for state in states}) == len(ids)
    np.testing.assert_allclose(values, mean, rtol=0, atol=1e-12)


def test_simulation_is_deterministic() -> None:
    def run() -> tuple[np.ndarray, list[MoshpitState]]:
        grid = MoshpitGrid(2, 8)
        ids = peer_ids(50, seed=3)
        states = [MoshpitState.join(grid, peer_id) for peer_id in ids]
        values = np.random.default_rng(3).normal(0, 1, 50)
        for round in range(4):
            simulate_round(grid, ids, states, values, [(i + round) % 7 != 0 for i in range(50)])
        return values, states

    (values_a, states_a), (values_b, states_b) = run(), run()
    assert states_a == states_b
    np.testing.assert_array_equal(values_a, values_b)


@pytest.mark.parametrize(("dimensions", "size", "peers"), [(2, 32, 900), (3, 8, 400)])
def test_spread_shrinks_with_failures(dimensions: int, size: int, peers: int) -> None:
    """With 10% of peers dropping out of every round, the spread still falls fast."""
    grid = MoshpitGrid(dimensions, size)
    ids = peer_ids(peers, seed=7)
    states = [MoshpitState.join(grid, peer_id) for peer_id in ids]
    rng = np.random.default_rng(7)
    values = rng.normal(0, 1, peers)
    mean = values.mean()
    spread = [float(np.mean((values - mean) ** 2))]
    for _ in range(12):
        simulate_round(grid, ids, states, values, (rng.random(peers) >= 0.1).tolist())
        spread.append(float(np.mean((values - mean) ** 2)))
    # Group averaging keeps each group's sum, so the mean never moves ...
    assert math.isclose(values.mean(), mean, abs_tol=1e-12)
    # ... and it never increases the spread, which falls by orders of magnitude.
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(spread))
    assert spread[-1] < 1e-6 * spread[0]


def test_paper_32x32_cells_converge_without_failures() -> None:
    """N=900 on the paper's 32x32 grid: below 1e-9 within 5 rounds (paper: 5.0)."""
    grid = MoshpitGrid(2, 32)
    ids = peer_ids(900, seed=11)
    states = [MoshpitState.join(grid, peer_id) for peer_id in ids]
    values = np.random.default_rng(11).normal(0, 1, 900)
    mean = values.mean()
    for _ in range(5):
        simulate_round(grid, ids, states, values, [True] * 900)
    assert float(np.mean((values - mean) ** 2)) < 1e-9


@pytest.mark.slow
def test_benchmark_needs_no_more_rounds_than_the_paper() -> None:
    """benchmarks/moshpit.py with its default seeds: every cell at or below the paper."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "moshpit.py"
    result = subprocess.run(
        [sys.executable, str(script), "--json"], capture_output=True, text=True, check=True
    )
    cells = json.loads(result.stdout)
    assert {(cell["n"], cell["p"]) for cell in cells} == {
        (n, p) for n in (512, 768, 900) for p in (0.0, 0.01)
    }
    for cell in cells:
        assert cell["paper"] is not None
        assert cell["rounds"] <= cell["paper"], cell
