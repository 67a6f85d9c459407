"""A step's decoder layers as one native call each (csrc/decoder_layer.c), where the step allows.

Per layer the modules call ~10 native kernels and two torch adds, and between them run Python:
module calls, argument checks, allocations, ~15 us a kernel, paid with the interpreter's data
evicted by the weights each kernel streams: with the engine's own work, 16-21 % of a 64-decode step
of the 60M model (docs/measurements/cpu_kernels.md, "The native decoder layer"). The native layer
calls the same kernels in the same order on the same arguments, so its results are the modules' bit
for bit; it only runs where every one of them would have run natively:

- the model (checked once, after its weights are packed): plain Llama layers (no q/k norms,
  sandwich norms, norm offsets, soft-capping, sliding windows, partial rotary or MoE), SiLU MLP,
  every product packed for the native kernel or quantised to W8A8 / W4A8 (model/quant_int8.py,
  model/quant_q4.py), unsharded;
- the step: every float product takes the row-wise kernel (the model's RowInvariance.row_wise for
  the step's rows; a model whose products are all quantised takes any rows), one KV-cache group, unquantised caches of the model dtype, and attention that is
  nothing but the native decode and prefill kernels (torch_backend's plan).

Anything else goes through the modules. ``KVLEDGER_FUSED_LAYER=0`` turns it off (tests compare
the two paths).
"""

from __future__ import annotations

import ctypes
import itertools
from ctypes import Structure, c_float, c_int64, c_void_p

import torch

from kvledger import envs
from kvledger.kernels import native
from kvledger.kernels.native_quant import FMT
from kvledger.model.attention.torch_backend import TorchAttentionBackend
from kvledger.model.layers import GatedMLP, Linear, RMSNorm, RopeStep
from kvledger.model.quant_int8 import Int8Weight
from kvledger.model.quant_q4 import Q4Split, Q4Weight
from kvledger.storage.kv_cache import PagedKVCache


class _Gemm(Structure):
    pass


_Gemm._fields_ = [
    ("w", c_void_p), ("bias", c_void_p), ("n", c_int64), ("k", c_int64), ("blocked", c_int64),
    ("kind", c_int64), ("fmt", c_int64), ("scale", c_void_p), ("aux", c_void_p), ("sup", c_void_p),
    ("parts", ctypes.POINTER(_Gemm)), ("nparts", c_int64), ("sgs", c_int64),
]  # fmt: skip


class _Layer(Structure):
    _fields_ = [
        ("norm1", c_void_p), ("norm2", c_void_p),
        ("qkv", _Gemm), ("o", _Gemm), ("gate_up", _Gemm), ("down", _Gemm),
        ("k_cache", c_void_p), ("v_cache", c_void_p), ("num_slots", c_int64),
        ("eps", c_float), ("scale", c_float),
    ]  # fmt: skip


class _Step(Structure):
    _fields_ = [
        ("T", c_int64), ("elem", c_int64),
        ("H", c_int64), ("Hkv", c_int64), ("D", c_int64), ("bs", c_int64), ("inter", c_int64),
        ("positions", c_void_p), ("slots", c_void_p), ("cos", c_void_p), ("sin", c_void_p),
        ("nd", c_int64), ("d_stride", c_int64), ("d_rows", c_void_p), ("d_tables", c_void_p),
        ("d_seq_lens", c_void_p),
        ("np", c_int64), ("p_stride", c_int64), ("p_row0", c_void_p), ("p_nrows", c_void_p),
        ("p_tables", c_void_p), ("p_seq_lens", c_void_p),
        ("threads", c_int64), ("d_threads", c_int64), ("p_threads", c_int64),
        ("x", c_void_p), ("qkv", c_void_p), ("attn", c_void_p), ("gu", c_void_p), ("act", c_void_p),
        ("tmp", c_void_p),
    ]  # fmt: skip


def enabled() -> bool:
    """KVLEDGER_FUSED_LAYER is not 0 (read at each step, so tests and benchmarks can switch)."""
    return envs.KVLEDGER_FUSED_LAYER


def _q4_gemm(w: Q4Weight, bias: int | None) -> _Gemm:
    zero = None if w.zero is None else w.zero.data_ptr()
    sup = None if w.super_scale is None else w.super_scale.data_ptr()
    return _Gemm(w.q.data_ptr(), bias, w.n, w.shape[1], 0, 2, FMT[w.fmt], w.scale.data_ptr(), zero, sup, sgs=w.sgs)


