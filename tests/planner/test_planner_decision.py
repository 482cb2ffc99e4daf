"""The planner's decision core (`pd_cluster.planner.decision.Planner`), no processes: bounds, the worker cap, hysteresis,
cool-down and steadiness as properties over generated snapshot sequences (hypothesis), the signals each role
reads (queue time and backlog for prefill; decode blamed, not prefill, when decode is short of room), a metrics
outage freezing decisions, and flag validation that names the flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_cluster.planner.config import PLANNER_FLAGS, PlannerConfig, add_planner_args, planner_config_from_args
from pd_cluster.planner.decision import Planner, RoleCounts, Snapshot

CFG = PlannerConfig(ttft_slo_ms=1000, itl_slo_ms=50, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                    max_workers=4, interval_secs=10, stable_intervals=2, cooldown_secs=60, scale_down_window_secs=0)

maybe = lambda s: st.none() | s  # noqa: E731

signals = st.fixed_dictionaries({
    "ttft_p90_ms": maybe(st.floats(0, 20_000)), "itl_p90_ms": maybe(st.floats(0, 500)),
    "queue_time_p90_ms": maybe(st.floats(0, 20_000)), "prefill_backlog_tokens": maybe(st.integers(0, 200_000)),
    "prefill_tokens_per_s": maybe(st.floats(1, 50_000)), "decode_kv_usage": maybe(st.floats(0, 1)),
    "decode_running": maybe(st.integers(0, 512)), "decode_capacity": maybe(st.integers(1, 512)),
    "outstanding_transfers": maybe(st.integers(0, 200)), "prefill_waiting": maybe(st.integers(0, 64)),
    "router_queued": maybe(st.integers(0, 64)),
    "missing": st.sampled_from([(), (), (), ("router",)])})

configs = st.builds(
    lambda mp, xp, md, xd, cap, stable, cool, up, down, window: PlannerConfig(
        ttft_slo_ms=1000, itl_slo_ms=50, min_prefill=mp, max_prefill=mp + xp, min_decode=md, max_decode=md + xd,
        max_workers=0 if cap is None else mp + md + cap, stable_intervals=stable, cooldown_secs=cool,
        scale_up_ratio=up, scale_down_ratio=up * down, scale_down_window_secs=window),
    st.integers(1, 3), st.integers(0, 3), st.integers(1, 3), st.integers(0, 3), maybe(st.integers(0, 3)),
    st.integers(1, 3), st.sampled_from([0.0, 15.0, 60.0]), st.floats(0.8, 1.5), st.floats(0.05, 0.5),
    st.sampled_from([0.0, 0.0, 30.0, 120.0]))


def _run(cfg: PlannerConfig, start: RoleCounts, seq: list[dict], every: float = 10.0):
    """Feed `seq` at `every` seconds, applying each target at once (an ideal connector); the decisions."""
    planner, cur, out = Planner(cfg), start, []
    for i, sig in enumerate(seq):
        d = planner.decide(Snapshot(at=i * every, current=cur, **sig))
        out.append(d)
        cur = d.target
    return out


@settings(max_examples=150, deadline=None)
@given(configs, st.integers(1, 6), st.integers(1, 6), st.lists(signals, min_size=1, max_size=25))
def test_targets_stay_in_bounds_and_under_the_cap(cfg, p, d, seq):
    for dec in _run(cfg, RoleCounts(p, d), seq):
        t, c = dec.target, dec.current
        if dec.action == "frozen":
            assert t == c
            continue
        assert cfg.min_prefill <= t.prefill <= cfg.max_prefill and cfg.min_decode <= t.decode <= cfg.max_decode
        if cfg.max_workers and c.total <= cfg.max_workers:
            assert t.total <= cfg.max_workers, dec
        inside = c.prefill >= cfg.min_prefill and c.decode >= cfg.min_decode and c.prefill <= cfg.max_prefill \
            and c.decode <= cfg.max_decode
        if inside:  # one step at a time (only a count outside its bounds jumps, and the other makes room)
            assert abs(t.prefill - c.prefill) <= 1 and abs(t.decode - c.decode) <= 1, dec


@settings(max_examples=150, deadline=None)
@given(configs, st.lists(signals, min_size=1, max_size=25))
def test_each_role_changes_at_most_once_per_cool_down(cfg, seq):
    start = RoleCounts(cfg.min_prefill, cfg.min_decode)
    decisions = _run(cfg, start, seq)
    for role in ("prefill", "decode"):
        times = [d.at for d in decisions if d.target.get(role) != d.current.get(role)]
        assert all(b - a >= cfg.cooldown_secs for a, b in zip(times, times[1:])), (role, times)


@settings(max_examples=150, deadline=None)
@given(configs, signals, st.integers(1, 4), st.integers(1, 4))
def test_a_steady_load_never_oscillates(cfg, sig, p, d):
    """The same snapshot again and again: each role moves one way only, and then stops for good."""
    sig = dict(sig, missing=())
    decisions = _run(cfg, RoleCounts(p, d), [sig] * 60)  # room for three shrinks of 130 s (window 120 s)
    for role in ("prefill", "decode"):
        steps = [d.target.get(role) - d.current.get(role) for d in decisions if d.target != d.current]
        signs = {s > 0 for s in steps if s}
        assert len(signs) <= 1, (role, steps)
    assert decisions[-1].target == decisions[-2].target == decisions[-1].current


@settings(max_examples=100, deadline=None)
@given(configs, st.lists(signals, min_size=1, max_size=12), st.integers(1, 4), st.integers(1, 4))
def test_a_metrics_outage_freezes_every_decision(cfg, seq, p, d):
    planner = Planner(cfg)
    cur = RoleCounts(p, d)
    for i, sig in enumerate(seq):
        dec = planner.decide(Snapshot(at=10.0 * i, current=cur, **dict(sig, missing=("decode-0 /metrics",))))
        assert dec.action == "frozen" and dec.target == cur and "decode-0 /metrics" in dec.reasons[0]


def test_a_blip_does_not_scale_and_a_lasting_pressure_does():
    calm = {"ttft_p90_ms": 600.0, "itl_p90_ms": 30.0, "decode_kv_usage": 0.5}  # inside the band: nothing moves
    hot = dict(calm, ttft_p90_ms=2500.0)
    decisions = _run(CFG, RoleCounts(1, 1), [calm, hot, calm, hot, calm, calm])
    assert not any(d.changed for d in decisions)
    decisions = _run(CFG, RoleCounts(1, 1), [calm, hot, hot])
    assert [d.target for d in decisions] == [RoleCounts(1, 1)] * 2 + [RoleCounts(2, 1)]
    assert "TTFT p90 2500 ms" in decisions[-1].reasons[0] and "--ttft-slo-ms" in decisions[-1].reasons[0]


def test_queue_time_and_backlog_scale_prefill_before_ttft_shows_it():
    """A burst: no request got its first token yet (no TTFT sample), but requests wait and prompts pile up."""
    burst = {"queue_time_p90_ms": 4000.0, "decode_kv_usage": 0.5}
    assert _run(CFG, RoleCounts(1, 1), [burst] * 2)[-1].target == RoleCounts(2, 1)
    backlog = {"prefill_backlog_tokens": 40_000, "prefill_tokens_per_s": 10_000.0, "decode_kv_usage": 0.5}  # 4 s
    d = _run(CFG, RoleCounts(1, 1), [backlog] * 2)[-1]
    assert d.target == RoleCounts(2, 1) and "prompt backlog 4000 ms" in d.reasons[0]


def test_decode_short_of_room_is_blamed_on_decode_not_prefill():
    """TTFT is late because decode has no room (KV full, transfers waiting): decode grows, prefill does not."""
    snap = {"ttft_p90_ms": 5000.0, "queue_time_p90_ms": 4000.0, "decode_kv_usage": 0.97,
            "outstanding_transfers": 30, "itl_p90_ms": 20.0}
    d = _run(CFG, RoleCounts(1, 1), [snap] * 2)[-1]
    assert d.target == RoleCounts(1, 2)
    assert any("KV usage 0.97" in r for r in d.reasons) and not any(r.startswith("prefill") for r in d.reasons)


def test_at_the_cap_a_role_under_pressure_takes_a_worker_from_the_calm_one():
    snap = {"itl_p90_ms": 200.0, "ttft_p90_ms": 100.0, "queue_time_p90_ms": 10.0, "decode_kv_usage": 0.5}
    busy = dict(snap, ttft_p90_ms=700.0)  # prefill inside the band: not calm, gives nothing
    # 4 workers, the cap: decode is late twice; prefill turned calm only now (too soon to shrink on its own)
    d = _run(CFG, RoleCounts(3, 1), [busy, snap])[-1]
    assert d.target == RoleCounts(2, 2) and any("prefill -1 (to decode, a role switch)" in r for r in d.reasons)
    d = _run(CFG, RoleCounts(3, 1), [busy] * 2)[-1]
    assert d.target == RoleCounts(3, 1) and any("no room at --max-workers 4" in r for r in d.reasons)


def test_idle_shrinks_to_the_minimums_and_bounds_are_restored_at_once():
    idle: dict = {}
    decisions = _run(dataclasses.replace(CFG, cooldown_secs=0), RoleCounts(3, 3), [idle] * 8)
    assert decisions[-1].target == RoleCounts(1, 1)
    d = Planner(CFG).decide(Snapshot(at=0.0, current=RoleCounts(0, 5)))
    assert d.target == RoleCounts(1, 3) and any("--min-prefill" in r for r in d.reasons)


def test_a_role_still_changing_holds_while_the_other_decides():
    """dynamo#14251: a prefill scale-up waiting for a GPU must not stop decode from shrinking."""
    idle = {"pending": RoleCounts(2, 3)}
    d = _run(dataclasses.replace(CFG, max_workers=0), RoleCounts(1, 3), [idle] * 2)[-1]
    assert d.target == RoleCounts(1, 2)
    assert any("prefill: holding until the last change (1 -> 2)" in r for r in d.reasons)


