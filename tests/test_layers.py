"""Layers hold (issue 40, item 4): the import graph of ``kvledger/`` has no circles, and the
processes import only the layers they run.

The graph is read from the source with ``ast``: every ``import``/``from ... import`` in a module,
at module level and inside functions and classes (a deferred import is still a dependency: it
only moves the cost, not the coupling), except under ``if TYPE_CHECKING:`` (hints only, never
executed). Each import is resolved to the kvledger module it loads: ``from kvledger.a import b``
is an edge to ``kvledger.a.b`` when that is a module, else to ``kvledger.a``.

The process checks run ``python -c`` in a fresh interpreter and read ``sys.modules``: what a
process imports is what it pays at start-up, and what it can break.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvledger"


# -- the import graph ------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run: all of them but those under TYPE_CHECKING."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the body is for type checkers only
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The kvledger module that importing ``name`` loads (the longest existing prefix)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(modules: dict[str, Path]) -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported kvledger module, 'from X import Y' text)} for each import."""
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "kvledger":
                        target = _resolve(alias.name, modules)
                        edges[mod].add((target, f"import {alias.name}"))
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                pkg = mod if is_pkg else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if base.split(".")[0] != "kvledger":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _resolve(base, modules)
                edges[mod].add((target, f"from {base} import {alias.name}"))
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components with more than one member."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def package_of(mod: str) -> str:
    """The layer a module belongs to: ``kvledger.X`` (a subpackage or a top-level module)."""
    return ".".join(mod.split(".")[:2])


def describe(comps: list[list[str]], graph: dict[str, set[str]], why) -> str:
    lines = []
    for comp in comps:
        members = set(comp)
        lines.append("circle: " + ", ".join(comp))
        for a in comp:
            for b in sorted(graph.get(a, ()) & members):
                lines.append(f"    {a} -> {b}   ({'; '.join(sorted(why[a, b]))})")
    return "\n".join(lines)


@functools.cache
def _graphs():
    """The package's import graphs, read once for the module (every test here reads them)."""
    modules = all_modules()
    edges = import_edges(modules)
    mod_graph: dict[str, set[str]] = defaultdict(set)
    mod_why: dict[tuple[str, str], set[str]] = defaultdict(set)
    pkg_graph: dict[str, set[str]] = defaultdict(set)
    pkg_why: dict[tuple[str, str], set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b, text in targets:
            if b is None or b == a:
                continue
            mod_graph[a].add(b)
            mod_why[a, b].add(text)
            pa, pb = package_of(a), package_of(b)
            if pa != pb:
                pkg_graph[pa].add(pb)
                pkg_why[pa, pb].add(f"{a}: {text}")
    return modules, edges, (mod_graph, mod_why), (pkg_graph, pkg_why)


def test_the_graph_reader_sees_what_it_must():
    """The reader itself: function-level imports count, TYPE_CHECKING ones do not, ``from
    package import module`` lands on the module. (Otherwise the tests below pass vacuously.)"""
    modules, edges, (mod_graph, _), _ = _graphs()
    assert len(modules) > 100
    # Deferred (inside a function) in kvledger/commands/serve.py.
    assert "kvledger.server.app" in mod_graph["kvledger.commands.serve"]
    # kvledger/engine/core_proc.py: `from kvledger.engine import core_protocol as wire`.
    assert "kvledger.engine.core_protocol" in mod_graph["kvledger.engine.core_proc"]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvledger.core.engine import LLMEngine\n"
        "else:\n    import kvledger.config\n"
        "def f():\n    from kvledger.server import app\n"
    )
    seen = {(n.module, tuple(a.name for a in n.names)) if isinstance(n, ast.ImportFrom)
            else (None, tuple(a.name for a in n.names)) for n in _imports(tree)}  # fmt: skip
    assert seen == {("typing", ("TYPE_CHECKING",)), (None, ("kvledger.config",)),
                    ("kvledger.server", ("app",))}  # fmt: skip
    circle = strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert circle == [["a", "b", "c"]]


def test_no_import_circle_between_modules():
    _, _, (graph, why), _ = _graphs()
    comps = strongly_connected(graph)
    assert not comps, "import circles between kvledger modules:\n" + describe(comps, graph, why)


def test_no_import_circle_between_layers():
    """Subpackages (``kvledger.core``, ``kvledger.server``, ...) and top-level modules
    (``kvledger.config``, ...) form a graph without circles: each layer can be read, tested and
    imported without the ones above it."""
    _, _, _, (graph, why) = _graphs()
    comps = strongly_connected(graph)
    assert not comps, "import circles between kvledger layers:\n" + describe(comps, graph, why)


def test_nothing_inside_the_package_imports_from_its_root():
    """``kvledger/__init__.py`` re-exports ``LLM`` (lazily, it pulls the whole engine) for users:
    a module inside the package that takes a name from it hides a dependency on everything."""
    modules, edges, _, _ = _graphs()
    bad = sorted(f"{mod}: {text}" for mod, targets in edges.items()
                 for target, text in targets if target == "kvledger" and mod != "kvledger")  # fmt: skip
    assert not bad, "import from the kvledger root inside the package:\n" + "\n".join(bad)


# -- what each process imports ---------------------------------------------------------------


def imported_modules(*imports: str, then: str = "") -> set[str]:
    """``sys.modules`` of a fresh interpreter after ``import X`` for each of ``imports`` (and
    the statements ``then``)."""
    code = "import json, sys\n" + "".join(f"import {m}\n" for m in imports) + then
    code += "\nprint(json.dumps(sorted(sys.modules)))\n"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr
    mods = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert imports[0] in mods  # the probe really imported this checkout's module
    return mods


