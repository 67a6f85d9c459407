"""Step-time model for the simulator: how long one scheduler step takes on a given machine.

    step_time = a + b * num_batched_tokens + c * sum(context lengths) + d * sum(attended pairs)
              + (blocks swapped out + in) * bytes_per_block / swap_bandwidth

``context length`` of a scheduled request is its length after the step (computed + new); the
quadratic prefill term counts (query, key) pairs, n * (start + (n + 1) / 2) for a chunk of n new
tokens after ``start`` computed ones. The terms are added, not overlapped (a roofline would take
max(weights + KV streaming, compute)): conservative for decode batches that are memory-bound.

Presets: ``cpu-measured`` (fit by least squares to the real engine's step times on this machine,
or loaded from a JSON file written by ``save``) and ``a100-80gb-70b`` / ``h100-80gb-70b`` derived
from datasheet bandwidth and FLOPs for a model spec (the seed's 70B by default); see
``gpu_cost_model`` for the derivation.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvledger.core.preemption import PreemptionCostModel
from kvledger.core.sched_output import SchedulerOutput
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import ModelSpec, kv_bytes_per_token

PCIE4_X16_BYTES_PER_S = 25e9  # the seed's figure: 1 GB in 40 ms
NVME_READ_BYTES_PER_S = 2e9  # a PCIe 3 NVMe drive's sequential read, with the checksum


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense tensor-core peak
    memory_bytes: int
    nvlink_bytes_per_s: float = 0.0  # per direction, one GPU to the others


GPUS = {
    # NVIDIA datasheets: A100 SXM4 80GB (HBM2e 2,039 GB/s, 312 TFLOPS bf16 dense) and
    # H100 SXM5 80GB (HBM3 3.35 TB/s, 989 TFLOPS bf16 dense).
    # NVLink per direction: A100 12 links x 25 GB/s, H100 18 links x 25 GB/s.
    "a100-80gb": GPU("a100-80gb", 2.039e12, 312e12, 80 * 2**30, 300e9),
    "h100-80gb": GPU("h100-80gb", 3.35e12, 989e12, 80 * 2**30, 450e9),
}
MEM_EFFICIENCY = 0.8  # achieved / peak HBM bandwidth for weight and KV streaming
FLOP_EFFICIENCY = 0.5  # achieved / peak tensor-core FLOPs for the GEMMs (MFU)
STEP_OVERHEAD_S = 2e-3  # launches + 2 all-reduces per layer under TP, per step
# The explicit all-reduce term (gpu_cost_model(allreduce=True)): NCCL's small-message latency
# per all-reduce, and the share of NVLink bandwidth a ring all-reduce reaches.
ALLREDUCE_LATENCY_S = 10e-6
NVLINK_EFFICIENCY = 0.8


@dataclass
class StepCostModel:
    a: float  # seconds per step (weights streamed once, launches)
    b: float  # seconds per batched token (the GEMMs)
    c: float  # seconds per context token of each scheduled request (KV read by attention)
    d: float = 0.0  # seconds per attended (query, key) pair (prefill attention FLOPs)
    swap_bandwidth: float = PCIE4_X16_BYTES_PER_S  # bytes/s per direction
    # The tiered prefix cache (kvledger/cache/kv_tiers.py): host-tier copies (0: swap_bandwidth,
    # the same link) and disk-tier reads, bytes/s. Stores to host are in the step; disk writes
    # and all loads overlap the steps (the worker's threads): a load delays only its request.
    host_bandwidth: float = 0.0
    disk_bandwidth: float = NVME_READ_BYTES_PER_S
    name: str = "custom"
    source: str = ""  # how the coefficients were obtained
    fit: dict[str, Any] = field(default_factory=dict)  # calibration details (residuals, steps)

    def step_features(self, so: SchedulerOutput) -> tuple[int, int, float]:
        """(batched tokens, sum of context lengths, attended pairs); read right after schedule()."""
        tokens = ctx = 0
        pairs = 0.0
        for n, start in zip(so.num_scheduled_tokens, so.num_computed_tokens):
            tokens += n
            ctx += start + n
            pairs += n * (start + (n + 1) / 2)
        return tokens, ctx, pairs

    def compute_time(self, tokens: int, ctx: int, pairs: float) -> float:
        if tokens == 0:
            return 0.0
        return self.a + self.b * tokens + self.c * ctx + self.d * pairs

    def swap_time(self, num_bytes: int) -> float:
        return num_bytes / self.swap_bandwidth if num_bytes else 0.0

    def step_time(self, so: SchedulerOutput, bytes_per_block: int) -> float:
        swapped = (len(so.blocks_to_swap_out) + len(so.blocks_to_swap_in)) * bytes_per_block
        stored = sum(1 for s in so.kv_stores if s.host_slot >= 0) * bytes_per_block
        return (
            self.compute_time(*self.step_features(so)) + self.swap_time(swapped)
            + stored / (self.host_bandwidth or self.swap_bandwidth)
        )  # fmt: skip

    def tier_load_time(self, host_blocks: int, disk_blocks: int, bytes_per_block: int) -> float:
        """Seconds to load a request's tier blocks (from host memory, then disk)."""
        host = host_blocks * bytes_per_block / (self.host_bandwidth or self.swap_bandwidth)
        return host + disk_blocks * bytes_per_block / self.disk_bandwidth

    def prefill_coeffs(self) -> tuple[float, float, float]:
        """Marginal cost of recomputing n tokens inside a batch: (b + c) n + d n (n + 1) / 2."""
        return (0.0, self.b + self.c + self.d / 2, self.d / 2)

    def preemption_cost_model(self, mode: str = "auto", **kw: Any) -> PreemptionCostModel:
        """The scheduler's swap-vs-recompute model, priced with this machine's numbers."""
        return PreemptionCostModel(
            swap_bandwidth=self.swap_bandwidth,
            prefill_coeffs=self.prefill_coeffs(),
            mode=mode,
            **kw,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read cost model {str(path)!r}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{path}: expected a JSON object with a, b, c (and d, swap_bandwidth)"
            )
        known = set(cls.__dataclass_fields__)
        for k in ("a", "b", "c"):
            if k not in raw:
                raise ConfigError(f"{path}: cost model needs field {k!r} (seconds)")
        for k in ("a", "b", "c", "d", "swap_bandwidth", "host_bandwidth", "disk_bandwidth"):
            v = raw.get(k, 0.0 if k in ("d", "host_bandwidth") else 1.0)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
                or v < 0
            ):
                raise ConfigError(f"{path}: {k} must be a finite number >= 0, got {v!r}")
        if raw.get("swap_bandwidth", 1.0) <= 0:
            raise ConfigError(f"{path}: swap_bandwidth must be > 0 bytes/s")
        kw = {k: v for k, v in raw.items() if k in known}
        kw.setdefault("name", Path(path).stem)
        kw.setdefault("source", f"loaded from {path}")
        return cls(**kw)


