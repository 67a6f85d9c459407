"""Structure the refactor of issue 40 settled: modules small enough to read whole, and package
imports that go one way (no module needs another that needs it back)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvledger"
MAX_LINES = 600
# Packages already within the limit (the rest of kvledger/ joins as its refactor lands).
SIZED = ["model", "kernels", "ledger", "hf"]


@pytest.mark.parametrize("package", SIZED)
def test_modules_stay_under_the_line_limit(package):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((PACKAGE / package).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by concept: {long}"
    assert len((PACKAGE / "envs.py").read_text().splitlines()) <= MAX_LINES


def _imports(path: Path, package: str) -> set[str]:
    """The modules of ``package`` that the module at ``path`` imports, at any depth in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n.startswith(package + ".")}
    return found


def _cycle(package: str, root: Path = PACKAGE) -> list[str] | None:
    """An import cycle among the modules of one package (root: the kvledger folder), or None."""
    folder = root.joinpath(*package.split(".")[1:])
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {m: _imports(p, package) & modules.keys() for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path, m, n]
            if n not in state and (found := visit(n, [*path, m])):
                return found
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m, []))), None)


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "kvledger" / "loop"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("from kvledger.loop import b\n")
    (pkg / "b.py").write_text("def f():\n    from kvledger.loop.a import x\n")
    assert _cycle("kvledger.loop", tmp_path / "kvledger") == [
        "kvledger.loop.a",
        "kvledger.loop.b",
        "kvledger.loop.a",
    ]


def test_the_kernels_import_one_way():
    """native_build (the library) <- gemm_rows (which rows go where) <- native (the ops' wrappers)
    <- fused_layer: no kernels module imports one that imports it back, even inside a function."""
    assert _cycle("kvledger.kernels") is None, _cycle("kvledger.kernels")
    kernels = PACKAGE / "kernels"
    assert _imports(kernels / "native_build.py", "kvledger.kernels") == set()
    assert "kvledger.kernels.native" not in _imports(kernels / "gemm_rows.py", "kvledger.kernels")
