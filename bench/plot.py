"""``--plot``: PNGs of the latency CDFs and of throughput and concurrency over time (matplotlib, Agg)."""

from __future__ import annotations

import os

import numpy as np

from pd_cluster.bench.client import RequestRecord
from pd_cluster.bench.metrics import token_times


def _cdf(ax, values_s: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(True, alpha=0.3)
    if not values_s:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    x = np.sort(np.asarray(values_s)) * 1e3
    ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post")
    for q in (50, 99):
        v = np.percentile(x, q)
        ax.axvline(v, ls="--", lw=0.8, color="gray")
        ax.annotate(f"p{q} {v:.1f}", (v, q / 100), fontsize=7, xytext=(3, -10), textcoords="offset points")


def latency_cdfs(records: list[RequestRecord], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    _cdf(axes[0], [r.ttft for r in ok], "TTFT")
    _cdf(axes[1], [x for r in ok for x in r.itl], "ITL")
    _cdf(axes[2], [r.latency for r in ok], "E2E latency")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def timeline(records: list[RequestRecord], duration_s: float, path: str, title: str) -> str:
    """Output tokens/s and completed requests/s per time bucket, and requests in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dur = max(duration_s, 1e-3)
    width = max(dur / 100.0, 0.05)
    edges = np.arange(0.0, dur + width, width)
    t, n = token_times(records)
    tok_rate = np.histogram(t, bins=edges, weights=n)[0] / width
    ends = [r.sent + r.latency for r in records if r.success]
    req_rate = np.histogram(ends, bins=edges)[0] / width
    spans = [(r.sent, r.sent + r.latency) for r in records if r.sent == r.sent]
    ev = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    xs, ys, cur = [0.0], [0], 0
    for x, d in ev:
        cur += d
        xs.append(x)
        ys.append(cur)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    mid = edges[:-1] + width / 2
    a1.plot(mid, tok_rate, label="output tokens/s")
    a1.set_ylabel("output tokens/s")
    a1b = a1.twinx()
    a1b.plot(mid, req_rate, color="tab:orange", label="completed req/s")
    a1b.set_ylabel("completed req/s")
    lines = a1.get_lines() + a1b.get_lines()
    a1.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    a1.set_title("Throughput")
    a1.grid(True, alpha=0.3)
    a2.step(xs, ys, where="post", color="tab:green")
    a2.set_ylabel("requests in flight")
    a2.set_xlabel("seconds since start")
    a2.set_title("Concurrency")
    a2.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(records: list[RequestRecord], duration_s: float, stem: str, title: str) -> list[str]:
    """Writes ``{stem}_latency_cdf.png`` and ``{stem}_timeline.png``; returns their paths."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    return [latency_cdfs(records, stem + "_latency_cdf.png", title),
            timeline(records, duration_s, stem + "_timeline.png", title)]
