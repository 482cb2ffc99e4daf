"""Bad planner configuration stops ``pd-serve --autoscale`` and ``pd-planner`` at start-up with a message naming the
flag; the Kubernetes connector asks the API server for its RBAC first and scales the role StatefulSets' ``scale``
subresource, checked on the real ``kubernetes`` client's requests (`kube_transport.RecordingPool`)."""

from __future__ import annotations

import httpx
import pytest
from fake_router import FakeRouter, worker_entry as _worker
from kube_transport import RecordingPool, api_client

from pd_cluster.launch.autoscale import autoscale_config
from pd_cluster.launch.serve import build_parser
from pd_cluster.planner import main as planner_main
from pd_cluster.planner.actions import RouterAdmin
from pd_cluster.planner.decision import Decision, RoleCounts, Snapshot
from pd_cluster.planner.kube import KubernetesConnector
from pd_cluster.planner.scrape import ClusterView, WorkerView


def _serve_error(capsys, *argv: str) -> str:
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        autoscale_config(parser, parser.parse_args(list(argv)))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--min-prefill", "3", "--max-prefill", "2"], "--min-prefill (3) is above --max-prefill (2)"),
    (["--min-decode", "5", "--max-decode", "4"], "--min-decode (5) is above --max-decode (4)"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms must be a positive number, got 0.0"),
    (["--itl-slo-ms", "0"], "--itl-slo-ms must be a positive number, got 0.0"),
    (["--max-workers", "1"], "--max-workers (1) is below --min-prefill + --min-decode (2)"),
])
def test_pd_serve_autoscale_refuses_bad_bounds_and_slos_naming_the_flag(capsys, argv, message):
    assert _serve_error(capsys, "--autoscale", *argv) == f"pd-serve: error: {message}"


def test_pd_serve_refuses_planner_flags_without_autoscale_and_autoscale_where_it_does_not_apply(capsys):
    assert _serve_error(capsys, "--max-decode", "3") == \
        "pd-serve: error: --max-decode is a planner flag: it needs --autoscale"
    assert "--colocated" in _serve_error(capsys, "--autoscale", "--colocated")
    assert "--max-workers with --ray-address" in _serve_error(capsys, "--autoscale", "--ray-address", "local",
                                                             "--max-workers", "3")
    parser = build_parser()
    assert autoscale_config(parser, parser.parse_args([])) is None
    config = autoscale_config(parser, parser.parse_args(["--autoscale", "--max-prefill", "3", "--ttft-slo-ms", "500"]))
    assert config.max_prefill == 3 and config.ttft_slo_ms == 500


