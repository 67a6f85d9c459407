"""This process's place in the tensor-parallel group, and the collectives the model needs.

One group per process (a worker is one rank of one engine); outside a worker the world is one
rank and every collective is the identity, so the model code calls them unconditionally.
Collectives go through torch.distributed (gloo on CPU, NCCL on CUDA). The time spent inside
them is summed per step (``collective_seconds``) for the all-reduce figure of the benchmark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPState:
    rank: int = 0
    world_size: int = 1
    collective_seconds: float = 0.0  # time inside all-reduce / all-gather since the last reset
    num_collectives: int = 0


TP = TPState()


def set_tp(rank: int, world_size: int) -> None:
    """Called once by a worker after ``dist.init_process_group``."""
    TP.rank, TP.world_size = rank, world_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place (the output of a row-parallel layer)."""
    if TP.world_size == 1:
        return x
    t0 = time.perf_counter()
    dist.all_reduce(x)
    TP.collective_seconds += time.perf_counter() - t0
    TP.num_collectives += 1
    return x


def all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise max of x over the ranks, in place (a row's absolute max for int8 scales
    that are one process's: W8A8 row-parallel products, distributed/sharding.py)."""
    if TP.world_size == 1:
        return x
    t0 = time.perf_counter()
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    TP.collective_seconds += time.perf_counter() - t0
    TP.num_collectives += 1
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (vocabulary-parallel logits)."""
    if TP.world_size == 1:
        return x
    t0 = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(TP.world_size)]
    dist.all_gather(parts, x)
    TP.collective_seconds += time.perf_counter() - t0
    TP.num_collectives += 1
    return torch.cat(parts, dim=-1)
