"""`kvledger simulate --html out.html`: the dashboard's views of a simulated run, in one file.

A ``FrameRecorder`` rides along ``Simulator.run`` (its ``on_step`` hook) and keeps, on the
simulated clock, dashboard frames (block map, totals, request table: the same
``capture_frame`` the live server uses) and the time series. Both are thinned as the run goes
(every other one dropped, the interval doubled), so a long run stays a few megabytes. The page
is the server's own dashboard page with the recording embedded: no server, nothing fetched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvledger.core.request import Request
from kvledger.core.sched_output import SchedulerOutput
from kvledger.errors import ConfigError
from kvledger.ledger.frame import capture_frame, series_point
from kvledger.server.page import render_page
from kvledger.sim.simulator import Simulator

MAX_FRAMES = 80
MAX_POINTS = 2000
MAX_CELLS = 1024


class _Thinned:
    """Samples at most one item per ``interval`` of simulated time, at most ``cap`` in all."""

    def __init__(self, cap: int, interval: float = 0.0) -> None:
        self.cap = cap
        self.interval = interval  # 0: every step, until the cap is first reached
        self.times: list[float] = []
        self.items: list[dict[str, Any]] = []

    def due(self, t: float) -> bool:
        return not self.times or t >= self.times[-1] + self.interval

    def add(self, t: float, item: dict[str, Any]) -> None:
        self.times.append(t)
        self.items.append(item)
        if len(self.items) > self.cap:
            self.times, self.items = self.times[::2], self.items[::2]
            span = self.times[-1] - self.times[0]
            self.interval = max(2 * self.interval, span / len(self.times))


class FrameRecorder:
    """The ``on_step`` hook of ``Simulator.run`` that records the dashboard's views."""

    def __init__(
        self,
        sim: Simulator,
        kv_cache_dtype: str = "auto",
        reference_bytes_per_token: int = 0,
        max_frames: int = MAX_FRAMES,
        max_points: int = MAX_POINTS,
        max_cells: int = MAX_CELLS,
    ) -> None:
        self.sim = sim
        self.kv_cache_dtype = kv_cache_dtype
        self.reference_bpt = reference_bytes_per_token
        self.max_cells = max_cells
        # The run lasts at least until the last arrival: a first guess at the spacing.
        last_arrival = sim.trace[-1].arrival_time - sim.trace[0].arrival_time if sim.trace else 0.0
        self.frames = _Thinned(max_frames, last_arrival / max_frames)
        self.points = _Thinned(max_points, last_arrival / max_points)
        self.done_tokens = 0
        self.swap_out_blocks = self.swap_in_blocks = 0

    def generated_tokens(self) -> int:
        s = self.sim.scheduler
        live = sum(r.num_output_tokens for q in (s.running, s.swapped, s.waiting) for r in q)
        return self.done_tokens + live

    def frame(self, clock: float) -> dict[str, Any]:
        sim = self.sim
        snap = sim.kv.ledger()
        bpb = sim.kv.bytes_per_block
        snap.kv_cache_dtype = self.kv_cache_dtype
        snap.preemptions = dict(sim.scheduler.num_preemptions)
        snap.swapped_out_blocks, snap.swapped_in_blocks = self.swap_out_blocks, self.swap_in_blocks
        snap.swap_out_bytes, snap.swap_in_bytes = (
            self.swap_out_blocks * bpb,
            self.swap_in_blocks * bpb,
        )
        return capture_frame(
            sim.scheduler,
            snap,
            time=clock,
            max_model_len=sim.max_seq_len,
            reference_bytes_per_token=self.reference_bpt,
            max_cells=self.max_cells,
        )

    def __call__(self, so: SchedulerOutput, clock: float, finished: list[Request]) -> None:
        self.done_tokens += sum(r.num_output_tokens for r in finished)
        self.swap_out_blocks += len(so.blocks_to_swap_out)
        self.swap_in_blocks += len(so.blocks_to_swap_in)
        if self.points.due(clock):
            p = series_point(self.sim.scheduler, clock, self.generated_tokens())
            self.points.add(clock, p)
        if self.frames.due(clock):
            self.frames.add(clock, self.frame(clock))

    def recording(self, clock: float, title: str, subtitle: str, summary: dict) -> dict[str, Any]:
        """The embedded data: frames and series, closed with the pool as the run left it."""
        frames = [*self.frames.items, self.frame(clock)]
        points = [
            *self.points.items,
            series_point(self.sim.scheduler, clock, self.generated_tokens()),
        ]
        return {
            "mode": "simulated",
            "title": title,
            "subtitle": subtitle,
            "summary": summary,
            "frames": frames,
            "series": points,
        }


def check_html_path(path: str | Path) -> None:
    """Fail before the run, not after it, on a path that cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"cannot write --html {str(p)!r}: it is a directory")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot write --html {str(p)!r}: {str(parent)!r} is not writable")


def write_html(recording: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_page(recording), encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write --html {str(path)!r}: {e.strerror or e}") from None
    return path