def test_workers_still_starting_count_against_the_cap():
    """A prefill start under way (1P2D now, 2P2D soon, at the cap of 4): decode under pressure gets no fifth worker,
    and the changing prefill gives none to it."""
    hot = {"itl_p90_ms": 200.0, "decode_kv_usage": 0.5, "pending": RoleCounts(2, 2)}
    d = _run(dataclasses.replace(CFG, cooldown_secs=0), RoleCounts(1, 2), [hot] * 2)[-1]
    assert d.target == RoleCounts(1, 2), d
    assert any("decode: no room at --max-workers 4" in r for r in d.reasons), d.reasons


@settings(max_examples=150, deadline=None)
@given(configs, st.integers(1, 4), st.integers(1, 4), st.integers(0, 2), st.integers(0, 2),
       st.lists(signals, min_size=1, max_size=12))
def test_a_target_and_the_workers_under_way_stay_under_the_cap(cfg, p, d, dp, dd, seq):
    """With starts still under way (`Snapshot.pending`), a held role's coming workers and the other role's
    target together stay under ``--max-workers``."""
    planner, cur = Planner(cfg), RoleCounts(p, d)
    pend = RoleCounts(p + dp, d + dd)
    for i, sig in enumerate(seq):
        dec = planner.decide(Snapshot(at=10.0 * i, current=cur, **dict(sig, pending=pend)))
        inside = cfg.min_prefill <= p <= cfg.max_prefill and cfg.min_decode <= d <= cfg.max_decode
        if dec.action == "frozen" or not cfg.max_workers or pend.total > cfg.max_workers or not inside:
            continue  # (a count below its minimum is restored first, as in the test above)
        soon = sum(max(dec.target.get(r), pend.get(r)) if dec.target.get(r) == cur.get(r) else dec.target.get(r)
                   for r in ("prefill", "decode"))
        assert soon <= cfg.max_workers, dec


