"""Text tables and the matplotlib plot for ``pagelm simulate`` results."""

from __future__ import annotations

from pathlib import Path

from pagelm.plugins.sim.simulator import SimResult

_COLUMNS = [
    ("TTFT p50", "ttft_p50", "{:.3f}s"),
    ("TTFT p99", "ttft_p99", "{:.3f}s"),
    ("E2E mean", "e2e_mean", "{:.3f}s"),
    ("E2E p50", "e2e_p50", "{:.3f}s"),
    ("E2E p99", "e2e_p99", "{:.3f}s"),
    ("out tok/s", "output_tok_per_s", "{:.0f}"),
    ("req/s", "req_per_s", "{:.2f}"),
    ("preempt", "preemptions", "{:d}"),
    ("prefix hit", "prefix_hit_rate", "{:.1%}"),
    ("sim s", "simulated_s", "{:.1f}"),
    ("wall s", "wall_s", "{:.2f}"),
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def format_results(results: list[SimResult]) -> str:
    rows = []
    for res in results:
        s = res.summary()
        rows.append([res.policy, *(f.format(int(s[k]) if f == "{:d}" else s[k]) for _, k, f in _COLUMNS)])
    text = _table(["policy", *(c for c, _, _ in _COLUMNS)], rows)
    classes = sorted({p for res in results for p in res.ttft_p99_by_priority()})
    if len(classes) > 1:
        by_class = [[res.policy, *(f"{res.ttft_p99_by_priority()[p]:.3f}s" for p in classes)] for res in results]
        text += "\n\nTTFT p99 by priority class (lower value = higher priority)\n"
        text += _table(["policy", *(f"priority {p}" for p in classes)], by_class)
    speed = [
        f"{res.policy}: {len(res.e2e) / res.wall_seconds:,.0f} requests/s, "
        f"{res.num_steps / res.wall_seconds:,.0f} steps/s, {res.makespan / res.wall_seconds:.1f}x real time"
        for res in results
    ]
    return text + "\n\nsimulator speed (wall clock): " + "; ".join(speed)


def plot_results(results: list[SimResult], path: str | Path) -> None:
    """Queue length, running requests and KV-cache usage over simulated time, one line per
    policy. Needs matplotlib (``pip install pagelm[sim]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'pagelm[sim]'") from None
    panels = [("waiting requests", "num_waiting"), ("running requests", "num_running"), ("KV cache usage", "kv_usage")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 8), sharex=True)
    for ax, (title, attr) in zip(axes, panels):
        for res in results:
            ax.plot(res.timeline.time, getattr(res.timeline, attr), label=res.policy, linewidth=0.8)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right")
    axes[-1].set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
