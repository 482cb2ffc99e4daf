"""The console summary, in the layout of ``vllm bench serve`` plus pd-bench's own sections."""

from __future__ import annotations

import math
from typing import Any

from pd_cluster.bench.metrics import pct_key

WIDTH = 50
_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return "{:<40} {:<10}".format(label, str(value))


def _rule(title: str, ch: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=title, n=WIDTH, c=ch)


def format_summary(s: dict[str, Any], info: dict[str, Any], percentiles: tuple[float, ...],
                   metrics: tuple[str, ...], breakdown: dict[str, Any] | None) -> str:
    """The whole console report as one string. ``info`` holds run facts (target, rate, scaling...)."""
    lines = [_rule(" Serving Benchmark Result ", "=")]
    lines += [_row("Target:", info["target"]), _row("Model:", info["model"]),
              _row("Dataset:", info["dataset"]), _row("Arrivals:", info["arrivals"]),
              _row("Maximum request concurrency:", info["max_concurrency"]),
              _row("Successful requests:", s["completed"]), _row("Failed requests:", s["failed"])]
    for reason, n in s["failure_reasons"].items():
        lines.append(_row(f"  {reason}:", n))
    if s["not_sent"]:
        lines.append(_row("Not sent (--duration reached):", s["not_sent"]))
    lines += [_row("Benchmark duration (s):", s["duration_s"]),
              _row("Total input tokens:", s["total_input_tokens"]),
              _row("Total generated tokens:", s["total_output_tokens"]),
              _row("Request throughput (req/s):", s["request_throughput"]),
              _row("Input token throughput (tok/s):", s["input_throughput"]),
              _row("Output token throughput (tok/s):", s["output_throughput"]),
              _row("Peak output token throughput (tok/s):", s["peak_output_throughput"]),
              _row("Total Token throughput (tok/s):", s["total_token_throughput"]),
              _row("Mean concurrency:", s["mean_concurrency"]),
              _row("Peak concurrent requests:", s["peak_concurrency"])]
    if s.get("server_prefix_cache_hit_rate") is not None:
        lines.append(_row("Prefix cache hit rate (server, %):", 100.0 * s["server_prefix_cache_hit_rate"]))
    if "request_goodput" in s:
        slos = " ".join(f"{k}:{v:g}" for k, v in s["goodput_slos_ms"].items())
        lines += [_row("Goodput SLOs (ms):", slos), _row("Request goodput (req/s):", s["request_goodput"]),
                  _row("Requests meeting the SLOs (%):", 100.0 * s["goodput_share"])]
        for w in s.get("goodput_windows", []):
            lines.append(_row(f"  sent {w['start_s']:g}-{w['end_s']:g} s (good/sent {w['good_requests']}/"
                              f"{w['requests']}), req/s:", w["request_goodput"]))
    for m in metrics:
        title, short = _TITLES[m]
        lines.append(_rule(title))
        lines += [_row(f"Mean {short} (ms):", s[f"mean_{m}_ms"]), _row(f"Median {short} (ms):", s[f"median_{m}_ms"]),
                  _row(f"Std {short} (ms):", s[f"std_{m}_ms"])]
        lines += [_row(f"P{pct_key(p)} {short} (ms):", s[f"p{pct_key(p)}_{m}_ms"]) for p in percentiles]
    lines += _breakdown_lines(breakdown)
    lines += _client_lines(s["client"])
    lines.append(_rule("Notes"))
    lines += [info["scaling"]] + list(info.get("notes", []))
    for w in s["client"]["warnings"]:
        lines.append(f"WARNING: unreliable measurement: {w}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _breakdown_lines(b: dict[str, Any] | None) -> list[str]:
    lines = [_rule("Server-side breakdown")]
    if b is None:
        return lines + ["not available: the target exposes no pd: metrics"]
    for p in b["phases"]:
        lines.append(_row(f"{p['phase'].capitalize()} [{p['role']}] mean/p99 (ms):",
                          f"{p['mean_ms']:.2f} / {p['p99_ms']:.2f}"))
    for kv in b["kv_transfer"]:
        lines.append(_row(f"KV transferred [{kv['role']}] (GB):", kv["bytes"] / 1e9))
        lines.append(_row(f"KV transfer GB/s [{kv['role']}] (busy):", kv["gb_per_s_while_transferring"]))
        lines.append(_row(f"KV transfer speed [{kv['role']}] p99 (GB/s):", kv["speed_p99_gb_s"]))
        if kv["failed"]:
            lines.append(_row(f"KV transfers failed [{kv['role']}]:", kv["failed"]))
    if b["peak_token_usage"]:
        url, peak = max(b["peak_token_usage"].items(), key=lambda kv: kv[1])
        lines.append(_row("Peak token usage (%):", f"{100 * peak:.1f} ({url})"))
    for pc in b.get("prefix_cache", []):
        lines.append(_row(f"Prefix cache hits [{pc['role']}] (tokens):",
                          f"{pc['hits']:,.0f} of {pc['queries']:,.0f}"))
    for sd in b.get("spec_decode", []):
        lines.append(_row(f"Spec decode mean accepted length [{sd['role']}]:", sd["mean_accepted_length"]))
        lines.append(_row(f"Spec decode acceptance rate [{sd['role']}] (%):", 100 * sd["acceptance_rate"]))
    if not b["phases"] and not b["kv_transfer"]:
        lines.append("no pd: request histograms changed during the run")
    lines += b["notes"]
    return lines


def _client_lines(c: dict[str, Any]) -> list[str]:
    return [_rule("Client (pd-bench itself)"),
            _row("Scheduler lag p50 (ms):", c["lag_p50_ms"]), _row("Scheduler lag p99 (ms):", c["lag_p99_ms"]),
            _row("Achieved send rate (req/s):", c["achieved_send_rate"]),
            _row("Concurrency-limit wait mean (ms):", c["concurrency_wait_mean_ms"]),
            _row("Event-loop delay p50/p99 (ms):", f"{c['loop_delay_p50_ms']:.2f} / {c['loop_delay_p99_ms']:.2f}"),
            _row("Client CPU (% of one core):", c["client_cpu_percent"]),
            _row("Stream parsing (us per chunk):", c["parse_us_per_chunk"])]