def gpu_cost_model(
    gpu_name: str, spec: ModelSpec, tp: int = 1, kv_dtype: str = "auto", allreduce: bool = False
) -> StepCostModel:
    """Coefficients for ``spec`` on ``tp`` GPUs of one kind, per rank (ranks run in lock-step).

    - a = weight bytes per rank / (0.8 x HBM bandwidth) + 2 ms: every step streams all weights
      once (decode is memory-bound), plus launches and TP all-reduces.
    - b = 2 x params per rank / (0.5 x peak bf16 FLOPs): one multiply-add per weight per token.
    - c = KV bytes per token per rank / (0.8 x HBM bandwidth): attention reads each request's
      whole context once per step.
    - d = 4 x layers x query heads per rank x head_dim / (0.5 x peak FLOPs): QK^T and PV per
      (query, key) pair, the part of prefill that grows with the square of the length.
    - swap: 25 GB/s per GPU (PCIe 4.0 x16, the seed's figure), each rank moving its own share.

    For the seed's 70B (80 layers, GQA-8, fp16, 140 GB) on 2 x H100 (tp 2): a = 28.1 ms,
    b = 0.142 ms/token, c = 61 ns/context token, d = 2.65 ns/pair; on 2 x A100: a = 44.9 ms,
    b = 0.449 ms/token, c = 100 ns, d = 8.4 ns. So a 2048-token prefill costs ~0.3 s on H100
    and a decode step of 64 requests x 1000 tokens of context ~41 ms.

    ``allreduce`` (tp > 1) prices the tensor-parallel all-reduces explicitly instead of leaving
    them inside the 2 ms: two per layer per step (after attention's o_proj and the MLP's
    down_proj, as kvledger's ranks do), each ALLREDUCE_LATENCY_S plus a ring's
    2 (tp - 1) / tp x tokens x hidden x dtype bytes over NVLINK_EFFICIENCY x the GPU's NVLink
    bandwidth: for the 70B on 2 x H100, +1.6 ms per step and +7.3 us per batched token.
    """
    if gpu_name not in GPUS:
        raise ConfigError(f"unknown GPU {gpu_name!r} (known: {', '.join(GPUS)})")
    g = GPUS[gpu_name]
    if spec.num_params is None:
        raise ConfigError(f"{spec.name}: parameter count unknown, cannot derive a GPU cost model")
    weights = (spec.weight_bytes or spec.num_params * spec.dtype_bytes) / tp
    params = spec.num_params / tp
    kv = kv_bytes_per_token(spec, kv_dtype, tp).total
    mem = MEM_EFFICIENCY * g.hbm_bytes_per_s
    flops = FLOP_EFFICIENCY * g.bf16_flops
    q_heads = spec.num_attention_heads / tp
    ar_a = ar_b = 0.0
    if allreduce and tp > 1:
        n = 2 * spec.num_layers
        ar_a = n * ALLREDUCE_LATENCY_S
        ring = 2 * (tp - 1) / tp * spec.hidden_size * spec.dtype_bytes
        ar_b = n * ring / (NVLINK_EFFICIENCY * g.nvlink_bytes_per_s)
    return StepCostModel(
        a=weights / mem + STEP_OVERHEAD_S + ar_a,
        b=2 * params / flops + ar_b,
        c=kv / mem,
        d=4 * spec.num_layers * q_heads * spec.head_dim / flops,
        swap_bandwidth=PCIE4_X16_BYTES_PER_S,
        name=f"{gpu_name}-{spec.name}-tp{tp}" + ("+allreduce" if ar_a else ""),
        source=f"datasheet: {g.hbm_bytes_per_s / 1e12:g} TB/s HBM x {MEM_EFFICIENCY}, "
        f"{g.bf16_flops / 1e12:g} TFLOPS x {FLOP_EFFICIENCY}, +{STEP_OVERHEAD_S * 1e3:g} ms/step, "
        f"swap {PCIE4_X16_BYTES_PER_S / 1e9:g} GB/s",
    )


