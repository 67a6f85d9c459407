"""Shared fixtures. The leak check is autouse: every engine a test builds must end the test
with zero used KV blocks, an empty host swap pool and consistent reference counts."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

# Triton kernels run on CPU tensors under the interpreter (tests/test_triton_kernels.py). It must
# be on before anything imports triton (transformers' model modules do): Triton's own jit'd
# library functions are made interpreted or compiled at its import.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Which kernel takes a product must not depend on how busy the machine was when a test started:
# the suite runs the builtin rules, and tests/test_gemm_dispatch.py runs the calibrated dispatch
# (the default for users) on purpose.
os.environ.setdefault("KVLEDGER_GEMM_DISPATCH", "builtin")
# The test models are tiny (hidden <= 256): one thread is faster than two, and it keeps the
# suite stable when the machine is shared (OpenMP threads spin-wait on a busy core).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260k"

_engines: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(autouse=True, scope="session")
def _track_engines():
    from kvledger.core.engine import LLMEngine

    orig = LLMEngine.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        _engines.add(self)

    LLMEngine.__init__ = init
    yield
    LLMEngine.__init__ = orig


@pytest.fixture(autouse=True)
def no_leaked_blocks():
    """Leaks are bugs: after each test, every live engine holds zero KV blocks, and its
    runner no request state."""
    yield
    for eng in list(_engines):
        assert not eng.has_unfinished_requests(), f"requests left behind: {list(eng.groups)}"
        kv = eng.kv
        kv.check_invariants()
        assert kv.num_used_blocks == 0, f"{kv.num_used_blocks} KV blocks leaked"
        assert not kv.requests, f"block tables leaked: {list(kv.requests)}"
        if kv.host_pool is not None:
            assert kv.host_pool.num_used_blocks == 0, "host swap blocks leaked"
        if kv.tiers is not None:  # the tiered prefix cache: no load left in flight or pinned
            assert not kv.tiers.loading and not kv.tiers.pins, "tier loads leaked"
            assert not eng.scheduler.tier_loading, "requests left waiting for a tier load"
        # The runner keeps nothing of a finished request either (in-process workers; a
        # tensor-parallel rank runs the same runner code on the same messages).
        runner = getattr(getattr(eng.executor, "worker", None), "runner", None)
        if runner is not None and eng.executor.dead is None:
            assert not runner.requests, f"runner request states leaked: {list(runner.requests)}"
            assert not len(runner.block_table), "runner block-table rows leaked"
            if runner.overlay is not None:
                assert not runner.overlay.states, "overlay slots leaked"
            assert not runner.pooler.partial, f"partial pools leaked: {list(runner.pooler.partial)}"
            if runner.drafter is not None:
                assert not runner.drafter.computed, "draft-model KV states leaked"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not (STORIES / "config.json").exists():
        pytest.skip(f"stories260k not found at {STORIES}")
    return STORIES


def _cpu_isas(testable: bool = False) -> list[str]:
    from kvledger.kernels import native_build

    return (native_build.testable_isas() if testable else native_build.cpu_isas()) or ["none"]


def _with_isa(isa: str, monkeypatch):
    from kvledger.kernels import native

    if isa == "none" or native.library() is None:
        pytest.skip("native kernels unavailable here")
    monkeypatch.setenv("KVLEDGER_NATIVE_ISA", isa)
    native.library.cache_clear()
    assert native.library().isa == isa
    yield isa
    monkeypatch.undo()
    native.library.cache_clear()


@pytest.fixture(scope="module")
def stories_llm(stories_path):
    """stories260k in an engine of default settings, one per test module: the plain engine that
    the exactness tests compare speculative and other engines with."""
    from kvledger import LLM

    return LLM(str(stories_path), calibrate_preemption=False)


@pytest.fixture(params=_cpu_isas())
def isa(request, monkeypatch):
    """Run the test with the native kernels built for one instruction set (each one this CPU
    runs: KVLEDGER_NATIVE_ISA)."""
    yield from _with_isa(request.param, monkeypatch)


@pytest.fixture(params=_cpu_isas(testable=True))
def int_dot_isa(request, monkeypatch):
    """``isa``, plus avx2-vnni's stand-in on an AVX-512 VNNI CPU without avx_vnni: for the
    kernels whose integer dot products differ between builds (vpdpbusd / vpdpwssd or their
    AVX2 sequences)."""
    yield from _with_isa(request.param, monkeypatch)


@pytest.fixture(scope="session")
def shared_stories_server(tmp_path_factory):
    """``shared_stories_server(*args)``: a `kvledger serve` of stories260k (one torch thread)
    with ``args``, shared by every test module that asks for the same flags, and stopped at the
    end of the session. A start costs seconds (two processes import torch); a module whose tests
    kill, signal or count the log lines of their server starts its own instead."""
    from test_server import STORIES, ServerProcess

    started: dict[tuple[str, ...], ServerProcess] = {}

    def get(*args: str, wait: bool = True) -> ServerProcess:
        if not (STORIES / "config.json").exists():
            pytest.skip(f"stories260k not found at {STORIES}")
        if args not in started:
            log = tmp_path_factory.mktemp("shared_srv") / "server.log"
            started[args] = ServerProcess(str(STORIES), *args, "--torch-threads", "1", log_path=log)
        if wait:
            started[args].wait_ready()
        return started[args]

    yield get
    for srv in started.values():
        srv.stop()
