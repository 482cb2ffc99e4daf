"""``pd-bench compare A.json B.json``: two result files side by side, with B/A ratios."""

from __future__ import annotations

import math
from typing import Any

from pd_cluster.bench.results import load

ROWS = (
    ("Successful requests", "completed", "higher"),
    ("Failed requests", "failed", "lower"),
    ("Duration (s)", "duration_s", None),
    ("Request throughput (req/s)", "request_throughput", "higher"),
    ("Output token throughput (tok/s)", "output_throughput", "higher"),
    ("Total token throughput (tok/s)", "total_token_throughput", "higher"),
    ("Request goodput (req/s)", "request_goodput", "higher"),
    ("Mean concurrency", "mean_concurrency", None),
    ("Prefix cache hit rate (server)", "server_prefix_cache_hit_rate", "higher"),
    ("Spec decode mean accepted length (server)", "server_spec_decode_mean_accepted_length", "higher"),
    ("Mean TTFT (ms)", "mean_ttft_ms", "lower"),
    ("Median TTFT (ms)", "median_ttft_ms", "lower"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "lower"),
    ("Mean TPOT (ms)", "mean_tpot_ms", "lower"),
    ("Median TPOT (ms)", "median_tpot_ms", "lower"),
    ("P99 TPOT (ms)", "p99_tpot_ms", "lower"),
    ("Mean ITL (ms)", "mean_itl_ms", "lower"),
    ("Median ITL (ms)", "median_itl_ms", "lower"),
    ("P99 ITL (ms)", "p99_itl_ms", "lower"),
    ("Mean E2EL (ms)", "mean_e2el_ms", "lower"),
    ("Median E2EL (ms)", "median_e2el_ms", "lower"),
    ("P99 E2EL (ms)", "p99_e2el_ms", "lower"),
    ("Scheduler lag p99 (ms)", "client.lag_p99_ms", "lower"),
)


def _get(summary: dict[str, Any], key: str) -> float | None:
    cur: Any = summary
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return float(cur) if isinstance(cur, (int, float)) and cur is not None else None


def _fmt(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f}"


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """A table of the summaries' key metrics with ``B/A``; ``*`` marks B better by over 5%."""
    sa, sb = a["summary"], b["summary"]
    lines = [f"A: {name_a}", f"B: {name_b}", "",
             "{:<34} {:>12} {:>12} {:>8}".format("Metric", "A", "B", "B/A"), "-" * 69]
    for label, key, better in ROWS:
        va, vb = _get(sa, key), _get(sb, key)
        if va is None and vb is None:
            continue
        ratio = vb / va if va not in (None, 0) and vb is not None else None
        mark = ""
        if ratio is not None and better:
            mark = " *" if (ratio > 1.05 if better == "higher" else ratio < 0.95) else ""
        lines.append("{:<34} {:>12} {:>12} {:>8}{}".format(label, _fmt(va), _fmt(vb),
                                                         "-" if ratio is None else f"{ratio:.3f}", mark))
    for side, s in (("A", sa), ("B", sb)):
        for w in (s.get("client") or {}).get("warnings", []):
            lines.append(f"WARNING ({side}): {w}")
    lines.append("* B better than A by more than 5%")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    if len(paths) != 2:
        print("usage: pd-bench compare A.json B.json")
        return 2
    print(compare_table(load(paths[0]), load(paths[1]), paths[0], paths[1]))
    return 0
