"""GPU tests: run by ``make test-gpu`` on a machine with CUDA, never collected
by ``make test``. Without CUDA every test fails with one clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# the shared harnesses live one folder up
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device the tests run on; an error (not a skip) without one."""
    if not torch.cuda.is_available():
        raise RuntimeError("tests/gpu need a CUDA device: run them with make test-gpu on a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False  # identical maths on every peer
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())