def _gemm(lin: Linear) -> _Gemm:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    w = lin.quant
    if isinstance(w, Int8Weight):
        return _Gemm(w.q.data_ptr(), bias, w.scale.shape[0], w.k, 0, 1, 0, w.scale.data_ptr(), w.wsum.data_ptr())
    if isinstance(w, Q4Weight):
        return _q4_gemm(w, bias)
    if isinstance(w, Q4Split):  # pieces of different formats, each with its slice of the bias
        cols = [0, *itertools.accumulate(p.n for p in w.parts)]
        step = 0 if lin.bias is None else lin.bias.element_size()
        parts = (_Gemm * len(w.parts))(*(_q4_gemm(p, None if bias is None else bias + c * step)
                                         for p, c in zip(w.parts, cols)))  # fmt: skip
        g = _Gemm(None, bias, w.shape[0], w.shape[1], 0, 3, 0, None, None, None, parts, len(w.parts))
        g._keep = parts  # the array lives as long as this struct (FusedLayers keeps the structs)
        return g
    s = lin.small
    return _Gemm(s.data.data_ptr(), bias, s.n, s.k, int(s.blocked), 0, 0, None, None)


def _plain_linear(lin, dtype: torch.dtype) -> bool:
    """A product the native layer runs as the module would: packed for the row-wise kernel, or
    W8A8 / W4A8 (whose modules take the integer kernels at every row count)."""
    if type(lin) is not Linear or (lin.bias is not None and lin.bias.dtype != dtype):
        return False
    if isinstance(lin.quant, (Int8Weight, Q4Split)) or (isinstance(lin.quant, Q4Weight) and lin.quant.perm is None):
        return True
    return lin.quant is None and lin.small is not None and lin.small.dtype == dtype


def _plain_norm(norm, dtype: torch.dtype) -> bool:
    return type(norm) is RMSNorm and not norm.unit_offset and norm.weight.dtype == dtype


