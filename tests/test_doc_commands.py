"""Every command the docs cite runs from a clean clone as written: the benchmark module or script
exists, each `--flag` it is cited with is one the benchmark (or a benchmarks module it imports)
declares, each `kvledger SUB --flag` is a flag of that subcommand's parser, and no doc cites a
path that exists only on the machine a figure was taken on. Nothing is run but parsers."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from kvledger.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_COMMAND = re.compile(r"(python -m benchmarks\.\w+|bash benchmarks/[\w.]+|kvledger [a-z]+)[^`|\n]*")
_IMPORT = re.compile(r"from benchmarks\.(\w+) import|import benchmarks\.(\w+)")
_MACHINE_PATH = re.compile(r"(?<![\w.~])/(work|root|home/\w+)/")


def _lines(path: Path) -> list[str]:
    """The doc's lines with backslash continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


def _cited() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for line in _lines(doc):
            for m in _COMMAND.finditer(line):
                out.append((doc.relative_to(ROOT).as_posix(), m.group(0).strip()))
    return out


def _flags(command: str) -> list[str]:
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote cut by the table or prose around the command
        words = command.split()
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)]


def _benchmark_sources(module: str) -> str:
    """The module's source and that of the benchmarks modules it imports (shared parsers)."""
    seen: set[str] = set()
    todo = [module]
    text = ""
    while todo:
        name = todo.pop()
        path = ROOT / "benchmarks" / f"{name}.py"
        if name in seen or not path.exists():
            continue
        seen.add(name)
        src = path.read_text()
        text += src
        todo += [a or b for a, b in _IMPORT.findall(src)]
    return text


def _subcommand_flags() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {opt for act in p._actions for opt in act.option_strings}
        for name, p in sub.choices.items()
    }


CITED = _cited()


def test_the_docs_cite_commands():
    # The extraction itself must see the commands the user page is built on.
    assert sum(c.startswith("python -m benchmarks.vs_vllm_cpu") for _, c in CITED) >= 3
    assert any(c.startswith("bash benchmarks/setup_vllm_env.sh") for _, c in CITED)
    assert any(c.startswith("kvledger serve") for _, c in CITED)


@pytest.mark.parametrize("doc,command", [c for c in CITED if not c[1].startswith("kvledger ")])
def test_cited_benchmark_exists_with_its_flags(doc, command):
    if command.startswith("bash "):
        script = command.split()[1]
        assert (ROOT / script).is_file(), f"{doc}: {script} is not in the repository"
        return
    module = command.split()[2].removeprefix("benchmarks.")
    assert (ROOT / "benchmarks" / f"{module}.py").is_file(), f"{doc}: no benchmarks/{module}.py"
    source = _benchmark_sources(module)
    missing = [f for f in _flags(command) if f'"{f}"' not in source and f"'{f}'" not in source]
    assert not missing, f"{doc}: `{command}` cites flags benchmarks/{module}.py does not declare: {missing}"


def test_cited_kvledger_commands_use_real_flags():
    flags = _subcommand_flags()
    bad = []
    for doc, command in CITED:
        if not command.startswith("kvledger "):
            continue
        sub = command.split()[1]
        if sub not in flags:
            continue  # prose such as "kvledger is ..." (the subcommand check is the parser's)
        bad += [(doc, command, f) for f in _flags(command) if f not in flags[sub]]
    assert not bad, bad


def test_no_doc_cites_a_machine_only_path():
    hits = [
        f"{doc.relative_to(ROOT)}:{i}: {line.strip()}"
        for doc in DOCS + [ROOT / "benchmarks" / "setup_vllm_env.sh"]
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        if _MACHINE_PATH.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_vllm_venv_default_lives_under_the_cache_dir(tmp_path, monkeypatch):
    import subprocess

    from benchmarks.common import default_vllm_venv

    monkeypatch.delenv("VLLM_VENV", raising=False)
    monkeypatch.setenv("KVLEDGER_CACHE_DIR", str(tmp_path / "cache"))
    expected = tmp_path / "cache" / "bench_envs" / "vllm"
    assert default_vllm_venv() == expected
    shell = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "setup_vllm_env.sh"), "--print-venv"],
        capture_output=True, text=True, check=True,
    )
    assert shell.stdout.strip() == str(expected)  # the script and the benchmarks agree
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "v"))
    assert default_vllm_venv() == tmp_path / "v"
