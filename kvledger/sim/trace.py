"""Workloads for the simulator: synthetic length distributions and JSONL traces.

A trace row is ``{"arrival_time": s, "prompt_len": n, "output_len": n}`` with optional
``prefix_id`` + ``prefix_len`` (requests with the same ``prefix_id`` share their first
``prefix_len`` prompt tokens, e.g. a system prompt). Rows may come in any arrival order; they
are sorted (stably) by arrival time. Every bad row is a ``ConfigError`` naming its line.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvledger.errors import ConfigError

HIGH_VARIANCE = ((0.9, 16, 64), (0.1, 256, 512))  # (share, lo, hi): 90% short, 10% long


@dataclass(frozen=True)
class TraceRequest:
    arrival_time: float
    prompt_len: int
    output_len: int
    prefix_id: str | None = None
    prefix_len: int = 0
    line: int | None = field(default=None, compare=False)  # where a trace file gave it

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["line"]
        if self.prefix_id is None:
            del d["prefix_id"], d["prefix_len"]
        return d


@dataclass(frozen=True)
class LengthDist:
    """fixed N | uniform a-b | lognormal median,sigma | high-variance (90% 16-64 / 10% 256-512)."""

    kind: str
    a: float = 0
    b: float = 0

    @classmethod
    def parse(cls, text: str, flag: str = "length") -> LengthDist:
        """'128', 'fixed:128', '16-64', 'uniform:16-64', 'lognormal:300,1.0', 'high-variance'."""
        s = str(text).strip().lower()
        kind, _, rest = s.partition(":") if ":" in s else ("", "", s)
        try:
            if s in ("high-variance", "highvar", "mix"):
                return cls("high-variance")
            if kind == "lognormal":
                median, sigma = (float(x) for x in rest.split(","))
                if median < 1 or sigma < 0:
                    raise ValueError
                return cls("lognormal", median, sigma)
            if kind in ("", "uniform") and "-" in rest:
                lo, hi = (int(x) for x in rest.split("-"))
                if not 1 <= lo <= hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            if kind in ("", "fixed"):
                n = int(rest)
                if n < 1:
                    raise ValueError
                return cls("fixed", n, n)
        except ValueError:
            pass
        raise ConfigError(
            f"invalid {flag} distribution {text!r}: use N, a-b (uniform, 1 <= a <= b), "
            "lognormal:MEDIAN,SIGMA or high-variance"
        )

    def sample(self, rng: random.Random, cap: int | None = None) -> int:
        if self.kind == "fixed":
            n = int(self.a)
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            n = max(1, round(self.a * math.exp(rng.gauss(0.0, self.b))))
        else:
            u, acc = rng.random(), 0.0
            lo, hi = HIGH_VARIANCE[-1][1:]
            for share, lo_i, hi_i in HIGH_VARIANCE:
                acc += share
                if u < acc:
                    lo, hi = lo_i, hi_i
                    break
            n = rng.randint(lo, hi)
        return min(n, cap) if cap else n

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"uniform {int(self.a)}-{int(self.b)}"
        if self.kind == "lognormal":
            return f"lognormal median {self.a:g} sigma {self.b:g}"
        return "high-variance (90% 16-64 / 10% 256-512)"


def synthetic_trace(
    num_requests: int,
    prompt_len: LengthDist | str,
    output_len: LengthDist | str,
    arrival_rate: float | None = None,
    seed: int = 0,
    shared_prefix_len: int = 0,
    max_prompt_len: int | None = None,
) -> list[TraceRequest]:
    """Poisson arrivals at ``arrival_rate`` req/s (None or inf: all at t = 0). A shared prefix
    of ``shared_prefix_len`` tokens (one ``prefix_id`` for all) is prepended to each prompt."""
    if num_requests < 1:
        raise ConfigError(f"--num-requests must be >= 1, got {num_requests}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ConfigError(f"--arrival-rate must be > 0 requests/s, got {arrival_rate}")
    if shared_prefix_len < 0:
        raise ConfigError(f"--shared-prefix-len must be >= 0, got {shared_prefix_len}")
    pd = (
        prompt_len
        if isinstance(prompt_len, LengthDist)
        else LengthDist.parse(prompt_len, "--prompt-len")
    )
    od = (
        output_len
        if isinstance(output_len, LengthDist)
        else LengthDist.parse(output_len, "--output-len")
    )
    rng = random.Random(seed)
    t = 0.0
    out = []
    cap = max_prompt_len - shared_prefix_len if max_prompt_len else None
    if cap is not None and cap < 1:
        raise ConfigError(f"--shared-prefix-len {shared_prefix_len} leaves no room for a prompt")
    for _ in range(num_requests):
        if arrival_rate is not None and math.isfinite(arrival_rate):
            t += rng.expovariate(arrival_rate)
        p = pd.sample(rng, cap)
        o = od.sample(rng)
        if shared_prefix_len:
            out.append(TraceRequest(t, shared_prefix_len + p, o, "shared", shared_prefix_len))
        else:
            out.append(TraceRequest(t, p, o))
    return out


def _length(row: dict[str, Any], key: str, where: str) -> int:
    if key not in row:
        raise ConfigError(f"{where}: missing field {key!r}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
        raise ConfigError(f"{where}: {key} must be an integer, got {v!r}")
    if v < 1:
        raise ConfigError(f"{where}: {key} must be >= 1, got {v!r}")
    return int(v)


def parse_trace_line(line: str, where: str, lineno: int | None = None) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "arrival_time" not in row:
        raise ConfigError(f"{where}: missing field 'arrival_time'")
    t = row["arrival_time"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise ConfigError(f"{where}: arrival_time must be a finite number of seconds, got {t!r}")
    if t < 0:
        raise ConfigError(f"{where}: arrival_time must be >= 0, got {t!r}")
    prompt = _length(row, "prompt_len", where)
    output = _length(row, "output_len", where)
    has_id, has_len = row.get("prefix_id") is not None, row.get("prefix_len") is not None
    if has_id != has_len:
        raise ConfigError(f"{where}: prefix_id and prefix_len must be given together")
    prefix_id, prefix_len = None, 0
    if has_id:
        pid = row["prefix_id"]
        if isinstance(pid, bool) or not isinstance(pid, str | int):
            raise ConfigError(f"{where}: prefix_id must be a string or an integer, got {pid!r}")
        prefix_id = str(pid)
        prefix_len = _length(row, "prefix_len", where)
        if prefix_len > prompt:
            raise ConfigError(f"{where}: prefix_len {prefix_len} exceeds prompt_len {prompt}")
    return TraceRequest(float(t), prompt, output, prefix_id, prefix_len, lineno)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace (blank lines and lines starting with # are skipped), sorted by arrival."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read trace {str(path)!r}: {e}") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            rows.append(parse_trace_line(line, f"{path}:{i}", i))
    if not rows:
        raise ConfigError(f"{path}: trace has no requests")
    return sorted(rows, key=lambda r: r.arrival_time)


def write_trace(rows: list[TraceRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(r.to_dict()) + "\n" for r in rows), encoding="utf-8")
