"""Trace-driven simulation over the engine's own scheduler: a cost model and a virtual clock."""

from kvledger.sim.cost_model import StepCostModel, gpu_cost_model
from kvledger.sim.simulator import SimResult, Simulator, apply_step_update, build_scheduler
from kvledger.sim.trace import LengthDist, TraceRequest, load_trace, synthetic_trace

__all__ = [
    "LengthDist",
    "SimResult",
    "Simulator",
    "StepCostModel",
    "TraceRequest",
    "apply_step_update",
    "build_scheduler",
    "gpu_cost_model",
    "load_trace",
    "synthetic_trace",
]
