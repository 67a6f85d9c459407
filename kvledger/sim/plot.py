"""One PNG of a simulated run: KV memory split used / shared / wasted / cached / free, paged vs
naive utilisation, running / waiting / swapped requests, and preemption events, against time."""

from __future__ import annotations

from pathlib import Path

from kvledger.sim.simulator import SimResult

COLORS = {
    "used": "#2b7bba",
    "shared": "#7b3294",
    "wasted": "#e66101",
    "cached": "#b2abd2",
    "free": "#e8e8e8",
}


def plot_timeline(result: SimResult, path: str | Path, title: str = "kvledger simulate") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result.steps
    if not steps:
        raise ValueError("no steps to plot")
    bs, bpt = result.block_size, result.bytes_per_token
    gb = 1e9
    t = [s.time for s in steps] + [steps[-1].time + steps[-1].duration]

    def series(f) -> list[float]:
        v = [f(s) for s in steps]
        return v + v[-1:]

    used = series(lambda s: (s.tokens_stored - s.shared_tokens) * bpt / gb)
    shared = series(lambda s: s.shared_blocks * bs * bpt / gb)
    wasted = series(
        lambda s: (
            ((s.used_blocks - s.shared_blocks) * bs - (s.tokens_stored - s.shared_tokens))
            * bpt
            / gb
        )
    )
    cached = series(lambda s: s.cached_blocks * bs * bpt / gb)
    total = result.num_blocks * bs * bpt / gb
    free = [total - u - sh - w - c for u, sh, w, c in zip(used, shared, wasted, cached)]

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True, height_ratios=[3, 2, 2, 1.3])
    ax = axes[0]
    base = [0.0] * len(t)
    for name, vals in [
        ("used (tokens stored)", used),
        ("shared (blocks with > 1 holder)", shared),
        ("wasted (allocated, not filled)", wasted),
        ("cached (free, prefix kept)", cached),
        ("free", free),
    ]:
        top = [b + v for b, v in zip(base, vals)]
        key = name.split()[0]
        ax.fill_between(t, base, top, step="post", color=COLORS[key], label=name, linewidth=0)
        base = top
    ax.set_ylabel("KV memory (GB per rank)")
    ax.set_ylim(0, total * 1.02)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    summ = result.summary()
    ax.set_title(
        f"{title}\nKV utilisation paged {summ['kv_utilization']:.1%} vs naive "
        f"{summ['naive_kv_utilization']:.1%} (max_seq_len {result.max_seq_len}); "
        f"{summ['throughput_tokens_per_s']:.0f} output tok/s",
        fontsize=10,
    )

    ax = axes[1]
    paged = series(
        lambda s: s.tokens_stored / (s.used_blocks * bs) if s.used_blocks else float("nan")
    )
    naive = series(
        lambda s: (
            s.naive_tokens / (s.num_resident * result.max_seq_len)
            if s.num_resident
            else float("nan")
        )
    )
    usage = series(lambda s: s.used_blocks / result.num_blocks)
    ax.step(
        t, paged, where="post", label="paged: tokens / slots in used blocks", color=COLORS["used"]
    )
    ax.step(
        t,
        naive,
        where="post",
        label="naive: tokens / (requests x max_seq_len)",
        color=COLORS["wasted"],
    )
    ax.step(
        t, usage, where="post", label="pool usage: used / total blocks", color="0.4", linestyle=":"
    )
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction")
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)

    ax = axes[2]
    for name, f, color in [
        ("running", lambda s: s.num_running, "#1a9641"),
        ("waiting", lambda s: s.num_waiting, "#d7191c"),
        ("swapped", lambda s: s.num_swapped, "#fdae61"),
    ]:
        ax.step(t, series(f), where="post", label=name, color=color)
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[3]
    for mode, marker, color, y in [("swap", "v", "#fdae61", 1), ("recompute", "x", "#d7191c", 0)]:
        xs = [s.time for s in steps for _, m in s.preempted if m == mode]
        n = len(xs)
        ax.scatter(xs, [y] * n, marker=marker, color=color, s=18, label=f"{mode} ({n})")
    ax.set_yticks([0, 1], ["recompute", "swap"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_ylabel("preemptions")
    ax.set_xlabel("simulated time (s)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