def _under(mods: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_the_engine_core_does_not_import_the_http_server():
    """The engine-core process (kvledger/engine/core_proc.py running an LLMEngine) computes its
    statistics as plain data (kvledger/engine/stats.py); the server formats them. Built, and
    answering every named query the front end sends (/metrics' included), the core has
    loaded neither kvledger.server nor prometheus nor the web framework."""
    mods = imported_modules("kvledger.engine.core_proc", "kvledger.engine.builder",
                            "kvledger.engine.engine_info", then=(
        "from kvledger.engine.arg_utils import build_engine_config\n"
        "from kvledger.engine.engine_info import ENGINE_QUERIES, EngineInfo, run_query\n"
        "eng = kvledger.engine.builder.build_engine(build_engine_config(None, num_kv_blocks=16,"
        " calibrate_preemption=False))\n"
        "info = EngineInfo.from_engine(eng)\n"
        "for name in ENGINE_QUERIES:\n"
        "    args = (info.reference_bytes_per_token,) if name == 'dashboard_frame' else ()\n"
        "    run_query(eng, name, args)\n"
        "stats = run_query(eng, 'metrics_state')\n"
        "assert type(stats).__module__ == 'kvledger.engine.stats', type(stats)\n"
        "eng.shutdown()\n"
    ))  # fmt: skip
    assert "torch" in mods  # it does run the model
    assert not _under(mods, "kvledger.server", "prometheus_client", "fastapi", "starlette")


FRONT_END = (
    "kvledger.server.app",
    "kvledger.server.serving_chat",
    "kvledger.server.serving_completion",
    "kvledger.server.ops",
    "kvledger.server.dashboard",
    "kvledger.server.worker_info",
    "kvledger.server.metrics",
    "kvledger.server.structured_fields",
    "kvledger.engine.async_core_engine",
    "kvledger.engine.dp_engine",
    "kvledger.engine.core_client",
    "kvledger.engine.arg_utils",
    "kvledger.engine.gc_heap",
    "kvledger.hf.tokenizer",
    "kvledger.chat_utils",
    "kvledger.model.default",
    "kvledger.commands.serve",
    "kvledger.commands.router",
    "kvledger.router.server",
    "kvledger.cli",
)
HEAVY = ("torch", "xgrammar", "transformers", "kvledger.core.engine", "kvledger.model.llama",
         "kvledger.model.loader", "kvledger.worker", "kvledger.kernels", "kvledger.engine.async_engine")


def test_the_http_front_end_does_not_import_torch():
    """`kvledger serve` with engine-core processes (the default), and `kvledger router`: their
    processes run no model. Everything they import, and a plain request's SamplingParams, come
    without torch, transformers, xgrammar (which imports torch) or kvledger's model code."""
    mods = imported_modules(*FRONT_END, then=(
        "from kvledger.server.protocol import CompletionRequest\n"
        "CompletionRequest(model='m', prompt='hi', max_tokens=4).to_sampling_params({})\n"
    ))  # fmt: skip
    heavy = _under(mods, *HEAVY)
    assert not heavy, f"the front end imports {heavy[:10]}"


def test_only_a_structured_request_loads_xgrammar():
    """xgrammar parses a constraint when the request is made (a bad one is a 400 at the edge),
    and imports torch as it loads: so its import waits for the first structured request."""
    plain = imported_modules("kvledger.structured.params", "kvledger.sampling_params",
                             then="kvledger.sampling_params.SamplingParams(max_tokens=4)")  # fmt: skip
    assert not _under(plain, "xgrammar", "torch")
    structured = imported_modules("kvledger.structured.params", then=(
        "kvledger.structured.params.StructuredOutputsParams(regex='a+')"))  # fmt: skip
    assert "xgrammar" in structured


_LAUNCH = """
import json, sys
from kvledger.engine.arg_utils import build_engine_config
from kvledger.engine.async_core_engine import AsyncCoreEngine
import kvledger.commands.serve, kvledger.server.app

config = build_engine_config(None, num_kv_blocks=64, calibrate_preemption=False)
at_fork = sorted(sys.modules)
engine = AsyncCoreEngine.launch(config, torch_threads=1)  # forks the core, loads the tokenizer
try:
    info = engine.info
    core = engine.clients[0].proc
    out = {"at_fork": at_fork, "after": sorted(sys.modules), "blocks": info.num_blocks,
           "core_alive": core.is_alive(), "core_pid": core.pid, "tokenizer": engine.tokenizer is not None}
finally:
    engine.shutdown()
print(json.dumps(out))
"""


def test_a_torch_free_front_end_starts_engine_cores_that_import_it_themselves():
    """The multi-process path for real: the front end builds the config and forks an engine
    core (the default start method) with no torch in it; the core imports torch and the
    engine itself and comes up; the front end, after loading its tokenizer, holds none of
    kvledger's engine, model or worker code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("KVLEDGER_ENGINE_START_METHOD", None)  # the default: fork
    out = subprocess.run([sys.executable, "-c", _LAUNCH], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["core_alive"] and r["blocks"] == 64 and r["tokenizer"]
    assert not _under(set(r["at_fork"]), "torch", "xgrammar", "transformers"), "torch before fork"
    engine_code = _under(set(r["after"]), "kvledger.core.engine", "kvledger.model.llama",
                         "kvledger.model.loader", "kvledger.worker", "kvledger.kernels",
                         "kvledger.engine.async_engine")  # fmt: skip
    assert not engine_code, f"the front end loaded {engine_code}"
