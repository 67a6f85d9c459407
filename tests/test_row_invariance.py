"""bf16 batch invariance is per model: each model's forward sets its own RowInvariance (which of
a step's leading rows take the native row-wise GEMM), held by every module it built and by its
attention backend, so a second model in the process (a draft model) never sees its rows."""

from __future__ import annotations

import pytest
import torch

from kvledger.distributed.sharding import shard_model
from kvledger.kernels import gemm_rows, native
from kvledger.model.layers import Linear
from kvledger.model.loader import load_model
from tests.model_factory import build_hf_model, tiny_config


def _holders(model) -> list:
    """Everything of a model that reads its row invariance."""
    held = [m for m in model.modules() if hasattr(m, "row_invariance") and m is not model]
    extra = [model.head, model.attn_backend, model.fused_layers]  # head: a tied head's packed copy
    return [*held, *(x for x in extra if x is not None)]


@pytest.mark.parametrize("kind", ["llama_gqa", "qwen3_moe"])  # a tied head; a MoE router
def test_every_module_of_a_model_shares_its_row_invariance(kind, tmp_path):
    build_hf_model(tiny_config(kind), tmp_path)
    a = load_model(tmp_path, dtype=torch.bfloat16).model
    b = load_model(tmp_path, dtype=torch.bfloat16).model
    assert a.row_invariance is not b.row_invariance
    linears = [m for m in a.modules() if isinstance(m, Linear)]
    assert linears and all(m in _holders(a) for m in linears)
    for holder in _holders(a):
        assert holder.row_invariance is a.row_invariance, type(holder).__name__


def test_a_sharded_model_keeps_its_row_invariance(tmp_path):
    build_hf_model(tiny_config("llama_mha"), tmp_path)
    model = load_model(tmp_path, pack_linear=False).model
    shard_model(model, rank=0, tp=2)  # the projections are replaced by this rank's slices
    for holder in _holders(model):
        assert holder.row_invariance is model.row_invariance, type(holder).__name__


def test_one_models_decode_rows_do_not_reach_another(tmp_path, monkeypatch):
    """Inside model A's step (its leading rows row-wise), model B's products follow B's own
    rows: a bf16 product too long to be row-wise by itself still goes to oneDNN in B, while the
    same product in A comes from the row-wise kernel."""
    build_hf_model(tiny_config("llama_gqa"), tmp_path)
    a = load_model(tmp_path, dtype=torch.bfloat16).model
    b = load_model(tmp_path, dtype=torch.bfloat16).model
    lin_a, lin_b = a.model.layers[0].self_attn.qkv_proj, b.model.layers[0].self_attn.qkv_proj
    if lin_a.small is None or lin_a.packed is None:
        pytest.skip("bf16 here lacks oneDNN's native kernels or the native library")
    m = next(m for m in range(1025, 4096) if not gemm_rows.row_wise(m, torch.bfloat16))
    x = torch.randn(m, lin_a.small.k).bfloat16()
    alone = lin_b(x)
    onednn = []
    monkeypatch.setattr(lin_b, "_big", lambda t: onednn.append(t.shape[0]) or Linear._big(lin_b, t))
    with a.row_invariance.leading(m):
        assert torch.equal(lin_a(x), native.small_gemm(x, lin_a.small, lin_a.bias))
        assert b.row_invariance.rows == 0
        assert torch.equal(lin_b(x), alone)
    assert onednn == [m]
