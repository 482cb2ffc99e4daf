"""The summary of a run: counts, throughput, concurrency, latency statistics, goodput, client health.

Definitions follow ``vllm bench serve``: throughputs are over the benchmark
duration (first planned send to last completion); token counts and latency
statistics cover completed requests; ITL statistics pool every gap of every
request; TPOT is ``(E2EL - TTFT) / (output_tokens - 1)`` over requests with
more than one output token. Standard deviations are population (``np.std``).
Percentiles interpolate linearly (``np.percentile``). Goodput (DistServe,
Zhong et al., OSDI'24) counts completed requests that meet every SLO given,
per second and as a share of all requests sent.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from pd_cluster.bench.client import RequestRecord
from pd_cluster.bench.config import ReportConfig
from pd_cluster.bench.runner import RunOutput

LAG_WARN_S = 0.005
LOOP_DELAY_WARN_S = 0.005
CPU_WARN_PERCENT = 90.0


def pct_key(p: float) -> str:
    """``99`` -> ``"99"``, ``99.9`` -> ``"99.9"`` (vLLM's key style)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def count_output_tokens(records: list[RequestRecord], tokenizer: Any | None) -> None:
    """Fill ``output_tokens`` where the server sent no usage: tokenizer count, else chunk count."""
    for r in records:
        if r.success and not r.output_source:
            if tokenizer is not None:
                r.output_tokens, r.output_source = tokenizer.count(r.text), "tokenizer"
            else:
                r.output_tokens, r.output_source = r.num_chunks, "chunks"


def latency_stats(values_s: list[float], percentiles: tuple[float, ...], name: str) -> dict[str, float]:
    """mean/median/std and percentiles of ``values_s`` (seconds) as ``*_{name}_ms`` keys (NaN if empty)."""
    if not values_s:
        keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
        return dict.fromkeys(keys + [f"p{pct_key(p)}_{name}_ms" for p in percentiles], math.nan)
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p in percentiles:
        out[f"p{pct_key(p)}_{name}_ms"] = float(np.percentile(a, p))
    return out


def goodput(records: list[RequestRecord], slos_ms: tuple[tuple[str, float], ...], duration_s: float
            ) -> dict[str, Any]:
    """Requests meeting every SLO (``ttft``/``tpot``/``e2el`` in ms): count, req/s, share of sent."""
    if not slos_ms:
        return {}
    get = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.latency}
    good = sum(1 for r in records if r.success and all(get[m](r) * 1000.0 <= v for m, v in slos_ms))
    return {"goodput_slos_ms": dict(slos_ms), "good_requests": good,
            "request_goodput": good / duration_s if duration_s > 0 else 0.0,
            "goodput_share": good / len(records) if records else 0.0}


