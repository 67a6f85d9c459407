"""From user-level options (model, device, cost model) to a ready Simulator.

The pool is sized with the planner's arithmetic (``plan_capacity``), capped like the engine's
``_size_pool`` at what ``max_num_seqs`` full contexts can use; bytes per token come from the
ledger for the chosen KV dtype and tensor-parallel degree (per rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvledger.cache.attention_policy import cdiv
from kvledger.config import CacheConfig, SchedulerConfig
from kvledger.errors import ConfigError
from kvledger.ledger.accounting import DoesNotFitError, kv_bytes_per_token, plan_capacity
from kvledger.ledger.kv_cache_groups import kv_cache_layout
from kvledger.ledger.spec import ModelSpec, load_model_spec
from kvledger.sim.cost_model import GPU_PRESETS, StepCostModel, calibrate_cpu, gpu_cost_model
from kvledger.sim.simulator import SimResult, Simulator
from kvledger.sim.trace import TraceRequest

COST_MODELS = ("cpu-measured", *GPU_PRESETS)
TP_CANDIDATES = (1, 2, 4, 8)


@dataclass
class SimSetup:
    model: str = "seed-70b"
    kv_dtype: str = "auto"
    tp: int | None = None  # None: the smallest of 1/2/4/8 that holds one max_model_len request
    num_kv_blocks: int | None = None
    device_memory: int = 80 * 2**30
    memory_fraction: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max positions (4096 if unknown)
    cost_model: str | StepCostModel | None = None  # None: cpu-measured for folders, else H100
    swap_bandwidth: float | None = None  # bytes/s, overrides the cost model's
    tier_bytes: tuple[int, int] = (0, 0)  # the prefix cache's host and disk tiers (bytes)
    scheduler: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig fields
    cache: dict[str, Any] = field(default_factory=dict)  # CacheConfig fields
    static_batch: int | None = None
    naive_max_seq_len: int | None = None
    # Resolved by build():
    spec: ModelSpec | None = None
    bytes_per_token: int = 0
    windows: list[int | None] | None = None  # each KV cache group's window (the engine's layout)
    resolved_cost_model: StepCostModel | None = None
    capacity_note: str = ""

    def is_folder(self) -> bool:
        return Path(self.model).exists()

    def resolve(self) -> None:
        self.spec = spec = load_model_spec(self.model)
        max_len = self.max_model_len or spec.max_position_embeddings or 4096
        if spec.max_position_embeddings and max_len > spec.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {max_len} exceeds {spec.name}'s max positions "
                f"{spec.max_position_embeddings}"
            )
        self.max_model_len = max_len
        max_num_seqs = self.scheduler.get("max_num_seqs", SchedulerConfig.max_num_seqs)
        useful = max_num_seqs * cdiv(max_len, self.block_size)
        plan = None
        if self.num_kv_blocks is None or self.tp is None:
            heads = spec.num_attention_heads
            candidates = [self.tp] if self.tp else [t for t in TP_CANDIDATES if heads % t == 0]
            error: ConfigError | None = None
            for tp in candidates:
                try:
                    plan = plan_capacity(
                        spec,
                        self.device_memory,
                        self.memory_fraction,
                        tp=tp,
                        block_size=self.block_size,
                        context_len=max_len,
                        kv_dtype=self.kv_dtype,
                    )
                    break
                except DoesNotFitError as e:
                    error = e
            if plan is not None:
                self.tp = plan.tp
            elif self.num_kv_blocks is None:
                tried = ", ".join(map(str, candidates))
                raise ConfigError(f"{error} [tried tp = {tried}]")
        self.tp = self.tp or 1
        self.bytes_per_token = kv_bytes_per_token(spec, self.kv_dtype, self.tp).total
        layout = kv_cache_layout(spec.layer_windows)
        if layout.is_hybrid:  # a pool slot is one KV cache group's layers, as in the engine
            self.bytes_per_token = self.bytes_per_token // spec.num_layers * layout.group_size
            useful *= len(layout.groups)
        self.windows = layout.windows
        if self.num_kv_blocks is None:
            self.num_kv_blocks = min(plan.num_blocks, useful)
            self.capacity_note = (
                f"plan_capacity: {plan.num_blocks} blocks on {self.device_memory / 2**30:g} GiB "
                f"x {self.memory_fraction:g}, tp {self.tp}"
                + (
                    f", capped at {useful} (max_num_seqs full contexts)"
                    if useful < plan.num_blocks
                    else ""
                )
            )
        else:
            self.capacity_note = f"--num-kv-blocks {self.num_kv_blocks}"
        self.resolved_cost_model = self._cost_model()
        if self.swap_bandwidth:
            self.resolved_cost_model.swap_bandwidth = self.swap_bandwidth

    def _cost_model(self) -> StepCostModel:
        cm = self.cost_model
        if isinstance(cm, StepCostModel):
            return cm
        if cm is None:
            cm = "cpu-measured" if self.is_folder() else "h100-80gb-70b"
        if cm in GPU_PRESETS:
            return gpu_cost_model(GPU_PRESETS[cm], self.spec, self.tp, self.kv_dtype)
        if cm == "cpu-measured":
            model = self.model
            if not self.is_folder():
                if self.model != "kvledger-tiny":
                    raise ConfigError(
                        "--cost-model cpu-measured times the real engine: give --model a model "
                        "folder (or kvledger-tiny), or a JSON file written by --save-cost-model"
                    )
                from kvledger.model.tiny import default_model_path

                model = str(default_model_path())
            return calibrate_cpu(model)
        if Path(cm).is_file():
            return StepCostModel.load(cm)
        raise ConfigError(
            f"unknown cost model {cm!r}: use {', '.join(COST_MODELS)} or a JSON file with a, b, c"
        )

    def simulator(self, trace: list[TraceRequest]) -> Simulator:
        if self.spec is None:
            self.resolve()
        sc = SchedulerConfig(**{"max_model_len": self.max_model_len, **self.scheduler})
        cc = CacheConfig(**{"block_size": self.block_size, **self.cache})
        return Simulator(
            trace,
            sc,
            cc,
            self.num_kv_blocks,
            self.bytes_per_token,
            self.resolved_cost_model,
            static_batch=self.static_batch,
            naive_max_seq_len=self.naive_max_seq_len,
            windows=self.windows,
            tier_bytes=self.tier_bytes,
        )

    def run(self, trace: list[TraceRequest]) -> SimResult:
        return self.simulator(trace).run()

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.spec.name if self.spec else self.model,
            "kv_dtype": self.kv_dtype,
            "tp": self.tp,
            "max_model_len": self.max_model_len,
            "capacity": self.capacity_note,
        }
