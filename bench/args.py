"""Command-line flags of ``pd-bench``, named as in ``vllm bench serve`` and ``sglang.bench_serving``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os

from pd_cluster.bench.arrival import steps_count
from pd_cluster.bench.config import (BenchConfig, DatasetConfig, LengthScaling, LoadConfig, ReportConfig,
                          ServerMetricsConfig, TargetConfig)
from pd_cluster.bench.datasets import DATASET_NAMES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-bench", allow_abbrev=False,
        description="Benchmark an OpenAI-compatible server (pd-cluster or any other). "
                    "`pd-bench compare A.json B.json` compares two saved results.")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: --host/--port)")
    t.add_argument("--host", default="127.0.0.1")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    t.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    t.add_argument("--served-model-name", default=None, help="name sent in requests, if not --model")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    t.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id (default: the model's)")
    t.add_argument("--trust-remote-code", action="store_true")
    t.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    t.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/SGLang extension)")
    t.add_argument("--temperature", type=float, default=None)
    t.add_argument("--extra-body", default=None, help="JSON object merged into every request body")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=DATASET_NAMES)
    d.add_argument("--dataset-path", default=None, help="default: the slice shipped in bench/data")
    d.add_argument("--num-prompts", type=int, default=None,
                   help="default: 1000 for random, the whole file for file datasets")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--input-len", type=int, default=None,
                   help="as in `vllm bench throughput`: --random-input-len (random dataset only)")
    d.add_argument("--output-len", type=int, default=None,
                   help="as in `vllm bench throughput`: --random-output-len for random, "
                        "--sharegpt-output-len for sharegpt")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--gsp-num-groups", type=int, default=64)
    d.add_argument("--gsp-prompts-per-group", type=int, default=16)
    d.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    d.add_argument("--gsp-question-len", type=int, default=128)
    d.add_argument("--gsp-output-len", type=int, default=256)
    d.add_argument("--trace-block-size", type=int, default=512, help="tokens per Mooncake hash id")
    d.add_argument("--input-len-scale", type=float, default=1.0)
    d.add_argument("--output-len-scale", type=float, default=1.0)
    d.add_argument("--max-input-len", type=int, default=None, help="cap on input lengths after scaling")
    d.add_argument("--max-output-len", type=int, default=None, help="cap on output lengths after scaling")

    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=None,
                   help="req/s, or inf (default: trace timestamps for traces, else inf)")
    a.add_argument("--rate-steps", nargs="+", default=None, metavar="RATE:SECS",
                   help="a load that changes: RATE req/s for SECS seconds, then the next step (e.g. 4:60 16:60 "
                        "8:60); round(RATE*SECS) requests each, with --burstiness; sets --num-prompts")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--trace-speedup", type=float, default=1.0, help="divide trace inter-arrivals by this")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    a.add_argument("--warmup-requests", type=int, default=0)
    a.add_argument("--seed", type=int, default=0)

    r = p.add_argument_group("metrics and output")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    r.add_argument("--metric-percentiles", default="50,90,99")
    r.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:3000")
    r.add_argument("--goodput-window", type=float, default=None, metavar="SECS",
                   help="also report goodput per window of SECS seconds of send time (with --rate-steps and "
                        "--goodput, per step by default)")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--result-dir", default=".")
    r.add_argument("--result-filename", default=None)
    r.add_argument("--save-detailed", action="store_true", help="also save generated texts")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    r.add_argument("--plot", action="store_true", help="write PNGs next to the result file")
    r.add_argument("--disable-tqdm", action="store_true")

    s = p.add_argument_group("server-side breakdown (pd-cluster)")
    s.add_argument("--worker-metrics-url", nargs="+", default=[], metavar="URL",
                   help="workers to scrape (default: the router's GET /workers)")
    s.add_argument("--admin-api-key", default=os.environ.get("PD_ADMIN_API_KEY"),
                   help="bearer token for the router's GET /workers and for /metrics "
                        "(default: $PD_ADMIN_API_KEY, else --api-key)")
    s.add_argument("--no-server-metrics", action="store_true")
    s.add_argument("--metrics-poll-interval", type=float, default=0.5, help="seconds between load polls")
    return p


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def parse_goodput(items: list[str] | None) -> tuple[tuple[str, float], ...]:
    """``["ttft:500", "tpot:50"]`` -> ``(("ttft", 500.0), ("tpot", 50.0))``. Raises ``ValueError``."""
    out = []
    for item in items or []:
        name, sep, value = item.partition(":")
        try:
            out.append((name.strip().lower(), float(value)))
        except ValueError:
            raise ValueError(f"--goodput: expected METRIC:MS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--goodput: expected METRIC:MS, got {item!r}")
    return tuple(out)


def parse_rate_steps(items: list[str] | None) -> tuple[tuple[float, float], ...]:
    """``["4:60", "16:30"]`` -> ``((4.0, 60.0), (16.0, 30.0))`` (req/s, seconds). Raises ``ValueError``."""
    out = []
    for item in items or []:
        rate, sep, secs = item.partition(":")
        try:
            out.append((float(rate), float(secs)))
        except ValueError:
            raise ValueError(f"--rate-steps: expected RATE:SECS, got {item!r}") from None
        if not sep:
            raise ValueError(f"--rate-steps: expected RATE:SECS, got {item!r}")
        if not (0 < out[-1][0] < math.inf and 0 < out[-1][1] < math.inf):
            raise ValueError(f"--rate-steps: {item} needs a finite rate > 0 req/s and seconds > 0")
    return tuple(out)


def steps_num_prompts(ns: argparse.Namespace, steps: tuple[tuple[float, float], ...]) -> int | None:
    """The number of prompts: the steps' requests with ``--rate-steps`` (which ``--num-prompts`` may repeat but
    not contradict), else ``--num-prompts``. Raises ``ValueError``."""
    if not steps:
        return ns.num_prompts
    n = steps_count(steps)
    if ns.num_prompts is not None and ns.num_prompts != n:
        raise ValueError(f"--num-prompts {ns.num_prompts} conflicts with --rate-steps, which sends {n} requests "
                         f"(round(RATE*SECS) per step); leave --num-prompts out")
    return n


def resolve_generic_lengths(ns: argparse.Namespace) -> None:
    """Apply ``--input-len`` / ``--output-len`` with the meaning of ``vllm bench throughput``.

    ``vllm bench serve`` and ``sglang.bench_serving`` name the random dataset's lengths
    ``--random-input-len`` / ``--random-output-len``; ``vllm bench throughput`` and
    ``vllm bench latency`` call them ``--input-len`` / ``--output-len``, and there
    ``--output-len`` also fixes ShareGPT's output length. pd-bench accepts both spellings
    with that meaning and refuses them where it has none (the trace and shared-prefix
    datasets, whose lengths come from the data or the ``--gsp-*`` flags).

    Raises:
        ValueError: a generic flag given for a dataset where it has no meaning, a
            non-positive length, or a conflicting specific flag.
    """
    for flag, value in (("--input-len", ns.input_len), ("--output-len", ns.output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    targets = {"random": {"input_len": "random_input_len", "output_len": "random_output_len"},
               "sharegpt": {"output_len": "sharegpt_output_len"}}.get(ns.dataset_name, {})
    for generic in ("input_len", "output_len"):
        value = getattr(ns, generic)
        if value is None:
            continue
        flag = "--" + generic.replace("_", "-")
        if generic not in targets:
            raise ValueError(f"{flag} has no meaning for --dataset-name {ns.dataset_name} (it is vLLM's "
                             f"generic length flag: --random-{flag[2:]} for random"
                             + (", --sharegpt-output-len for sharegpt" if generic == "output_len" else "")
                             + "); to fit trace lengths use --input-len-scale/--output-len-scale and "
                               "--max-input-len/--max-output-len")
        specific = targets[generic]
        default = build_parser().get_default(specific)
        given = getattr(ns, specific)
        if given != default and given != value:
            raise ValueError(f"{flag} {value} conflicts with --{specific.replace('_', '-')} {given}")
        setattr(ns, specific, value)


def to_config(ns: argparse.Namespace) -> BenchConfig:
    """Validated configuration from parsed flags. Raises ``ValueError`` on bad values."""
    resolve_generic_lengths(ns)
    extra = json.loads(ns.extra_body) if ns.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if ns.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'pd-cluster[plot]'")
    meta = []
    for kv in ns.metadata:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"--metadata: expected KEY=VALUE, got {kv!r}")
        meta.append((k, v))
    target = TargetConfig(
        base_url=ns.base_url or f"http://{ns.host}:{ns.port}", endpoint=ns.endpoint,
        model=ns.served_model_name or ns.model, api_key=ns.api_key, tokenizer=ns.tokenizer or ns.model,
        request_timeout_s=ns.request_timeout, ignore_eos=ns.ignore_eos, temperature=ns.temperature,
        extra_body=extra)
    scaling = LengthScaling(ns.input_len_scale, ns.output_len_scale, ns.max_input_len, ns.max_output_len)
    steps = parse_rate_steps(ns.rate_steps)
    dataset = DatasetConfig(
        name=ns.dataset_name, path=ns.dataset_path, num_prompts=steps_num_prompts(ns, steps), seed=ns.seed,
        random_input_len=ns.random_input_len, random_output_len=ns.random_output_len,
        random_range_ratio=ns.random_range_ratio, random_prefix_len=ns.random_prefix_len,
        sharegpt_output_len=ns.sharegpt_output_len, gsp_num_groups=ns.gsp_num_groups,
        gsp_prompts_per_group=ns.gsp_prompts_per_group, gsp_system_prompt_len=ns.gsp_system_prompt_len,
        gsp_question_len=ns.gsp_question_len, gsp_output_len=ns.gsp_output_len,
        trace_block_size=ns.trace_block_size, scaling=scaling)
    load = LoadConfig(request_rate=ns.request_rate, rate_steps=steps, burstiness=ns.burstiness,
                      trace_speedup=ns.trace_speedup, max_concurrency=ns.max_concurrency, duration_s=ns.duration,
                      warmup_requests=ns.warmup_requests, seed=ns.seed)
    report = ReportConfig(
        metric_percentiles=_floats(ns.metric_percentiles, "--metric-percentiles"),
        percentile_metrics=tuple(m.strip() for m in ns.percentile_metrics.split(",") if m.strip()),
        goodput=parse_goodput(ns.goodput), goodput_window_s=ns.goodput_window,
        save_result=ns.save_result or ns.plot, result_dir=ns.result_dir, result_filename=ns.result_filename,
        save_detailed=ns.save_detailed, plot=ns.plot, disable_tqdm=ns.disable_tqdm, metadata=tuple(meta))
    server = ServerMetricsConfig(enabled=not ns.no_server_metrics,
                                 worker_metrics_urls=tuple(ns.worker_metrics_url),
                                 poll_interval_s=ns.metrics_poll_interval,
                                 api_key=ns.admin_api_key or ns.api_key)
    return BenchConfig(target, dataset, load, report, server)