def goodput_windows(records: list[RequestRecord], slos_ms: tuple[tuple[str, float], ...],
                    windows: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """`goodput` per window of planned send time: for each ``(start, end)`` (seconds from the run's start), the
    requests due in ``[start, end)`` (the last window also takes those due at its end), how many were good, and
    good requests per second of the window (DistServe's goodput, per phase of a load that changes)."""
    out = []
    for i, (start, end) in enumerate(windows):
        last = i == len(windows) - 1
        part = [r for r in records if start <= r.planned < end or (last and r.planned == end)]
        g = goodput(part, slos_ms, end - start)
        out.append({"start_s": start, "end_s": end, "requests": len(part), "good_requests": g["good_requests"],
                    "request_goodput": g["request_goodput"]})
    return out


def token_times(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Arrival time (s from start) and token count of every content event of completed requests."""
    times, counts = [], []
    for r in records:
        if not r.success or r.num_chunks == 0:
            continue
        t = r.sent + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        times.append(t)
        counts.append(np.full(len(t), r.output_tokens / r.num_chunks))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(counts)


def concurrency(records: list[RequestRecord], duration_s: float) -> tuple[float, int]:
    """Mean (Little's law over [sent, end]) and peak number of requests in flight."""
    spans = [(r.sent, r.sent + r.latency) for r in records if r.sent == r.sent]
    if not spans or duration_s <= 0:
        return 0.0, 0
    mean = sum(e - s for s, e in spans) / duration_s
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return mean, peak


def client_health(out: RunOutput, rate_is_inf: bool) -> dict[str, Any]:
    """Scheduler lag, event-loop delay, CPU use, parse cost, and whether the run can be trusted."""
    recs = out.records
    lags = np.array([r.started - r.planned for r in recs]) if recs else np.zeros(1)
    waits = np.array([r.sent - r.started for r in recs if r.sent == r.sent]) if recs else np.zeros(1)
    loop = np.asarray(out.client.loop_delays or [0.0])
    chunks = sum(r.num_chunks for r in recs)
    cpu_pct = 100.0 * out.client.cpu_s / out.client.wall_s if out.client.wall_s > 0 else 0.0
    starts = sorted(r.started for r in recs)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    h = {"lag_p50_ms": float(np.percentile(lags, 50) * 1e3), "lag_p99_ms": float(np.percentile(lags, 99) * 1e3),
         "lag_max_ms": float(lags.max() * 1e3),
         "concurrency_wait_mean_ms": float(waits.mean() * 1e3) if waits.size else 0.0,
         "loop_delay_p50_ms": float(np.percentile(loop, 50) * 1e3),
         "loop_delay_p99_ms": float(np.percentile(loop, 99) * 1e3),
         "client_cpu_percent": cpu_pct,
         "parse_us_per_chunk": sum(r.parse_s for r in recs) / chunks * 1e6 if chunks else 0.0,
         "achieved_send_rate": (len(starts) - 1) / span if span > 0 else math.inf}
    warnings = []
    if not rate_is_inf and h["lag_p99_ms"] > LAG_WARN_S * 1e3:
        warnings.append(f"scheduler lag p99 {h['lag_p99_ms']:.1f} ms > {LAG_WARN_S * 1e3:g} ms: "
                        "requests went out later than planned, the offered load was not met")
    if h["loop_delay_p99_ms"] > LOOP_DELAY_WARN_S * 1e3:
        warnings.append(f"event-loop delay p99 {h['loop_delay_p99_ms']:.1f} ms: client timestamps "
                        "may be late by that much")
    if cpu_pct > CPU_WARN_PERCENT:
        warnings.append(f"client CPU {cpu_pct:.0f}% of a core: the client may be the bottleneck")
    h["reliable"] = not warnings
    h["warnings"] = warnings
    return h


def summarize(out: RunOutput, cfg: ReportConfig, rate_is_inf: bool) -> dict[str, Any]:
    """The flat summary dict printed to the console and saved as JSON (see module docstring)."""
    recs = out.records
    ok = [r for r in recs if r.success]
    dur = out.duration_s
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    t, n = token_times(ok)
    peak_out = float(np.bincount(t.astype(np.int64), weights=n).max()) if t.size else 0.0
    mean_conc, peak_conc = concurrency(recs, dur)
    s: dict[str, Any] = {
        "completed": len(ok), "failed": len(recs) - len(ok), "not_sent": out.not_sent,
        "failure_reasons": dict(Counter(r.reason for r in recs if not r.success).most_common()),
        "duration_s": dur, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / dur if dur > 0 else 0.0,
        "input_throughput": in_tok / dur if dur > 0 else 0.0,
        "output_throughput": out_tok / dur if dur > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / dur if dur > 0 else 0.0,
        "peak_output_throughput": peak_out,
        "mean_concurrency": mean_conc, "peak_concurrency": peak_conc,
        "output_tokens_from": dict(Counter(r.output_source for r in ok)),
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in cfg.percentile_metrics:
        s.update(latency_stats(series[name], cfg.metric_percentiles, name))
    s.update(goodput(recs, cfg.goodput, dur))
    s["client"] = client_health(out, rate_is_inf)
    return s
