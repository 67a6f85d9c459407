"""The GEMM dispatch measured on the machine (kernels/gemm_dispatch.py, model/gemm_calibration.py):
the selection logic on synthetic timings (any machine), the cache, a real calibration of a model
and that every mode gives the engine the same float32 tokens, and `kvledger doctor`."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.kernels import gemm_dispatch, native
from kvledger.kernels.gemm_dispatch import TOLERANCE, GemmDispatch
from kvledger.kernels.gemm_rows import RowInvariance, builtin_row_wise, gemm_rows_bucket, row_wise

F32, BF16 = torch.float32, torch.bfloat16
ROWS = (1, 16, 64, 256, 1024, 2048)


def table(native_per_row: float, library_per_row: float, fixed: float = 0.01, dtype: str = "float32") -> GemmDispatch:
    """Times linear in the rows: ``fixed`` ms plus a cost per row for each kernel."""
    return GemmDispatch(
        "calibrated", dtype, ROWS,
        tuple(fixed + native_per_row * r for r in ROWS),
        tuple(fixed + library_per_row * r for r in ROWS),
    )  # fmt: skip


def test_native_faster_everywhere_takes_every_row_count():
    d = table(0.5, 1.0)
    assert all(d.native_takes(m, F32) for m in range(1, 5000))


def test_past_the_crossover_the_library_takes_rows_it_computes_unpadded():
    # native costs 1.10x oneDNN per row (past TOLERANCE): oneDNN where its bucket adds no rows,
    # native where the bucket's padding costs oneDNN more than the 10 % it saves per row.
    d = table(1.10, 1.0, fixed=0.0)
    assert not d.native_takes(2048, F32) and not d.native_takes(1024, F32)
    assert gemm_rows_bucket(1025) == 1152 and d.native_takes(1025, F32)  # 12 % padding
    assert not d.native_takes(1100, F32)  # 4.7 % padding
    assert d.native_takes(16, F32) is False  # no fixed cost: 1.10x at every row count


def test_within_tolerance_the_native_kernel_keeps_the_product():
    d = table(1.0 * TOLERANCE - 1e-6, 1.0, fixed=0.0)
    assert all(d.native_takes(m, F32) for m in range(1, 2049))
    d = table(1.0 * TOLERANCE + 1e-3, 1.0, fixed=0.0)
    assert not d.native_takes(2048, F32)


def test_few_rows_native_many_rows_library_with_one_crossover():
    # the native kernel streams the weight faster (lower fixed cost) but computes slower per row
    d = GemmDispatch("calibrated", "bfloat16", ROWS, (0.1, 0.2, 0.5, 2.0, 8.0, 16.0), (0.5, 0.5, 0.6, 0.8, 2.0, 4.0))
    assert d.native_takes(1, BF16) and d.native_takes(16, BF16)
    assert not d.native_takes(256, BF16) and not d.native_takes(2048, BF16)
    runs = d.ranges(2048, BF16)
    assert runs[0][0] == 1 and runs[-1][1] == 2048
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(runs, runs[1:]))  # contiguous, alternating
    assert runs[0][2] is True and runs[-1][2] is False
    assert "native 1-" in d.describe(2048, BF16) and "oneDNN" in d.describe(2048, BF16)


def test_past_the_last_row_timed_times_scale_per_row():
    d = GemmDispatch("calibrated", "float32", (1, 16), (0.1, 1.6), (0.5, 1.0))
    # interpolated at 4 rows: native 0.4 ms, oneDNN 0.6; per row past 16: native 0.1 ms, oneDNN 1/16
    assert d.native_takes(4, F32)
    assert not d.native_takes(4000, F32)


def test_another_dtype_follows_the_builtin_rules():
    d = table(0.5, 1.0, dtype="float32")
    for m in (1, 64, 65, 1000, 1025, 2048):
        assert d.native_takes(m, BF16) == builtin_row_wise(m, BF16)


def test_forced_modes_and_the_builtin_default():
    assert all(GemmDispatch("native").native_takes(m, F32) for m in (1, 700, 4096))
    assert not any(GemmDispatch("onednn").native_takes(m, F32) for m in (1, 700, 4096))
    for m in range(1, 2100, 7):
        for dt in (F32, BF16):
            assert GemmDispatch().native_takes(m, dt) == builtin_row_wise(m, dt)
            assert row_wise(m, dt) == builtin_row_wise(m, dt)


def test_bf16_invariant_rows_take_the_native_kernel_whatever_the_dispatch():
    onednn = GemmDispatch("onednn")
    assert row_wise(40, BF16, invariant_rows=40, dispatch=onednn)
    assert not row_wise(41, BF16, invariant_rows=40, dispatch=onednn)
    assert not row_wise(40, F32, invariant_rows=40, dispatch=onednn)  # float32 follows the dispatch
    rows = RowInvariance(dispatch=onednn)
    assert not rows.row_wise(500, BF16)
    rows.batch_invariant = True  # KVLEDGER_BATCH_INVARIANT: every row, every dtype
    assert rows.row_wise(500, BF16) and rows.row_wise(3000, F32)


@pytest.mark.parametrize(
    ("rows", "nat", "lib", "match"),
    [
        ((), (), (), "needs times"),
        ((1, 16), (0.1,), (0.1, 0.2), "needs times"),
        ((16, 1), (0.1, 0.2), (0.1, 0.2), "ascend"),
        ((1, 16), (0.0, 0.2), (0.1, 0.2), "positive"),
    ],
)
def test_a_broken_table_is_refused(rows, nat, lib, match):
    with pytest.raises(ValueError, match=match):
        GemmDispatch("calibrated", "float32", rows, nat, lib)


def test_an_unknown_mode_names_the_variable(monkeypatch):
    with pytest.raises(ConfigError, match="KVLEDGER_GEMM_DISPATCH"):
        GemmDispatch("fastest")
    from kvledger import envs

    monkeypatch.setenv("KVLEDGER_GEMM_DISPATCH", "amx")
    with pytest.raises(ConfigError, match="KVLEDGER_GEMM_DISPATCH must be one of calibrated"):
        _ = envs.KVLEDGER_GEMM_DISPATCH


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """Calibrations cached under tmp_path (the compiled kernels stay in the real cache)."""
    monkeypatch.setattr(gemm_dispatch, "cache_path", lambda digest: tmp_path / f"{digest}.json")
    return tmp_path


def test_the_cache_returns_only_a_whole_file_for_the_same_key(cache_dir):
    d = table(0.5, 1.0)
    path = gemm_dispatch.write_cached("abc", {"cpu": "x", "threads": 2}, d)
    assert path == cache_dir / "abc.json" and not list(cache_dir.glob("*.tmp"))
    got = gemm_dispatch.read_cached("abc", {"cpu": "x", "threads": 2})
    assert got is not None and got.mode == "calibrated" and got.source == str(path)
    assert (got.rows, got.native_ms, got.library_ms) == (d.rows, d.native_ms, d.library_ms)
    assert gemm_dispatch.read_cached("abc", {"cpu": "x", "threads": 1}) is None  # another key
    path.write_text(path.read_text()[:40])  # truncated
    assert gemm_dispatch.read_cached("abc", {"cpu": "x", "threads": 2}) is None
    data = {**d.to_json(), "key": {"cpu": "x"}, "version": 0}
    path.write_text(json.dumps(data))
    assert gemm_dispatch.read_cached("abc", {"cpu": "x"}) is None  # an older format


needs_native = pytest.mark.skipif(native.library() is None, reason="native kernels unavailable here")


@needs_native
def test_a_linear_runs_the_kernel_its_dispatch_names(monkeypatch):
    from kvledger.model.layers import Linear

    torch.manual_seed(0)
    lin = Linear(64, 48)
    lin.weight.data.normal_()
    x = torch.randn(5, 64)
    want = x @ lin.weight.data.T
    lin.pack()
    calls = []
    monkeypatch.setattr(native, "small_gemm", lambda *a, _f=native.small_gemm, **k: calls.append(1) or _f(*a, **k))
    for mode, native_calls in (("native", 1), ("onednn", 0)):
        calls.clear()
        lin.row_invariance.dispatch = GemmDispatch(mode)
        y = lin(x)
        assert len(calls) == native_calls, mode
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    lin.row_invariance.dispatch = table(2.0, 1.0, fixed=0.0)  # the table says oneDNN at 5 rows
    calls.clear()
    lin(x)
    assert not calls


@needs_native
def test_a_model_is_calibrated_once_then_read_from_the_cache(stories_path, cache_dir, monkeypatch):
    from kvledger import LLM, SamplingParams
    from kvledger.model import gemm_calibration

    monkeypatch.setenv("KVLEDGER_GEMM_DISPATCH", "calibrated")
    monkeypatch.setattr(gemm_calibration, "NOISY_SHARE", float("inf"))  # cached even on a busy machine
    # every probe timed even when a stalled first probe makes the budget's cost guess pessimistic
    monkeypatch.setattr(gemm_calibration, "BUDGET_S", 120.0)
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM(str(stories_path), max_num_batched_tokens=300, calibrate_preemption=False)
    d = llm.engine.executor.worker.model.row_invariance.dispatch
    assert d.mode == "calibrated" and d.source == "measured" and d.seconds > 0
    assert d.rows == (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384)  # up to the first probe >= 300
    assert len(list(cache_dir.glob("*.json"))) == 1
    assert llm.engine.executor.worker.ready.gemm_dispatch.startswith("GEMM dispatch calibrated")
    calibrated = [o.outputs[0].token_ids for o in llm.generate(["Once upon a time", "The dog"], params)]
    again = LLM(str(stories_path), max_num_batched_tokens=300, calibrate_preemption=False)
    d2 = again.engine.executor.worker.model.row_invariance.dispatch
    assert d2.source.endswith(".json") and d2.seconds == 0 and d2.native_ms == d.native_ms
    # float32 tokens do not depend on which kernel takes a product (HF is the oracle of both)
    for mode in ("native", "onednn", "builtin"):
        monkeypatch.setenv("KVLEDGER_GEMM_DISPATCH", mode)
        forced = LLM(str(stories_path), max_num_batched_tokens=300, calibrate_preemption=False)
        assert forced.engine.executor.worker.model.row_invariance.dispatch.mode == mode
        assert [o.outputs[0].token_ids for o in forced.generate(["Once upon a time", "The dog"], params)] == calibrated


@needs_native
def test_a_spent_budget_stops_the_probes_and_the_rest_is_extrapolated(stories_path):
    from kvledger.model import gemm_calibration
    from kvledger.model.loader import load_model

    model = load_model(str(stories_path)).model
    linears = gemm_calibration.layer_linears(model)
    assert {tuple(lin.weight.shape) for lin in linears}  # the layer's products
    d = gemm_calibration.measure(linears, torch.float32, 2048, budget_s=0.0)
    assert d.rows == (1,)  # one probe, then the budget is spent
    assert isinstance(d.native_takes(2048, F32), bool) and len(d.ranges(2048, F32)) >= 1


def test_doctor_prints_the_machine_and_the_dispatch(stories_path, capsys, monkeypatch):
    """Through the CLI's main in process: a `python -m kvledger doctor` subprocess spent its
    seconds importing torch again."""
    from kvledger.cli import main

    monkeypatch.setenv("KVLEDGER_GEMM_DISPATCH", "builtin")
    assert main(["doctor", str(stories_path), "--json", "--max-num-batched-tokens", "512"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "float32" and isinstance(info["amx"], bool)
    assert info["dispatch"]["mode"] == "builtin"
    runs = info["dispatch"]["ranges"]
    assert runs[0]["first"] == 1 and runs[-1]["last"] == 512
    expected = [m for m in range(1, 513) if builtin_row_wise(m, F32)] if native.library() else []
    got = [m for r in runs if r["kernel"] == "native" for m in range(r["first"], r["last"] + 1)]
    assert got == expected or native.library() is None
    assert main(["doctor", "--max-num-batched-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens must be >= 1" in err and "Traceback" not in err


@needs_native
def test_unsteady_timings_are_used_but_not_cached(stories_path, cache_dir, monkeypatch):
    """Rounds that disagree (another process had the cores) make a calibration this run uses and
    the next start repeats, rather than a bad choice cached for good."""
    import itertools

    from kvledger.model import gemm_calibration
    from kvledger.model.loader import load_model

    model = load_model(str(stories_path)).model
    # per probe (6 calls each kernel: a warm-up and 5 rounds): native's fastest round (1 ms) beats
    # oneDNN's 2 ms, its second-fastest (3 ms) does not
    native_ms = itertools.cycle([1.0, 3.0, 3.0])
    monkeypatch.setattr(gemm_calibration, "time_layer", lambda lins, xs, k: next(native_ms) if k == "native" else 2.0)
    d = gemm_calibration.model_dispatch(model, 64, "calibrated")
    assert d.mode == "calibrated" and d.noisy and d.rows[-1] == 64
    assert not list(cache_dir.glob("*.json"))
    monkeypatch.setattr(gemm_calibration, "time_layer", lambda lins, xs, k: 1.0 if k == "native" else 2.0)
    d = gemm_calibration.model_dispatch(model, 64, "calibrated")
    assert not d.noisy and d.native_takes(64, F32)
    assert len(list(cache_dir.glob("*.json"))) == 1
