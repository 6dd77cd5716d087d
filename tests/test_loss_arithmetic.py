"""benchmarks/loss_arithmetic.py's lossy round: the plane's estimator on a
vector cut into one part per peer, with contributions and results lost at
random (seeded)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from averaging._pieces import PIECE_ELEMENTS

ROOT = Path(__file__).resolve().parents[1]


def _load_benchmark() -> ModuleType:
    path = ROOT / "benchmarks" / "loss_arithmetic.py"
    spec = importlib.util.spec_from_file_location("loss_arithmetic", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()


def _vectors(peers: int = 4, size: int = 10 * PIECE_ELEMENTS + 17) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(size, generator=generator) for _ in range(peers)]


def test_without_loss_every_peer_holds_the_mean() -> None:
    vectors = _vectors()
    mean = torch.stack(vectors).mean(dim=0)
    for held in bench.lossy_mean(vectors, 0.0, torch.Generator().manual_seed(1)):
        assert torch.allclose(held, mean, atol=1e-6)


def test_lost_contributions_leave_every_peer_the_same_estimate_of_the_mean() -> None:
    """Every result comes back: the peers agree, and each piece is the mean
    of the contributions that reached its reducer (never of nothing)."""
    vectors = _vectors()
    held = bench.lossy_mean(vectors, 0.5, torch.Generator().manual_seed(2), lose_results=False)
    for other in held[1:]:
        assert torch.equal(other, held[0])
    mean = torch.stack(vectors).mean(dim=0)
    assert not torch.allclose(held[0], mean, atol=1e-6)  # pieces were lost
    size = vectors[0].numel()
    bounds = [size * j // 4 for j in range(5)]
    for j in range(4):  # each piece of part j: the mean of a subset that holds j
        for start in range(bounds[j], bounds[j + 1], PIECE_ELEMENTS):
            piece = slice(start, min(start + PIECE_ELEMENTS, bounds[j + 1]))
            subsets = [
                torch.stack([vectors[s][piece] for s in range(4) if (mask >> s) & 1]).mean(dim=0)
                for mask in range(1, 16)
                if (mask >> j) & 1
            ]
            assert any(torch.allclose(held[0][piece], s, atol=1e-6) for s in subsets)


def test_a_lost_result_leaves_a_peer_its_own_values() -> None:
    """With every result lost, a peer holds the exact mean on its own part
    only (no contribution is lost on the way) and its own values elsewhere."""
    vectors = _vectors()
    size = vectors[0].numel()
    held = bench.lossy_mean(
        vectors, 0.999999, torch.Generator().manual_seed(3), lose_contributions=False
    )
    mean = torch.stack(vectors).mean(dim=0)
    bounds = [size * j // 4 for j in range(5)]
    for peer in range(4):
        a, b = bounds[peer], bounds[peer + 1]
        assert torch.allclose(held[peer][a:b], mean[a:b], atol=1e-6)
        assert torch.equal(held[peer][:a], vectors[peer][:a])
        assert torch.equal(held[peer][b:], vectors[peer][b:])


def test_a_parity_datagram_rebuilds_one_lost_piece_of_its_group_never_two() -> None:
    arrived = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    # parity never lost: the first group of 4 is whole again, the second
    # (two lost) is not, the third (3 pieces, one lost) is
    repaired = bench._repaired(arrived, 4, 0.0, torch.Generator().manual_seed(4))
    expected = [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert repaired.tolist() == [bool(x) for x in expected]
    # every parity datagram lost: nothing is rebuilt
    lost = bench._repaired(arrived, 4, 0.999999, torch.Generator().manual_seed(5))
    assert torch.equal(lost, arrived)
