"""The planner's decision core: one snapshot of the cluster's metrics in, a worker count per role out.

Pure: no I/O and no clock of its own (the snapshot carries its time), so it runs the same in ``pd-serve
--autoscale``, in a ``pd-planner`` process and in tests. A runner fills a `Snapshot` every
``--planner-interval-secs`` from the router's and the workers' metrics, calls `Planner.decide`, and hands the
target to a connector (start or drain workers, or switch a worker's role: ``POST /workers/{id}/role``).

What it reads, per role (the anchors' gaps it closes, from issue reports of Dynamo and llm-d):

* **prefill** is under pressure when its **prompt backlog** (tokens queued or computing on the prefill workers,
  over their measured throughput) or, unless decode is the bottleneck, the **TTFT p90** or the **queue-time
  p90** is above ``--planner-scale-up-ratio`` x ``--ttft-slo-ms``. Queue time is read, not only TTFT: TTFT
  percentiles come from requests that got their first token, and lag a burst (Dynamo's planner read only TTFT
  and averaged ~160 s against a 3 s target, dynamo#10528).
* **decode** is under pressure when the **ITL p90** is above the ratio x ``--itl-slo-ms``, its **KV usage** or
  its **running requests** (of their capacity) are above ``--planner-kv-usage-high``, or the **outstanding KV
  transfers** per decode worker are above ``--planner-transfers-per-decode-high``. Decode being the bottleneck
  stops TTFT from being blamed on prefill (llm-d scaled prefill up when decode was short,
  llm-d-autoscaling#1325).
* A role shrinks only when every one of its signals is below ``--planner-scale-down-ratio`` x its target (KV
  usage and running ratio below ``--planner-kv-usage-low``): between the two thresholds nothing moves
  (hysteresis), so a steady load makes no decision after the first (Dynamo oscillated 2 <-> 1, PR #9294).

Rules: a pressure or calm must hold ``--planner-stable-intervals`` snapshots in a row before it acts, and a calm
must also have held for ``--planner-scale-down-window-secs`` (Kubernetes' HPA ``stabilizationWindowSeconds`` for
scale-down, default 300 s there and here) with one worker fewer carrying the peak load of that window: a bursty
trace's gaps of a few seconds are not calm, and a burst of the last minutes counts against a drain. One step
(one worker) per role per decision; after a role changed, ``--planner-cooldown-secs`` pass before it changes
again. Each role decides on its own: a role whose last change is still being carried out (`Snapshot.pending`)
holds, the other does not (Dynamo never scaled decode down while a prefill scale-up waited for a GPU,
dynamo#14251). Bounds: ``--min-*``/``--max-*`` per role (a count outside them is brought inside at once) and
``--max-workers`` for both: at the cap, a role under pressure takes a worker from the other role when that role
is calm and out of its cool-down (a role switch). A snapshot with a metrics source missing freezes every
decision (`Decision.action` ``frozen``): an outage never scales down to the minimums.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pd_cluster.planner.config import PlannerConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleCounts:
    """Workers per role."""

    prefill: int
    decode: int

    def get(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def with_(self, role: str, n: int) -> "RoleCounts":
        return RoleCounts(n, self.decode) if role == "prefill" else RoleCounts(self.prefill, n)

    @property
    def total(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class Snapshot:
    """One look at the cluster. A signal is None when there was nothing to measure (no request finished in the
    window: no TTFT sample); a source that did not answer is named in `missing` instead.

    Attributes:
        at: when it was taken (seconds, monotonic).
        current: workers serving each role now.
        ttft_p90_ms, itl_p90_ms: the router's TTFT and ITL p90 over the last window (milliseconds).
        queue_time_p90_ms: p90 of the time requests waited before their prefill started, counting the age of
            those still waiting (milliseconds).
        prefill_backlog_tokens: prompt tokens queued or computing on the prefill workers.
        prefill_tokens_per_s: one prefill worker's recent prompt throughput (tokens/s).
        decode_kv_usage: the decode workers' mean KV usage (0..1).
        decode_running, decode_capacity: requests running on the decode workers, and the most they may run
            (their ``max_running_requests`` summed).
        outstanding_transfers: KV transfers whose prompt is computed and whose pages have not reached decode
            (`planner.scrape.owed_transfers`: requests still queued or computing on a prefill worker are
            prefill's backlog, not counted here).
        prefill_waiting: requests queued or computing on the prefill workers. With some waiting and no TTFT,
            queue-time or backlog sample in the window (nothing reached its first token), prefill is not calm: a
            prefill so far behind that nothing finishes is starved, not idle.
        router_queued: requests waiting in the router for a slot or a worker (``pd_router_queue_depth``); with any,
            neither role is calm (the cluster is saturated; a scale-down would deepen the queue).
        pending: the counts a connector is still bringing the cluster to (None: nothing under way).
        missing: metric sources that did not answer (any: the decision is frozen).
    """

    at: float
    current: RoleCounts
    ttft_p90_ms: float | None = None
    itl_p90_ms: float | None = None
    queue_time_p90_ms: float | None = None
    prefill_backlog_tokens: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_kv_usage: float | None = None
    decode_running: int | None = None
    decode_capacity: int | None = None
    outstanding_transfers: int | None = None
    prefill_waiting: int | None = None
    router_queued: int | None = None
    pending: RoleCounts | None = None
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What the planner wants: `target` counts, why, and `action`: ``hold`` (target == current), ``scale``, or
    ``frozen`` (a metrics source was missing; target == current)."""

    at: float
    current: RoleCounts
    target: RoleCounts
    action: str
    reasons: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.target != self.current


LOAD_MEMORY_MARGIN = 0.8
"""A role shrinks only when one worker fewer would each carry under this share of the per-worker load at which
pressure last grew it (`Planner._fits_one_fewer`)."""


@dataclass
class _RoleState:
    up_streak: int = 0
    calm_streak: int = 0
    changed_at: float = -math.inf
    grown_at: float | None = None  # the role's load per worker when pressure last grew it (`Planner._load`)
    calm_since: float | None = None  # when the current run of calm snapshots began
    loads: deque = field(default_factory=deque)  # (at, load) of the scale-down window's snapshots


@dataclass(frozen=True)
class _Pressure:
    up: tuple[str, ...]     # the signals above their scale-up thresholds
    calm: bool              # every signal below its scale-down threshold
    peak: float             # the largest signal / threshold ratio (which role wins at the cap)


@dataclass
class Planner:
    """Decides a count per role from each `Snapshot` (hysteresis and cool-down state kept between calls).

    A restarted planner starts with no streak and no cool-down: it resumes from the counts the snapshot reports,
    and acts once a pressure has held ``stable_intervals`` snapshots.
    """

    config: PlannerConfig
    _roles: dict[str, _RoleState] = field(default_factory=lambda: {r: _RoleState() for r in ROLES})

    def decide(self, snap: Snapshot) -> Decision:
        cfg, cur = self.config, snap.current
        if snap.missing:
            for st in self._roles.values():  # a gap breaks every streak: pressure must be seen again
                st.up_streak = st.calm_streak = 0
                st.calm_since = None
            return Decision(snap.at, cur, cur, "frozen", (f"metrics missing from {', '.join(snap.missing)}: "
                                                          f"no change",))
        pressure = {"decode": self._decode(snap)}
        pressure["prefill"] = self._prefill(snap, decode_bottleneck=bool(pressure["decode"].up))
        reasons: list[str] = []
        target = cur
        for role in ROLES:
            st, p = self._roles[role], pressure[role]
            st.up_streak = st.up_streak + 1 if p.up else 0
            st.calm_streak = st.calm_streak + 1 if p.calm and not p.up else 0
            st.calm_since = (st.calm_since if st.calm_since is not None else snap.at) if st.calm_streak else None
            self._remember_load(snap, role, st)
            lo, hi = self._bounds(role)
            n = cur.get(role)
            if not lo <= n <= hi:
                target = target.with_(role, min(max(n, lo), hi))
                reasons.append(f"{role}: {n} is outside [{lo}, {hi}] (--min-{role}, --max-{role})")
                continue
            if snap.pending is not None and snap.pending.get(role) != n:
                reasons.append(f"{role}: holding until the last change ({n} -> {snap.pending.get(role)}) is done")
                continue
            if snap.at - st.changed_at < cfg.cooldown_secs:
                continue
            if st.up_streak >= cfg.stable_intervals and n < hi:
                target = target.with_(role, n + 1)
                reasons.append(f"{role} +1: {'; '.join(p.up)}")
            elif (st.calm_streak >= cfg.stable_intervals and snap.at - st.calm_since >= cfg.scale_down_window_secs
                  and n > lo and self._fits_one_fewer(snap, role, st)):
                target = target.with_(role, n - 1)
                reasons.append(f"{role} -1: every signal below {cfg.scale_down_ratio:g} x its target for "
                               f"{snap.at - st.calm_since:.0f} s")
        target = self._cap(snap, cur, target, pressure, reasons)
        for role in ROLES:
            if target.get(role) != cur.get(role):
                st = self._roles[role]
                st.changed_at, st.up_streak, st.calm_streak, st.calm_since = snap.at, 0, 0, None
                if target.get(role) > cur.get(role) and pressure[role].up:
                    load = self._load(snap, role)
                    st.grown_at = None if load is None else load / max(cur.get(role), 1)
        return Decision(snap.at, cur, target, "scale" if target != cur else "hold", tuple(reasons))

    # ---- signals ------------------------------------------------------------------------------------------------
    def _prefill(self, s: Snapshot, decode_bottleneck: bool) -> _Pressure:
        cfg = self.config
        ratios: dict[str, float] = {}
        if s.prefill_backlog_tokens and s.prefill_tokens_per_s and s.current.prefill > 0:
            backlog_ms = 1000.0 * s.prefill_backlog_tokens / (s.prefill_tokens_per_s * s.current.prefill)
            ratios[f"prompt backlog {backlog_ms:.0f} ms of prefill"] = backlog_ms / cfg.ttft_slo_ms
        blamed = {}
        if s.ttft_p90_ms is not None:
            blamed[f"TTFT p90 {s.ttft_p90_ms:.0f} ms"] = s.ttft_p90_ms / cfg.ttft_slo_ms
        if s.queue_time_p90_ms is not None:
            blamed[f"queue time p90 {s.queue_time_p90_ms:.0f} ms"] = s.queue_time_p90_ms / cfg.ttft_slo_ms
        up = [f"{k} > {cfg.scale_up_ratio:g} x --ttft-slo-ms {cfg.ttft_slo_ms:g}" for k, v in ratios.items()
              if v > cfg.scale_up_ratio]
        if not decode_bottleneck:  # with decode short of room, a late first token is decode's to fix
            up += [f"{k} > {cfg.scale_up_ratio:g} x --ttft-slo-ms {cfg.ttft_slo_ms:g}" for k, v in blamed.items()
                   if v > cfg.scale_up_ratio]
        every = list(ratios.values()) + list(blamed.values())
        calm = all(v < cfg.scale_down_ratio for v in every) and not s.router_queued
        if not every and s.prefill_waiting:
            calm = False  # requests waiting and none reached its first token in the window: starved, not idle
        return _Pressure(tuple(up), calm, max(every, default=0.0))

    def _decode(self, s: Snapshot) -> _Pressure:
        cfg = self.config
        up: list[str] = []
        calm = True
        peak = 0.0
        if s.itl_p90_ms is not None:
            r = s.itl_p90_ms / cfg.itl_slo_ms
            peak = max(peak, r / cfg.scale_up_ratio)
            calm &= r < cfg.scale_down_ratio
            if r > cfg.scale_up_ratio:
                up.append(f"ITL p90 {s.itl_p90_ms:.0f} ms > {cfg.scale_up_ratio:g} x --itl-slo-ms {cfg.itl_slo_ms:g}")
        usage = {}
        if s.decode_kv_usage is not None:
            usage["KV usage"] = s.decode_kv_usage
        if s.decode_running is not None and s.decode_capacity:
            usage["running requests of capacity"] = s.decode_running / s.decode_capacity
        for name, u in usage.items():
            peak = max(peak, u / cfg.kv_usage_high)
            calm &= u < cfg.kv_usage_low
            if u > cfg.kv_usage_high:
                up.append(f"decode {name} {u:.2f} > --planner-kv-usage-high {cfg.kv_usage_high:g}")
        if s.outstanding_transfers is not None and s.current.decode > 0:
            per = s.outstanding_transfers / s.current.decode
            peak = max(peak, per / cfg.transfers_per_decode_high)
            calm &= per < cfg.scale_down_ratio * cfg.transfers_per_decode_high
            if per > cfg.transfers_per_decode_high:
                up.append(f"{per:.1f} outstanding KV transfers per decode worker > "
                          f"--planner-transfers-per-decode-high {cfg.transfers_per_decode_high:g}")
        return _Pressure(tuple(up), calm and not s.router_queued, peak)

    # ---- load memory --------------------------------------------------------------------------------------------
    @staticmethod
    def _load(s: Snapshot, role: str) -> float | None:
        """The load a role serves now: prompt tokens/s over the prefill workers, requests running on the decode
        workers; None when not measured."""
        if role == "prefill":
            return None if s.prefill_tokens_per_s is None else s.prefill_tokens_per_s * s.current.prefill
        return None if s.decode_running is None else float(s.decode_running)

    def _remember_load(self, s: Snapshot, role: str, st: _RoleState) -> None:
        """Keep the role's loads of the last ``--planner-scale-down-window-secs`` (and the snapshot now)."""
        load = self._load(s, role)
        if load is not None:
            st.loads.append((s.at, load))
        while st.loads and st.loads[0][0] < s.at - self.config.scale_down_window_secs:
            st.loads.popleft()

    def _fits_one_fewer(self, s: Snapshot, role: str, st: _RoleState) -> bool:
        """Whether one worker fewer would carry the peak load of the scale-down window below the per-worker load
        that last grew the role (times `LOAD_MEMORY_MARGIN`). Signals that are not per worker (TTFT, ITL) fall far
        below their targets once a worker is added, so calm alone would drain the worker the load needs, and the
        load would grow the role again: the oscillation of a steady load (Dynamo's 2 <-> 1, PR #9294)."""
        n = s.current.get(role)
        if st.grown_at is None or not st.loads or n <= 1:
            return True
        peak = max(load for _, load in st.loads)
        return peak / (n - 1) < LOAD_MEMORY_MARGIN * st.grown_at

    # ---- bounds -------------------------------------------------------------------------------------------------
    def _bounds(self, role: str) -> tuple[int, int]:
        cfg = self.config
        return (cfg.min_prefill, cfg.max_prefill) if role == "prefill" else (cfg.min_decode, cfg.max_decode)

    def _cap(self, snap: Snapshot, cur: RoleCounts, target: RoleCounts, pressure: dict[str, _Pressure],
             reasons: list[str]) -> RoleCounts:
        """Keep `target` within ``--max-workers``. A role brought up to its minimum comes first: the other role
        gives what that needs (down to its own minimum; the minimums fit under the cap). A role that grows by
        pressure takes a worker from the other role when that one is calm, out of its cool-down, not changing
        and above its minimum (a role switch); else the growth is dropped. A switch is driven by the growing
        role's pressure: the giving role's scale-down window and load memory do not hold it. Workers a role
        still being changed (`Snapshot.pending`) brings up count against the cap, and that role gives none."""
        cap = self.config.max_workers
        changing, held = _coming(snap.pending, cur, target)
        if not cap or target.total + held <= max(cap, cur.total + held):
            return target
        forced = {r: cur.get(r) < self._bounds(r)[0] for r in ROLES}
        grown = sorted((r for r in ROLES if target.get(r) > cur.get(r)),
                       key=lambda r: (not forced[r], -pressure[r].peak))
        for role in grown:
            if target.total + held <= cap:
                break
            other = "decode" if role == "prefill" else "prefill"
            lo = self._bounds(other)[0]
            if forced[role]:
                give = min(target.total + held - cap, target.get(other) - lo)
                if give > 0:
                    target = target.with_(other, target.get(other) - give)
                    reasons.append(f"{other} -{give} (to {role}, below --min-{role}): at --max-workers {cap}")
                continue
            calm = (pressure[other].calm and not pressure[other].up
                    and snap.at - self._roles[other].changed_at >= self.config.cooldown_secs)
            if calm and not changing[other] and target.get(other) == cur.get(other) and target.get(other) > lo:
                target = target.with_(other, target.get(other) - 1)
                reasons.append(f"{other} -1 (to {role}, a role switch): at --max-workers {cap} and {other} is calm")
            else:
                target = target.with_(role, cur.get(role))
                reasons.append(f"{role}: no room at --max-workers {cap} ({other} is not calm enough to give a worker)")
        return target


def _coming(pending: RoleCounts | None, cur: RoleCounts, target: RoleCounts) -> tuple[dict[str, bool], int]:
    """Which roles a connector is still changing, and the workers the held ones among them are still bringing up
    (they serve soon, so they count against ``--max-workers``)."""
    if pending is None:
        return dict.fromkeys(ROLES, False), 0
    changing = {r: pending.get(r) != cur.get(r) for r in ROLES}
    held = sum(max(0, pending.get(r) - cur.get(r)) for r in ROLES if changing[r] and target.get(r) == cur.get(r))
    return changing, held