class FusedLayers:
    """The native layer for one model: its per-layer structs, made for the caches they point at."""

    def __init__(self, model) -> None:
        # The layers, not the model: the model holds this object, and no cycle should keep its
        # weights alive past the engine.
        self.layers = model.model.layers
        cfg = model.config
        self.row_invariance = model.row_invariance  # which of a step's rows are row-wise
        self.dtype = model.dtype
        self.elem = native.ELEM[self.dtype]
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        self.q_size, self.kv_size = self.H * self.D, self.Hkv * self.D
        self._layers: list[_Layer] = []
        self._addrs: list[int] = []  # their addresses, what the call takes
        self._key: tuple = ()  # (k, v addresses, blocks) of each layer's cache
        self._call = native.library().kvl_decoder_layer
        # Every product quantised: the modules take the integer kernels at any row count, so any
        # step's rows may run here (no row-wise condition).
        self.all_quantised = all(
            m.quant is not None
            for layer in self.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        )

    @classmethod
    def build(cls, model) -> FusedLayers | None:
        """The native layer for a model whose weights are packed, or None where it does not apply."""
        lib = native.library()
        cfg = model.config
        dtype = model.dtype
        if (
            lib is None
            or dtype not in (torch.float32, torch.bfloat16)
            or model.model.norm.weight.device.type != "cpu"
            or cfg.qk_norm
            or cfg.sandwich_norms
            or cfg.norm_unit_offset
            or cfg.attn_softcap is not None
            or cfg.layer_types is not None
            or cfg.num_experts > 0
            or cfg.hidden_act != "silu"
            or (cfg.rotary_dim or cfg.head_dim) != cfg.head_dim
            or cfg.head_dim % 16
            or cfg.hidden_size % 8
            or cfg.intermediate_size % 8
            or model.local_rotary_emb is not None
            or model.vocab_gather is not None
        ):
            return None
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (
                type(mlp) is not GatedMLP
                or mlp.intermediate_size != cfg.intermediate_size
                or attn.window is not None
                or attn.num_heads != cfg.num_heads
                or attn.num_kv_heads != cfg.num_kv_heads
                or not all(_plain_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
                or not all(_plain_norm(n, dtype) for n in (layer.input_layernorm, layer.post_attention_layernorm))
            ):
                return None
        return cls(model)

    def _layer_structs(self, kv_caches) -> list[int] | None:
        """The addresses of one struct per layer for these caches (made again when they move), or
        None where a cache is not a plain one of the model dtype."""
        if not all(type(c) is PagedKVCache for c in kv_caches):
            return None
        key = tuple((c.k.data_ptr(), c.v.data_ptr(), c.k.shape[0]) for c in kv_caches)
        if key == self._key:
            return self._addrs
        if not all(native.can_paged_decode(c, self.H, self.dtype) for c in kv_caches):
            return None
        layers, gemms = [], []
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            num_blocks, block_size, hkv, d = cache.k.shape
            if (hkv, d) != (self.Hkv, self.D) or not cache.v.is_contiguous():
                return None
            gemms.append([_gemm(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)])
            layers.append(_Layer(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                *gemms[-1],
                cache.k.data_ptr(), cache.v.data_ptr(), num_blocks * block_size,
                layer.input_layernorm.eps, attn.scale,
            ))  # fmt: skip
        # the structs (and the piece arrays a Q4Split's point at) live as long as the layers
        self._layers, self._gemms, self._key = layers, gemms, key
        self._addrs = [ctypes.addressof(x) for x in layers]
        return self._addrs

    def run(self, h: torch.Tensor, rope: RopeStep, meta, kv_caches, backend) -> torch.Tensor | None:
        """Every layer over h [T, hidden] (updated in place and returned), or None where this
        step must go through the modules (nothing has been computed then)."""
        T = h.shape[0]
        if (
            not enabled()
            or rope.tables is None
            or meta.per_layer is not None
            or meta.tree_mask is not None  # token trees: the modules' attention takes the mask
            or not isinstance(backend, TorchAttentionBackend)
            or h.dtype != self.dtype
            or not (self.all_quantised or self.row_invariance.row_wise(T, self.dtype))
        ):
            return None
        layers = self._layer_structs(kv_caches)
        if layers is None:
            return None
        calls = backend.native_only(meta, self.dtype, self.kv_size, kv_caches[0], self.H)
        if calls is None:
            return None
        nd, npf = calls
        slots, positions = meta.slot_mapping, rope.positions
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in (slots, positions)):
            return None
        h = h.contiguous()
        dt, hidden = self.dtype, self.hidden
        width = self.q_size + 2 * self.kv_size
        scratch = [torch.empty(T, n, dtype=dt) for n in (hidden, width, self.q_size, 2 * self.inter, self.inter, hidden)]
        bytes_per_token = self.kv_size * 2 * h.element_size()
        step = _Step(
            T, self.elem, self.H, self.Hkv, self.D, kv_caches[0].block_size, self.inter,
            positions.data_ptr(), slots.data_ptr(), rope.tables.cos_cache.data_ptr(),
            rope.tables.sin_cache.data_ptr(),
        )  # fmt: skip
        if nd is not None:
            step.nd, step.d_stride = nd.rows.shape[0], nd.block_tables.stride(0)
            step.d_rows, step.d_tables, step.d_seq_lens = nd.rows.data_ptr(), nd.block_tables.data_ptr(), nd.seq_lens.data_ptr()
            step.d_threads = native.attention_threads(nd.kv_tokens, bytes_per_token)
        if npf is not None:
            step.np, step.p_stride = npf.row0.shape[0], npf.block_tables.stride(0)
            step.p_row0, step.p_nrows = npf.row0.data_ptr(), npf.nrows.data_ptr()
            step.p_tables, step.p_seq_lens = npf.block_tables.data_ptr(), npf.seq_lens.data_ptr()
            step.p_threads = native.attention_threads(npf.kv_tokens, bytes_per_token)
        step.threads = torch.get_num_threads()
        step.x, step.qkv, step.attn, step.gu, step.act, step.tmp = (t.data_ptr() for t in scratch)
        hp, sp, call = h.data_ptr(), ctypes.addressof(step), self._call
        for i, layer in enumerate(layers):
            rc = call(layer, sp, hp)
            if rc != 0:
                raise ValueError(f"decoder layer {i}: native kernel {rc} refused its arguments (rows {T})")
        return h

