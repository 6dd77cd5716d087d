"""No code from peers: the source of the four packages never deserializes with
pickle or marshal, never evaluates strings, and never ``torch.load``s without
``weights_only=True``. Checked on the syntax tree, so a comment or a docstring
that mentions pickle is fine and an aliased import is not.

The one place that runs code from a file is ``trainer/_task.py``: it imports
the task file the *local* user names on the command line
(``--task FILE.py:FACTORY``), never anything a peer sent.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swarm", "dht", "averaging", "trainer")

#: Modules that turn bytes into code or arbitrary objects.
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}
#: Builtins that run code from strings.
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
#: (file, module) pairs allowed, with the reason.
ALLOWED_IMPORTS = {
    ("trainer/_task.py", "importlib.util"): "imports the local user's --task file",
}


def _is_true(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def violations(source: str, filename: str) -> list[str]:
    """Every forbidden construct in ``source``, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            for name in names:
                root = name.split(".")[0]
                loads_code = root == "importlib" and (filename, name) not in ALLOWED_IMPORTS
                if root in FORBIDDEN_MODULES or loads_code:
                    found.append(f"{where}: imports {name}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS:
                found.append(f"{where}: calls {func.id}()")
            name = _dotted(func)
            if name.endswith(".load") and name.split(".")[0] in {"torch", "numpy", "np"}:
                keyword = "allow_pickle" if name.split(".")[0] != "torch" else "weights_only"
                value = next((k.value for k in node.keywords if k.arg == keyword), None)
                if keyword == "weights_only":
                    safe = value is not None and _is_true(value)
                else:
                    safe = value is None or (
                        isinstance(value, ast.Constant) and value.value is False
                    )
                if not safe:
                    found.append(f"{where}: {name}() without {keyword} set safely")
            if name in {"yaml.load", "yaml.unsafe_load", "jsonpickle.decode"}:
                found.append(f"{where}: calls {name}()")
    return found


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_packages_never_deserialize_code() -> None:
    files = _sources()
    assert len(files) > 30  # the scan really sees the packages
    found = [
        v
        for path in files
        for v in violations(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert found == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "import marshal",
        "from _pickle import loads",
        "eval(data)",
        "exec(data)",
        "compile(data, 'x', 'exec')",
        "__import__(name)",
        "import importlib",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
        "np.load(f, allow_pickle=True)",
    ],
)
def test_the_scan_catches_each_forbidden_construct(snippet: str) -> None:
    assert len(violations(snippet, "swarm/_example.py")) == 1


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(f, weights_only=True)",
        "model.eval()",
        "np.load(f)",
        '"""we never use pickle"""',
    ],
)
def test_the_scan_allows_safe_uses(snippet: str) -> None:
    assert violations(snippet, "swarm/_example.py") == []
