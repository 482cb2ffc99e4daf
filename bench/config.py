"""Typed, frozen configuration of one pd-bench run (built from the command line in ``pd_cluster.bench.args``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class LengthScaling:
    """Fits lengths from a dataset to a small-context model: ``min(cap, max(1, round(n * scale)))``.

    ``None`` caps mean no cap. Every run states its scaling (:meth:`describe`).
    """

    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input_len: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.input_scale <= 0 or self.output_scale <= 0:
            raise ValueError("--input-len-scale and --output-len-scale must be > 0")
        for cap in (self.max_input_len, self.max_output_len):
            if cap is not None and cap < 1:
                raise ValueError("length caps must be >= 1")

    def input_len(self, n: int) -> int:
        return _fit(n, self.input_scale, self.max_input_len)

    def output_len(self, n: int) -> int:
        return _fit(n, self.output_scale, self.max_output_len)

    def block_size(self, n: int) -> int:
        """A prefix block of ``n`` tokens, scaled like the input (caps do not apply)."""
        return max(1, round(n * self.input_scale))

    @property
    def is_identity(self) -> bool:
        return (self.input_scale == 1.0 and self.output_scale == 1.0
                and self.max_input_len is None and self.max_output_len is None)

    def describe(self) -> str:
        def one(scale: float, cap: int | None) -> str:
            return f"x{scale:g} ({'cap ' + str(cap) if cap is not None else 'no cap'})"

        return f"input {one(self.input_scale, self.max_input_len)}, output {one(self.output_scale, self.max_output_len)}"


def _fit(n: int, scale: float, cap: int | None) -> int:
    m = max(1, round(n * scale))
    return min(m, cap) if cap is not None else m


@dataclass(frozen=True)
class TargetConfig:
    """The OpenAI-compatible server under test. ``model`` None: the server's first model."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    tokenizer: str | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {ENDPOINTS}, not {self.endpoint!r}")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout must be > 0")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


@dataclass(frozen=True)
class DatasetConfig:
    """Which prompts to send (``--dataset-name`` and its options)."""

    name: str = "random"
    path: str | None = None
    num_prompts: int | None = None
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    trace_block_size: int = 512
    scaling: LengthScaling = field(default_factory=LengthScaling)

    def __post_init__(self) -> None:
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError("--random-range-ratio must be in [0, 1)")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        if self.trace_block_size < 1:
            raise ValueError("--trace-block-size must be >= 1")


@dataclass(frozen=True)
class LoadConfig:
    """How requests arrive. ``request_rate`` None: trace timestamps for traces, else inf; ``rate_steps``:
    ``(rate req/s, seconds)`` phases one after the other (`bench.arrival.steps_plan`), instead of one rate."""

    request_rate: float | None = None
    rate_steps: tuple[tuple[float, float], ...] = ()
    burstiness: float = 1.0
    trace_speedup: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.request_rate is not None and not (self.request_rate > 0):
            raise ValueError("--request-rate must be > 0 (or inf)")
        if self.rate_steps and self.request_rate is not None:
            raise ValueError("--rate-steps and --request-rate: give one (the steps set each phase's rate)")
        for rate, secs in self.rate_steps:
            if not (0 < rate < math.inf and 0 < secs < math.inf):
                raise ValueError(f"--rate-steps: {rate:g}:{secs:g} needs a finite rate > 0 req/s and seconds > 0")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        if not self.trace_speedup > 0:
            raise ValueError("--trace-speedup must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration must be > 0")

    @property
    def rate_is_inf(self) -> bool:
        return self.request_rate is not None and math.isinf(self.request_rate)


@dataclass(frozen=True)
class ReportConfig:
    """What to compute and where to write it."""

    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    goodput: tuple[tuple[str, float], ...] = ()
    goodput_window_s: float | None = None
    save_result: bool = False
    result_dir: str = "."
    result_filename: str | None = None
    save_detailed: bool = False
    plot: bool = False
    disable_tqdm: bool = False
    metadata: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for p in self.metric_percentiles:
            if not 0 < p <= 100:
                raise ValueError(f"--metric-percentiles: {p} is not in (0, 100]")
        for m in self.percentile_metrics:
            if m not in PERCENTILE_METRICS:
                raise ValueError(f"--percentile-metrics: unknown metric {m!r}")
        for m, v in self.goodput:
            if m not in GOODPUT_METRICS or not v > 0:
                raise ValueError(f"--goodput: bad SLO {m}:{v} (metrics {GOODPUT_METRICS}, ms > 0)")
        if self.goodput_window_s is not None:
            if not 0 < self.goodput_window_s < math.inf:
                raise ValueError(f"--goodput-window must be > 0 seconds, got {self.goodput_window_s:g}")
            if not self.goodput:
                raise ValueError("--goodput-window needs --goodput (the SLOs a request must meet to be good)")


@dataclass(frozen=True)
class ServerMetricsConfig:
    """The server-side breakdown: scrape ``/metrics`` of the router and workers before and after.
    ``api_key`` is sent as a bearer token (the router's admin key guards ``GET /workers``)."""

    enabled: bool = True
    worker_metrics_urls: tuple[str, ...] = ()
    poll_interval_s: float = 0.5
    timeout_s: float = 5.0
    api_key: str | None = None


@dataclass(frozen=True)
class BenchConfig:
    target: TargetConfig
    dataset: DatasetConfig
    load: LoadConfig
    report: ReportConfig
    server_metrics: ServerMetricsConfig
