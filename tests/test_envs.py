"""kvledger/envs.py is the one place a KVLEDGER_* environment variable is declared and read: every
name the package mentions is declared there, nothing else reads one from os.environ, values are read
at access time, bad values are ConfigErrors, and the old cache-directory name still works, with a
warning."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from kvledger import envs
from kvledger.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvledger"
ENVS = PACKAGE / "envs.py"
# A variable name, not part of a longer identifier (the dashboard's /*__KVLEDGER_DATA__*/ marker
# and the C headers' include guards are neither Python nor variables).
NAME = re.compile(r"(?<![A-Za-z0-9_])KVLEDGER_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")


def _sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != ENVS]


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every read of a KVLEDGER_* variable from the process environment:
    os.environ.get / [] / in / pop / setdefault and os.getenv, with the name given as a string or
    as a module-level string constant."""
    tree = ast.parse(source)
    consts = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return consts.get(node.id)
        return None

    def is_environ(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ"
        )

    reads = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (
                f.attr == "getenv"
                or (f.attr in ("get", "pop", "setdefault") and is_environ(f.value))
            ):
                key = name_of(node.args[0])
        elif (
            isinstance(node, ast.Subscript)
            and is_environ(node.value)
            and isinstance(node.ctx, ast.Load)
        ):
            key = name_of(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = name_of(node.left)
        if key is not None and key.startswith("KVLEDGER_"):
            reads.append((node.lineno, key))
    return reads


def test_the_scanner_finds_every_kind_of_read():
    planted = (
        'import os\nENV = "KVLEDGER_X"\n'
        'a = os.environ.get("KVLEDGER_A", "1")\nb = os.getenv("KVLEDGER_B")\n'
        'c = os.environ["KVLEDGER_C"]\nd = "KVLEDGER_D" in os.environ\ne = os.environ.get(ENV)\n'
        'os.environ["KVLEDGER_W"] = "written, not read"\nf = os.environ.get("HOME")\n'
    )
    assert [n for _, n in env_reads(planted)] == [
        "KVLEDGER_A",
        "KVLEDGER_B",
        "KVLEDGER_C",
        "KVLEDGER_D",
        "KVLEDGER_X",
    ]


def test_no_module_but_envs_reads_a_kvledger_variable():
    reads = {
        f"{p.relative_to(ROOT)}:{line} {name}"
        for p in _sources()
        for line, name in env_reads(p.read_text())
    }
    assert not reads, f"read through kvledger.envs instead: {sorted(reads)}"


def test_every_variable_the_package_names_is_declared():
    named = {m for p in _sources() for m in NAME.findall(p.read_text())}
    assert named, "the scan found nothing: the pattern is broken"
    assert named <= set(envs.environment_variables), sorted(named - set(envs.environment_variables))


def test_every_variable_is_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name, var in envs.environment_variables.items():
        assert f"`{name}`" in readme, name
        assert var.doc and var.type and var.default


def test_values_are_read_at_access_time(monkeypatch):
    monkeypatch.delenv("KVLEDGER_FUSED_LAYER", raising=False)
    assert envs.KVLEDGER_FUSED_LAYER is True
    monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "0")
    assert envs.KVLEDGER_FUSED_LAYER is False
    monkeypatch.setenv("KVLEDGER_FUSED_LAYER", "yes")  # anything but 0 leaves a switch on
    assert envs.KVLEDGER_FUSED_LAYER is True
    monkeypatch.delenv("KVLEDGER_MASK_THREADS", raising=False)
    assert envs.KVLEDGER_MASK_THREADS == 1
    monkeypatch.setenv("KVLEDGER_MASK_THREADS", "3")
    assert envs.KVLEDGER_MASK_THREADS == 3
    monkeypatch.setenv("KVLEDGER_STEP_TRACE", "")
    assert envs.KVLEDGER_STEP_TRACE is None  # empty is unset
    monkeypatch.setenv("KVLEDGER_WORKER_CONNECT_TIMEOUT", "2.5")
    assert envs.KVLEDGER_WORKER_CONNECT_TIMEOUT == 2.5
    assert "KVLEDGER_NATIVE_ISA" in dir(envs)
    with pytest.raises(AttributeError):
        envs.KVLEDGER_NO_SUCH_VARIABLE  # noqa: B018


@pytest.mark.parametrize(
    "name, value, needle",
    [
        ("KVLEDGER_MASK_THREADS", "0", "KVLEDGER_MASK_THREADS must be a positive integer, got '0'"),
        (
            "KVLEDGER_MASK_THREADS",
            "two",
            "KVLEDGER_MASK_THREADS must be a positive integer, got 'two'",
        ),
        (
            "KVLEDGER_WORKER_CONNECT_TIMEOUT",
            "-1",
            "KVLEDGER_WORKER_CONNECT_TIMEOUT must be a positive",
        ),
        (
            "KVLEDGER_WORKER_CONNECT_TIMEOUT",
            "soon",
            "KVLEDGER_WORKER_CONNECT_TIMEOUT must be a positive",
        ),
        (
            "KVLEDGER_ENGINE_START_METHOD",
            "thread",
            "KVLEDGER_ENGINE_START_METHOD must be one of fork",
        ),
    ],
)
def test_bad_values_are_config_errors_naming_the_variable(monkeypatch, name, value, needle):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        getattr(envs, name)


def test_the_old_cache_name_still_works_and_warns(monkeypatch, tmp_path):
    from kvledger.model.tiny import VERSION, default_model_path

    monkeypatch.delenv("KVLEDGER_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="KVLEDGER_CACHE_DIR"):
        assert envs.KVLEDGER_CACHE_DIR == tmp_path / "old"
    with pytest.warns(DeprecationWarning, match="KVLEDGER_CACHE_DIR"):
        assert default_model_path() == tmp_path / "old" / f"kvledger-tiny-{VERSION}"  # honoured
    # The new name wins, silently.
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "new"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert envs.KVLEDGER_CACHE_DIR == tmp_path / "new"
    # Neither: XDG's cache home, as the native build always did.
    monkeypatch.delenv("KVLEDGER_CACHE_DIR")
    monkeypatch.delenv("KVLEDGER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.KVLEDGER_CACHE_DIR == tmp_path / "xdg" / "kvledger"
