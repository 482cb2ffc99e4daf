"""``pd-bench``: run a benchmark (``pd-bench --base-url URL ...``) or compare two results
(``pd-bench compare A.json B.json``). See ``docs/bench.md``."""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import datetime
from typing import Any

from pd_cluster.bench import compare, results
from pd_cluster.bench.args import build_parser, to_config
from pd_cluster.bench.arrival import ArrivalPlan, rate_plan, step_windows, steps_plan, trace_plan
from pd_cluster.bench.config import BenchConfig
from pd_cluster.bench.datasets import TRACE_DATASETS, Dataset, load_dataset
from pd_cluster.bench.metrics import count_output_tokens, goodput_windows, summarize
from pd_cluster.bench.preflight import context_length, context_warning, list_models
from pd_cluster.bench.report import format_summary
from pd_cluster.bench.runner import Runner, RunOutput
from pd_cluster.bench.tokenizer import load_tokenizer, resolve_tokenizer_name


def arrival_plan(cfg: BenchConfig, ds: Dataset) -> ArrivalPlan:
    """``--rate-steps`` when given; trace timestamps for trace datasets unless ``--request-rate`` is given; else
    rate arrivals."""
    load = cfg.load
    if load.rate_steps:  # a dataset that yields fewer prompts than the steps' count ends the run early
        plan = steps_plan(load.rate_steps, load.burstiness, load.seed)
        return ArrivalPlan(plan.times[:len(ds.requests)], plan.kind)
    if load.request_rate is None and cfg.dataset.name in TRACE_DATASETS:
        return trace_plan([r.timestamp or 0.0 for r in ds.requests], load.trace_speedup)
    rate = load.request_rate if load.request_rate is not None else float("inf")
    return rate_plan(len(ds.requests), rate, load.burstiness, load.seed)


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Run one benchmark end to end; prints the summary and returns the result dict."""
    try:
        models = list_models(cfg.target.base_url, cfg.target.api_key)
    except RuntimeError:
        if not cfg.target.model:
            raise
        models = []
    model = cfg.target.model or str(models[0]["id"])
    target = dataclasses.replace(cfg.target, model=model)
    tok_name = resolve_tokenizer_name(cfg.target.tokenizer, model)
    tok = load_tokenizer(tok_name)
    ds = load_dataset(cfg.dataset, tok)
    if not ds.requests:
        raise RuntimeError("the dataset produced no requests")
    plan = arrival_plan(cfg, ds)
    warm = [ds.requests[i % len(ds.requests)] for i in range(cfg.load.warmup_requests)]
    scraper = None
    if cfg.server_metrics.enabled:
        from pd_cluster.bench.server_metrics import discover

        scraper = discover(target.base_url, cfg.server_metrics)
    workers = [ep.url for ep in scraper.endpoints if ep.role != "router"] if scraper else [target.base_url]
    warning = context_warning(ds, context_length(models, model, workers))
    if warning:
        ds.notes.append("WARNING: " + warning)
        print("WARNING: " + warning, file=sys.stderr)
    snaps: dict[str, Any] = {}

    def before_timed() -> None:
        if scraper is not None:
            snaps["before"] = scraper.snapshot()
            scraper.start_polling()

    runner = Runner(target, cfg.load, model, progress=not cfg.report.disable_tqdm)
    out = runner.run_sync(ds.requests, plan, warm, before_timed)
    breakdown = None
    if scraper is not None:
        scraper.stop_polling()
        breakdown = scraper.breakdown(snaps.get("before", {}), scraper.snapshot(), out.duration_s)
    if out.warmup_sent and out.warmup_failed == out.warmup_sent:
        raise RuntimeError(f"all {out.warmup_sent} warm-up requests failed: {out.warmup_errors[:3]}")
    count_output_tokens(out.records, tok)
    summary = summarize(out, cfg.report, max(plan.times, default=0.0) == 0.0)
    windows = goodput_window_spans(cfg, plan)
    if cfg.report.goodput and windows:
        summary["goodput_windows"] = goodput_windows(out.records, cfg.report.goodput, windows)
    if scraper is not None:
        from pd_cluster.bench.server_metrics import mean_accepted_length, prefix_cache_hit_rate

        summary["server_prefix_cache_hit_rate"] = prefix_cache_hit_rate(breakdown)
        summary["server_spec_decode_mean_accepted_length"] = mean_accepted_length(breakdown)
    info = _info(cfg, target, ds, plan, tok_name, out)
    print(format_summary(summary, info, cfg.report.metric_percentiles, cfg.report.percentile_metrics, breakdown))
    result = {"format_version": results.FORMAT_VERSION, "date": datetime.now().isoformat(timespec="seconds"),
              "config": _config_dict(cfg, info), "summary": summary, "server_breakdown": breakdown,
              "requests": [results.record_dict(r, cfg.report.save_detailed) for r in out.records]}
    if cfg.report.save_result:
        _save(cfg, result, out, info)
    return result


def goodput_window_spans(cfg: BenchConfig, plan: ArrivalPlan) -> list[tuple[float, float]] | None:
    """The windows of send time goodput is reported for: ``--goodput-window`` seconds each over the plan's send
    times, else the ``--rate-steps``; None without either."""
    size = cfg.report.goodput_window_s
    if size is None:
        return step_windows(cfg.load.rate_steps) if cfg.load.rate_steps else None
    end = max(plan.times, default=0.0)
    count = max(1, int(end // size) + 1)
    return [(i * size, (i + 1) * size) for i in range(count)]


def _info(cfg: BenchConfig, target, ds: Dataset, plan: ArrivalPlan, tok_name: str, out: RunOutput) -> dict:
    notes = list(ds.notes)
    if out.warmup_sent:
        notes.append(f"warm-up: {out.warmup_sent} requests ({out.warmup_failed} failed), not measured")
    return {"target": target.url, "model": target.model, "tokenizer": tok_name,
            "dataset": f"{ds.name} ({len(ds.requests)} requests)", "arrivals": plan.describe(),
            "max_concurrency": cfg.load.max_concurrency, "scaling": ds.scaling_line(), "notes": notes,
            "start_unix": out.start_unix}


def _config_dict(cfg: BenchConfig, info: dict) -> dict[str, Any]:
    d = results.clean(cfg)
    d["target"]["api_key"] = "***" if cfg.target.api_key else None
    d["server_metrics"]["api_key"] = "***" if cfg.server_metrics.api_key else None
    d["resolved"] = info
    d["metadata"] = dict(cfg.report.metadata)
    return d


def _save(cfg: BenchConfig, result: dict, out: RunOutput, info: dict) -> None:
    rep = cfg.report
    rate = "trace" if info["arrivals"].startswith("trace") else "steps" if cfg.load.rate_steps else (
        "inf" if cfg.load.request_rate is None else f"{cfg.load.request_rate:g}")
    name = rep.result_filename or results.default_filename(
        cfg.dataset.name, rate, cfg.load.max_concurrency, info["model"], datetime.now())
    path = results.save(os.path.join(rep.result_dir, name), result)
    print(f"Saved the result to {path}")
    if rep.plot:
        from pd_cluster.bench.plot import write_plots

        stem = os.path.splitext(path)[0]
        title = f"{info['model']} | {info['dataset']} | {info['arrivals']}"
        for png in write_plots(out.records, out.duration_s, stem, title):
            print(f"Saved a plot to {png}")


def run_failure(summary: dict[str, Any]) -> str | None:
    """Why the run as a whole failed (no request completed), or None. The exit status is then 1."""
    if summary["completed"] > 0:
        return None
    reasons = ", ".join(f"{k}: {v}" for k, v in summary["failure_reasons"].items())
    sent = summary["failed"]
    return (f"every request failed ({sent} of {sent}; {reasons})" if sent
            else "no request was sent (check --duration)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare.main(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        result = run_benchmark(to_config(ns))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"pd-bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pd-bench: interrupted; no result", file=sys.stderr)
        return 130
    failure = run_failure(result["summary"])
    if failure:
        print(f"pd-bench: error: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
