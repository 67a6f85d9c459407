"""The Triton attention backend: the paged kernels of ``triton_kernels`` behind the backend interface.

The default on CUDA (``attention_backend="auto"``). On CPU it runs only under the Triton interpreter
(``TRITON_INTERPRET=1``), which is how the kernels are proven in CI; ``resolve_attention_backend``
says so instead of failing inside Triton.

Per step, the first layer builds what every layer shares (split-K factor, the overlay's per-request
rows); each layer then launches one write and one attention kernel (plus the split-K reduction).
Nothing here reads a tensor back to the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvledger.config import ATTENTION_BACKENDS
from kvledger.errors import ConfigError
from kvledger.model.attention.metadata import AttentionMetadata
from kvledger.storage.kv_cache import LayerKVCache


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """auto -> triton on CUDA (torch where Triton is missing), torch elsewhere; an explicit
    triton on a CPU device needs the interpreter. Returns "torch" or "triton"."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}")
    if name == "torch":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        if name == "auto":
            return "torch"
        raise ConfigError(
            "attention_backend='triton' needs the triton package (pip install triton)"
        ) from None
    if device.type == "cuda":
        return "triton"
    if name == "auto":
        return "torch"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"attention_backend='triton' runs on CUDA devices; on {device.type} it runs only under "
            "the Triton interpreter (set TRITON_INTERPRET=1, meant for tests). Use "
            "attention_backend='torch' (or auto) on CPU"
        )
    from kvledger.model.attention import triton_kernels

    if not (triton_kernels.interpreted() and triton_kernels.interpreter_consistent()):
        raise ConfigError(
            "TRITON_INTERPRET=1 was set after triton was imported; set it in the environment "
            "before the process imports kvledger, transformers or triton"
        )
    return "triton"


@dataclass
class _Step:
    """What every layer of one step shares."""

    num_splits: int
    overlay: object | None  # triton_kernels.Overlay
    overlay_src: torch.Tensor | None
    overlay_dst: torch.Tensor | None


class TritonAttentionBackend:
    """Paged attention through Triton kernels (CUDA, or CPU tensors under the interpreter)."""

    def __init__(self, num_sms: int | None = None) -> None:
        from kvledger.model.attention import triton_kernels

        self.kernels = triton_kernels
        if num_sms is None:
            num_sms = (
                torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                if torch.cuda.is_available() and not triton_kernels.interpreted()
                else 4
            )
        self.num_sms = num_sms
        # Set by the CUDA-graph runner: a fixed split-K factor per captured batch size.
        self.fixed_num_splits: int | None = None
        self._meta: AttentionMetadata | None = None
        self._step: _Step | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """See AttentionBackend.forward (window: sliding-window layers; softcap: Gemma 2)."""
        kern = self.kernels
        cache = kern.CacheView.of(layer_cache)
        step = self._get_step(meta, layer_cache, k.shape[1])
        kern.write_kv(k, v, cache, meta.slot_mapping)
        out = kern.paged_attention(
            q,
            k,
            v,
            cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
            num_splits=step.num_splits,
            overlay=step.overlay,
            window=window,
            softcap=softcap,
        )
        if step.overlay_dst is not None:
            # After attention: a chunk's window reads ring rows that this write reuses.
            layer_cache.write_overlay(k, v, step.overlay_src, step.overlay_dst)
        return out

    def _get_step(self, meta: AttentionMetadata, layer_cache: LayerKVCache, num_kv_heads: int) -> _Step:
        if meta is self._meta and self._step is not None:
            return self._step
        if self.fixed_num_splits is not None:
            splits = self.fixed_num_splits
        elif meta.max_query_len == 1:
            splits = self.kernels.choose_num_splits(
                meta.num_reqs, num_kv_heads, meta.max_seq_len, self.num_sms
            )
        else:
            splits = 1
        overlay = src = dst = None
        if (
            getattr(layer_cache, "quantized", False)
            and layer_cache.overlay_k is not None
            and meta.overlay_slots is not None
        ):
            overlay, src, dst = self._overlay(meta, layer_cache)
        self._step = _Step(splits, overlay, src, dst)
        self._meta = meta
        return self._step

    def _overlay(self, meta: AttentionMetadata, layer_cache):
        from kvledger.storage.kv_overlay import OverlayInfo, overlay_writes

        S, R = layer_cache.sink_tokens, layer_cache.recent_tokens
        dev = meta.slot_mapping.device

        def ints(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32, device=dev)

        ov = self.kernels.Overlay(
            ints([s * (S + R) for s in meta.overlay_slots]),
            ints(meta.overlay_sink_from),
            ints(meta.overlay_window_from),
            S,
            R,
        )
        src, dst = overlay_writes(meta, OverlayInfo(S, R, True), _starts(meta), dev)
        return ov, src, dst


def _starts(meta: AttentionMetadata) -> list[int]:
    out, pos = [], 0
    for n in meta.query_lens_list:
        out.append(pos)
        pos += n
    return out
