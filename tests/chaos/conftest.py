"""The chaos tests import the shared harnesses of ``tests/`` (``cli_harness``) the way
the tests beside them do: by module name, with ``tests/`` on ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