GPU_PRESETS = {"a100-80gb-70b": "a100-80gb", "h100-80gb-70b": "h100-80gb"}


# ------------------------------------------------------------------------------ calibration
def fit_step_times(rows: list[tuple[int, int, float, float]]) -> tuple[StepCostModel, dict]:
    """Non-negative least squares of dt ~ a + b tokens + c ctx + d pairs, in relative error.

    Four unknowns, so NNLS is done exactly by trying every subset of free coefficients.
    """
    import numpy as np

    x = np.array([[1.0, t, c, p] for t, c, p, _ in rows])
    y = np.array([dt for *_, dt in rows])
    w = 1.0 / y  # relative error: short decode steps matter as much as long prefills
    best = None
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            sol, *_ = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)
            if (sol < 0).any():
                continue
            coef = np.zeros(4)
            coef[list(cols)] = sol
            err = float(np.sum(((x @ coef - y) * w) ** 2))
            if best is None or err < best[0]:
                best = (err, coef)
    assert best is not None
    coef = best[1]
    rel = np.abs(x @ coef - y) / y
    info = {
        "num_steps": len(rows),
        "median_abs_rel_error": float(np.median(rel)),
        "p90_abs_rel_error": float(np.quantile(rel, 0.9)),
    }
    return StepCostModel(*map(float, coef), name="cpu-measured", fit=info), info


def measure_copy_bandwidth(num_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """Host memcpy bandwidth (bytes/s): what a CPU engine's swap actually moves at."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


def calibrate_cpu(model: str, max_prompt: int | None = None, seed: int = 0) -> StepCostModel:
    """Time the real engine's steps on ``model`` over a grid of batch shapes and fit the model.

    Grid: batch sizes 1/4/16/32 x prompt lengths up to ``max_prompt`` (a quarter of the model's
    context by default), 24 output tokens each, so both prefill-heavy and decode steps (with
    short and long contexts) are in the fit. Takes a few seconds for a small model.
    """
    import random

    from kvledger.llm import LLM
    from kvledger.sampling_params import SamplingParams

    llm = LLM(
        model,
        preemption_mode="recompute",
        calibrate_preemption=False,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    eng = llm.engine
    vocab = eng.vocab_size
    max_prompt = max_prompt or max(16, eng.max_model_len // 4)
    rng = random.Random(seed)
    rows: list[tuple[int, int, float, float]] = []
    probe = StepCostModel(0, 0, 0)
    pending: list[tuple[int, int, float]] = []

    def observe(so: SchedulerOutput) -> None:  # each step's batch, before it runs
        pending.append(probe.step_features(so))

    eng.schedule_observers.append(observe)
    prompts = sorted({max(8, max_prompt // 8), max(8, max_prompt // 2), max_prompt})
    grid = [(1, max_prompt)] + [(b, p) for b in (1, 4, 16, 32) for p in prompts]
    try:
        for i, (batch, plen) in enumerate(grid):
            params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
            for _ in range(batch):
                eng.add_request([rng.randrange(3, vocab) for _ in range(plen)], params)
            while eng.has_unfinished_requests():
                t0 = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t0
                feats = pending.pop()
                if i > 0 and feats[0] > 0:  # the first shape only warms up
                    rows.append((*feats, dt))
    finally:
        eng.schedule_observers.remove(observe)
    cm, info = fit_step_times(rows)
    cm.swap_bandwidth = measure_copy_bandwidth()
    cm.source = (
        f"fit to {info['num_steps']} engine steps of {model} on this CPU "
        f"(median |error| {info['median_abs_rel_error']:.1%}); swap = measured memcpy"
    )
    return cm