def test_a_restarted_planner_resumes_from_the_reported_counts():
    hot = {"ttft_p90_ms": 3000.0, "decode_kv_usage": 0.5}
    first = _run(CFG, RoleCounts(1, 1), [hot] * 2)[-1].target
    again = _run(CFG, first, [hot])  # a new planner: no streak yet, nothing changes on its first look
    assert first == RoleCounts(2, 1) and again[0].target == first


@pytest.mark.parametrize("kw, flag", [
    ({"min_prefill": 3, "max_prefill": 2}, "--min-prefill (3) is above --max-prefill (2)"),
    ({"min_decode": 2, "max_decode": 1}, "--min-decode (2) is above --max-decode (1)"),
    ({"ttft_slo_ms": 0}, "--ttft-slo-ms must be a positive number"),
    ({"itl_slo_ms": 0}, "--itl-slo-ms must be a positive number"),
    ({"itl_slo_ms": float("nan")}, "--itl-slo-ms must be a positive number"),
    ({"min_decode": 0}, "--min-decode must be >= 1"),
    ({"max_workers": 1}, "--max-workers (1) is below --min-prefill + --min-decode (2)"),
    ({"scale_down_ratio": 0.6}, "--planner-scale-down-ratio (0.6) must be at most half --planner-scale-up-ratio"),
    ({"stable_intervals": 0}, "--planner-stable-intervals must be >= 1"),
    ({"cooldown_secs": -1}, "--planner-cooldown-secs must be finite and >= 0"),
    ({"scale_down_window_secs": -5}, "--planner-scale-down-window-secs must be finite and >= 0"),
    ({"kv_usage_low": 0.9}, "--planner-kv-usage-low (0.9) and --planner-kv-usage-high (0.85)"),
])
def test_bad_configuration_names_the_flag(kw, flag):
    with pytest.raises(ValueError) as e:
        PlannerConfig(**kw)
    assert flag in str(e.value)


