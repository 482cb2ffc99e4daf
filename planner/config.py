"""The planner's configuration: SLO targets, per-role bounds, hysteresis and cool-down, and their flags.

Flag names are the ones `pd-serve --autoscale` and `pd-planner` take (``--ttft-slo-ms``, ``--itl-slo-ms``,
``--min-prefill``, ``--max-prefill``, ``--min-decode``, ``--max-decode``, ``--max-workers``; the planner's own
knobs start with ``--planner-``). Dynamo's SLA planner (``--ttft``, ``--itl``, ``--adjustment-interval``,
``--min-endpoint``, ``--max-gpu-budget``) is the anchor. A bad value is refused with an error that names the
flag (`PlannerConfig` raises `ValueError`; `planner_config_from_args` turns it into argparse's one-line error).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pd_cluster.common.flags import Flag, add_flags, flag_values


@dataclass(frozen=True)
class PlannerConfig:
    """Everything the decision core (`pd_cluster.planner.decision.Planner`) needs.

    Attributes:
        ttft_slo_ms: time-to-first-token target (milliseconds, > 0), against the TTFT p90.
        itl_slo_ms: inter-token-latency target (milliseconds, > 0), against the ITL p90.
        min_prefill, max_prefill, min_decode, max_decode: each role's bounds (workers; minimums >= 1: a PD
            cluster needs one of each).
        max_workers: the most workers of both roles together (0: no cap beyond the per-role maximums). At the cap
            a role under pressure takes a worker from the other role when that one is calm (a role switch).
        interval_secs: seconds between two snapshots (the runner's pace; > 0).
        scale_up_ratio: a signal above ``ratio x target`` is pressure (> `scale_down_ratio`).
        scale_down_ratio: a role may shrink only while every signal is below ``ratio x target`` (> 0, at most
            half `scale_up_ratio`): the band between the two ratios is the hysteresis, where nothing changes; a
            per-worker signal (backlog, transfers per worker) moves by at most 2x when one worker comes or goes, so
            a band of 2x is never crossed by the planner's own step.
        stable_intervals: consecutive snapshots a pressure (or calm) must last before it acts (>= 1).
        cooldown_secs: after a role changed size, seconds before it changes again (>= 0).
        scale_down_window_secs: a role shrinks only after every snapshot of this many seconds was calm, and only
            if one worker fewer carries the window's peak load (>= 0; Kubernetes HPA's scale-down
            ``stabilizationWindowSeconds``, whose default is also 300 s).
        kv_usage_high, kv_usage_low: decode KV usage (0..1) above which decode is under pressure, and below which
            it may shrink (``0 <= low < high <= 1``).
        transfers_per_decode_high: outstanding KV transfers per decode worker above which decode is the
            bottleneck (the pushes wait on decode; prefill is not scaled for it, llm-d-autoscaling#1325).
    """

    ttft_slo_ms: float = 3000.0
    itl_slo_ms: float = 100.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_workers: int = 0
    interval_secs: float = 10.0
    scale_up_ratio: float = 1.0
    scale_down_ratio: float = 0.5
    stable_intervals: int = 2
    cooldown_secs: float = 60.0
    scale_down_window_secs: float = 300.0
    kv_usage_high: float = 0.85
    kv_usage_low: float = 0.4
    transfers_per_decode_high: float = 8.0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{FLAG_OF[field]} {why}")

        for name in ("ttft_slo_ms", "itl_slo_ms", "interval_secs", "scale_up_ratio", "scale_down_ratio",
                     "transfers_per_decode_high"):
            value = getattr(self, name)
            if not value > 0 or value != value or value == float("inf"):
                raise bad(name, f"must be a positive number, got {value}")
        for name in ("min_prefill", "min_decode"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1 (a PD cluster needs a worker of each role), got {getattr(self, name)}")
        for lo, hi in (("min_prefill", "max_prefill"), ("min_decode", "max_decode")):
            if getattr(self, lo) > getattr(self, hi):
                raise bad(lo, f"({getattr(self, lo)}) is above {FLAG_OF[hi]} ({getattr(self, hi)})")
        if self.max_workers < 0:
            raise bad("max_workers", f"must be >= 0 (0: no cap), got {self.max_workers}")
        if self.max_workers and self.max_workers < self.min_prefill + self.min_decode:
            raise bad("max_workers", f"({self.max_workers}) is below --min-prefill + --min-decode "
                      f"({self.min_prefill + self.min_decode})")
        if self.scale_down_ratio > self.scale_up_ratio / 2:
            raise bad("scale_down_ratio", f"({self.scale_down_ratio}) must be at most half --planner-scale-up-ratio "
                      f"({self.scale_up_ratio}): the band between them is the hysteresis, and a per-worker signal "
                      f"that one more or one fewer worker scales by up to 2x must not cross it")
        if self.stable_intervals < 1:
            raise bad("stable_intervals", f"must be >= 1, got {self.stable_intervals}")
        for name in ("cooldown_secs", "scale_down_window_secs"):
            if not getattr(self, name) >= 0 or getattr(self, name) == float("inf"):
                raise bad(name, f"must be finite and >= 0, got {getattr(self, name)}")
        if not 0 <= self.kv_usage_low < self.kv_usage_high <= 1:
            raise bad("kv_usage_low", f"({self.kv_usage_low}) and --planner-kv-usage-high ({self.kv_usage_high}) "
                      f"must satisfy 0 <= low < high <= 1")


PLANNER_FLAGS: tuple[Flag, ...] = (
    Flag("--ttft-slo-ms", "ttft_slo_ms", float, "TTFT target (ms), against the p90."),
    Flag("--itl-slo-ms", "itl_slo_ms", float, "Inter-token latency target (ms), against the p90."),
    Flag("--min-prefill", "min_prefill", int, "Fewest prefill workers (>= 1)."),
    Flag("--max-prefill", "max_prefill", int, "Most prefill workers."),
    Flag("--min-decode", "min_decode", int, "Fewest decode workers (>= 1)."),
    Flag("--max-decode", "max_decode", int, "Most decode workers."),
    Flag("--max-workers", "max_workers", int, "Most workers of both roles together (0: no cap); at the cap a role "
         "under pressure takes a worker of the calm other role."),
    Flag("--planner-interval-secs", "interval_secs", float, "Seconds between two decisions."),
    Flag("--planner-scale-up-ratio", "scale_up_ratio", float, "A signal above this x its target is pressure."),
    Flag("--planner-scale-down-ratio", "scale_down_ratio", float, "A role shrinks only while every signal is "
         "below this x its target."),
    Flag("--planner-stable-intervals", "stable_intervals", int, "Consecutive decisions a pressure or calm must "
         "last before it acts."),
    Flag("--planner-cooldown-secs", "cooldown_secs", float, "Seconds after a role changed size before it may "
         "change again."),
    Flag("--planner-scale-down-window-secs", "scale_down_window_secs", float, "Seconds a role must have been calm, "
         "with one worker fewer carrying their peak load, before it shrinks (Kubernetes HPA's scale-down "
         "stabilization window)."),
    Flag("--planner-kv-usage-high", "kv_usage_high", float, "Decode KV usage (0..1) that is pressure."),
    Flag("--planner-kv-usage-low", "kv_usage_low", float, "Decode KV usage (0..1) under which decode may shrink."),
    Flag("--planner-transfers-per-decode-high", "transfers_per_decode_high", float,
         "Outstanding KV transfers per decode worker that make decode the bottleneck."),
)

FLAG_OF = {f.field: f.name for f in PLANNER_FLAGS}
assert set(FLAG_OF) == {f.name for f in fields(PlannerConfig)}


def add_planner_args(parser: argparse.ArgumentParser) -> None:
    """The planner's flags on `parser`, with `PlannerConfig`'s defaults."""
    add_flags(parser.add_argument_group("planner"), PLANNER_FLAGS, PlannerConfig())


def planner_config_from_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> PlannerConfig:
    """The `PlannerConfig` of parsed flags; a bad value stops `parser` with a message that names its flag."""
    try:
        return PlannerConfig(**flag_values(ns, PLANNER_FLAGS))
    except ValueError as e:
        parser.error(str(e))
        raise  # not reached: parser.error exits
