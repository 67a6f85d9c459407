"""Sizes the refactor of issue 40 settled: modules small enough to read whole, an engine whose
parts are built elsewhere. (Import direction: tests/test_layers.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvledger"
MAX_LINES = 600
MAX_ENGINE_LINES = 400


def test_modules_stay_under_the_line_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split by concept: {long}"


def test_the_engine_is_built_not_self_assembling():
    """LLMEngine stays a step loop: at most 400 lines, and its module imports no torch, no
    worker, no executor and no loader at run time (the builder hands it finished parts)."""
    tree = ast.parse((PACKAGE / "core" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine")
    assert cls.end_lineno - cls.lineno + 1 <= MAX_ENGINE_LINES
    runtime = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            runtime.add(node.module)
        elif isinstance(node, ast.Import):
            runtime |= {a.name for a in node.names}
    for forbidden in ("torch", "kvledger.worker", "kvledger.executor", "kvledger.model"):
        assert not any(m == forbidden or m.startswith(forbidden + ".") for m in runtime), forbidden