def test_flags_parse_into_the_config_and_refuse_by_name(capsys):
    parser = argparse.ArgumentParser(prog="pd-planner")
    add_planner_args(parser)
    ns = parser.parse_args(["--ttft-slo-ms", "2000", "--max-decode", "6", "--max-workers", "8"])
    cfg = planner_config_from_args(parser, ns)
    assert (cfg.ttft_slo_ms, cfg.max_decode, cfg.max_workers, cfg.itl_slo_ms) == (2000.0, 6, 8, 100.0)
    assert {f.name for f in PLANNER_FLAGS} >= {"--ttft-slo-ms", "--itl-slo-ms", "--min-prefill", "--max-prefill",
                                               "--min-decode", "--max-decode"}
    with pytest.raises(SystemExit):
        planner_config_from_args(parser, parser.parse_args(["--min-prefill", "5"]))
    assert "--min-prefill (5) is above --max-prefill (4)" in capsys.readouterr().err


@pytest.mark.parametrize("snap, grown", [
    ({"prefill_backlog_tokens": 12_000, "prefill_tokens_per_s": 10_000.0}, RoleCounts(2, 1)),  # 1.2 s at one
    ({"outstanding_transfers": 10}, RoleCounts(1, 2)),  # 10 per decode worker at one, 5 at two
])
def test_a_per_worker_signal_just_over_its_threshold_grows_once_and_stays(snap, grown):
    """One more worker halves a per-worker signal: it lands inside the band, not below it (no 1 <-> 2 flapping)."""
    decisions = _run(dataclasses.replace(CFG, cooldown_secs=0), RoleCounts(1, 1), [snap] * 40)
    assert [d.target for d in decisions if d.changed] == [grown]


def test_a_starved_prefill_or_a_router_queue_is_not_calm():
    """Nothing reached its first token in the window while requests wait on prefill: no sample, but no calm either
    (a backlog so deep that a window passes without a first token once read as calm, and the planner drained a
    prefill worker in the middle of a burst); requests queued in the router keep both roles from shrinking."""
    cfg = PlannerConfig(ttft_slo_ms=300, itl_slo_ms=50, max_prefill=3, max_decode=3, stable_intervals=2,
                        cooldown_secs=0, scale_down_window_secs=0)
    quiet = {"itl_p90_ms": 5.0, "decode_kv_usage": 0.1, "decode_running": 1, "decode_capacity": 64,
             "outstanding_transfers": 0}
    starved = [dict(quiet, prefill_waiting=40)] * 4
    assert [d.target.prefill for d in _run(cfg, RoleCounts(2, 2), starved)] == [2] * 4  # decode's calm is its own
    queued = [dict(quiet, prefill_waiting=0, router_queued=12)] * 4
    assert [d.action for d in _run(cfg, RoleCounts(2, 2), queued)] == ["hold"] * 4
    idle = [dict(quiet, prefill_waiting=0, router_queued=0)] * 2
    assert [d.target for d in _run(cfg, RoleCounts(2, 2), idle)] == [RoleCounts(2, 2), RoleCounts(1, 1)]