def test_pd_serve_autoscale_behind_an_api_key_needs_the_admin_key(capsys, monkeypatch):
    from pd_cluster.launch import serve

    monkeypatch.delenv("PD_ROUTER_ADMIN_API_KEY", raising=False)
    with pytest.raises(SystemExit) as e:
        serve.main(["--autoscale", "--api-key", "k"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "--autoscale with --api-key needs --admin-api-key: the planner reads the router's /workers")


def test_pd_planner_refuses_bad_slos_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        planner_main.main(["--router-url", "http://127.0.0.1:1", "--itl-slo-ms", "-1"])
    assert capsys.readouterr().err.strip().endswith("--itl-slo-ms must be a positive number, got -1.0")


K8S = ["--router-url", "http://127.0.0.1:1", "--connector", "kubernetes", "--namespace", "llm",
       "--prefill-workload", "pd-prefill", "--decode-workload", "pd-decode", "--port", "0"]


def test_pd_planner_with_the_kubernetes_connector_and_no_rbac_to_scale_fails_at_start_up(capsys):
    pool = RecordingPool({"pd-prefill": 1, "pd-decode": 1}, denied={("patch", "statefulsets/scale")})
    with pytest.raises(SystemExit) as e:
        planner_main.main(K8S, api_client=api_client(pool))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("pd-planner: error: --connector kubernetes: the planner's service account may not patch "
                   "statefulsets/scale (apps) in namespace 'llm'; grant them (the chart's planner.rbac.create) or "
                   "use --connector none")
    # what it asked: one SelfSubjectAccessReview per permission, in the planner's namespace, nothing scaled
    reviews = [r for r in pool.requests if r[1] == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"]
    assert [r[3]["spec"]["resourceAttributes"] for r in reviews] == [
        {"group": "apps", "namespace": "llm", "resource": "statefulsets", "subresource": "scale", "verb": "get"},
        {"group": "apps", "namespace": "llm", "resource": "statefulsets", "subresource": "scale", "verb": "patch"},
        {"group": "", "namespace": "llm", "resource": "pods", "verb": "get"}]
    assert all(r[0] == "POST" for r in reviews)
    assert not [r for r in pool.requests if r[0] == "PATCH"]
    with pytest.raises(SystemExit):
        planner_main.main(K8S[:4], api_client=api_client(pool))
    assert "--connector kubernetes needs --prefill-workload and --decode-workload" in capsys.readouterr().err


def test_the_kubernetes_connector_scales_the_statefulset_scale_subresource():
    pool = RecordingPool({"pd-prefill": 2, "pd-decode": 1}, pod_ips={"pd-prefill-1": "10.0.0.7"})
    k = KubernetesConnector(RouterAdmin("http://127.0.0.1:1"), "llm", {"prefill": "pd-prefill", "decode": "pd-decode"},
                            api_client(pool))
    assert k.missing_permissions() == []
    assert k.replicas("prefill") == 2
    k.scale("prefill", 3)
    assert k.replicas("prefill") == 3 and pool.replicas == {"pd-prefill": 3, "pd-decode": 1}
    assert k.pod_ip("pd-prefill-1") == "10.0.0.7"
    method, path, headers, body = next(r for r in pool.requests if r[0] == "PATCH")
    assert path == "/apis/apps/v1/namespaces/llm/statefulsets/pd-prefill/scale"
    assert headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert body == {"spec": {"replicas": 3}}
    gets = [r[1] for r in pool.requests if r[0] == "GET"]
    assert gets == ["/apis/apps/v1/namespaces/llm/statefulsets/pd-prefill/scale"] * 2 + [
        "/api/v1/namespaces/llm/pods/pd-prefill-1"]


def test_the_kubernetes_connector_drains_the_highest_ordinal_before_patching_and_waits_for_a_new_pod():
    log: list = []
    pool = RecordingPool({"pd-prefill": 2, "pd-decode": 1},
                         pod_ips={"pd-prefill-0": "10.0.0.5", "pd-prefill-1": "10.0.0.6", "pd-decode-0": "10.0.0.9"})
    pool.requests = log
    router = FakeRouter(log, [_worker("10.0.0.5", "prefill"), _worker("10.0.0.6", "prefill"),
                              _worker("10.0.0.9", "decode")])
    admin = RouterAdmin("http://router", transport=httpx.MockTransport(router.handle))
    k = KubernetesConnector(admin, "llm", {"prefill": "pd-prefill", "decode": "pd-decode"}, api_client(pool))
    k.poll_s = 0.01
    view = ClusterView(Snapshot(0.0, RoleCounts(2, 1)), tuple(
        WorkerView(w["id"], w["url"], w["role"], True) for w in router.workers))
    k.apply(Decision(0.0, RoleCounts(2, 1), RoleCounts(1, 1), "scale", ("prefill -1",)), view)
    assert k.targets() == {"prefill": 1}
    assert k.wait_idle(10) and k.targets() == {}
    assert [d[:3] for d in k.done] == [("drain", "prefill", "ok")]
    steps = [(r[0], r[1], r[2]) for r in log if r[0] in ("router", "PATCH")]
    drain = steps.index(("router", "POST", "router/workers/w-10.0.0.6/drain"))  # pod -1: the highest ordinal
    loads = [i for i, s in enumerate(steps) if s == ("router", "GET", "10.0.0.6/get_load")]
    patch = next(i for i, s in enumerate(steps) if s[0] == "PATCH")
    assert drain < loads[0] and len(loads) >= 4 and loads[-1] < patch  # idle (pages free) before the replica goes
    assert log[[i for i, r in enumerate(log) if r[0] == "PATCH"][0]][3] == {"spec": {"replicas": 1}}
    assert pool.replicas["pd-prefill"] == 1
    # up: one more replica, done once the router lists the new pod healthy
    router.workers.append(_worker("10.0.0.7", "decode", healthy=False))
    pool.pod_ips["pd-decode-1"] = "10.0.0.7"
    k.apply(Decision(1.0, RoleCounts(1, 1), RoleCounts(1, 2), "scale", ("decode +1",)), view)
    assert k.wait_idle(10)
    assert [d[:3] for d in k.done][-1] == ("start", "decode", "ok"), k.done
    assert pool.replicas == {"pd-prefill": 1, "pd-decode": 2}