def test_a_worker_added_for_a_steady_load_stays_until_the_load_falls():
    """TTFT is not a per-worker signal: one more prefill worker takes it from over its target to far under half of
    it, so calm alone would drain that worker and the same load would grow the role again (an oscillation under a
    steady load). The planner remembers the load per worker that grew the role: it drains only when one worker
    fewer would carry under 0.8 of it."""
    cfg = dataclasses.replace(CFG, max_workers=0)
    planner, cur, targets = Planner(cfg), RoleCounts(1, 1), []
    for i in range(40):
        offered = 20_000.0 if i < 30 else 6_000.0  # prompt tokens/s, steady, then it falls
        ttft = {1: 2500.0, 2: 100.0}.get(cur.prefill, 50.0) if offered > 10_000 else 50.0
        d = planner.decide(Snapshot(at=i * 10.0, current=cur, ttft_p90_ms=ttft, itl_p90_ms=10.0,
                                    decode_kv_usage=0.1, prefill_tokens_per_s=offered / cur.prefill))
        cur = d.target
        targets.append(cur.prefill)
    assert targets[:2] == [1, 2] and set(targets[2:30]) == {2}  # grown once, kept under the same load
    assert targets[-1] == 1  # the load fell under 0.8 of what one worker carried: drained


@pytest.mark.parametrize("ttft_at_two, load_known", [
    (300.0, True),   # the bursts are calm at two workers: the window's peak load keeps the worker
    (700.0, False),  # the bursts are inside the band at two workers and no load is reported: the calm window does
])
def test_a_bursty_load_does_not_drain_between_bursts_and_a_lasting_calm_does(ttft_at_two, load_known):
    """20 s bursts 40 s apart with calm gaps between them (a real trace sped up): with the scale-down window of
    Kubernetes' HPA (300 s of calm, one worker fewer carrying the window's peak load) the worker the bursts grew
    stays; without it every gap drains it and the next burst grows it again. A calm of the whole window drains.
    Each case fails with one of the two conditions removed."""
    def run(window: float) -> list[int]:
        cfg = dataclasses.replace(CFG, max_workers=0, cooldown_secs=20, scale_down_window_secs=window)
        planner, cur, out = Planner(cfg), RoleCounts(1, 1), []
        for i in range(120):  # 10 s apart: 20 minutes
            burst = i < 80 and i % 4 < 2  # 20 s of burst in every 40 s, then the load ends (last burst: i = 77)
            offered = 20_000.0 if burst else 2_000.0
            ttft = (2500.0 if cur.prefill == 1 else ttft_at_two) if burst else 50.0
            d = planner.decide(Snapshot(at=i * 10.0, current=cur, ttft_p90_ms=ttft, itl_p90_ms=10.0,
                                        decode_kv_usage=0.1,
                                        prefill_tokens_per_s=offered / cur.prefill if load_known else None))
            cur = d.target
            out.append(cur.prefill)
        return out

    without = run(0.0)
    assert sum(a != b for a, b in zip(without, without[1:])) >= 6  # it flaps with the bursts
    steady = run(300.0)
    changes = [i for i, (a, b) in enumerate(zip(steady, steady[1:])) if a != b]
    assert steady[:2] == [1, 2] and max(steady) == 2 and changes[0] == 0  # one scale-up, at the first burst
    assert len(changes) == 2 and changes[1] == 77 + 30, changes  # then one drain, 300 s after the last burst
    assert steady[-1] == 1
