"""The chart's elastic planner (``planner.enabled``): a ``pd-planner --connector kubernetes`` Deployment with exactly
the RBAC its connector asks for (`pd_cluster.planner.kube.REQUIRED`), every object valid against the Kubernetes
schemas, the flags it gets parsed by pd-planner's own parser, and the schema and templates refusing what it cannot
run on."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_util import KUBE_VERSIONS, NAMESPACE, one, render, render_at, validate

from pd_cluster.planner.config import PlannerConfig, planner_config_from_args
from pd_cluster.planner.kube import REQUIRED
from pd_cluster.planner.main import build_parser

ON = {"planner": {"enabled": True, "args": {"ttft-slo-ms": 2000, "max-prefill": 6}}}


def _planner_objects(objs):
    return [o for o in objs if o["metadata"]["labels"].get("app.kubernetes.io/component") == "planner"]


def test_off_by_default():
    assert not _planner_objects(render())


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_the_planner_renders_with_its_rbac_and_validates(version):
    objs = render_at(ON, version)
    planner = _planner_objects(objs)
    assert sorted(o["kind"] for o in planner) == ["Deployment", "Role", "RoleBinding", "ServiceAccount"]
    for obj in planner:
        validate(obj, version)
    role = one(objs, "Role", "-planner")
    granted = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    needed = {(g, r + ("/" + s if s else ""), v) for g, r, s, v in REQUIRED}
    assert granted == needed  # exactly what the connector checks at start-up, nothing more
    sts = {o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"}
    assert set(role["rules"][0]["resourceNames"]) == sts == {"pd-pd-cluster-prefill", "pd-pd-cluster-decode"}
    binding = one(objs, "RoleBinding", "-planner")
    sa = one(objs, "ServiceAccount", "-planner")["metadata"]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    pod = one(objs, "Deployment", "-planner")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa
    container = pod["containers"][0]
    assert container["command"] == ["pd-planner"]
    parser = build_parser()
    args = parser.parse_args(container["args"])
    assert args.connector == "kubernetes" and args.namespace == NAMESPACE
    assert {args.prefill_workload, args.decode_workload} == sts
    assert args.router_url == "http://pd-pd-cluster-router:8000"
    assert one(objs, "Service", "-router")["metadata"]["name"] == "pd-pd-cluster-router"
    config = planner_config_from_args(parser, args)
    assert config.ttft_slo_ms == 2000 and config.max_prefill == 6 and config.itl_slo_ms == PlannerConfig.itl_slo_ms
    # both router keys, from the router's secret: /workers takes the admin key, /metrics (protect-all-paths) the API key
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"] if "valueFrom" in e}
    assert keys == {"PD_ROUTER_ADMIN_API_KEY": "admin-api-key", "PD_ROUTER_API_KEY": "api-key"}


def test_without_rbac_the_chart_leaves_it_to_you():
    objs = render({"planner": {"enabled": True, "rbac": {"create": False}}})
    assert sorted(o["kind"] for o in _planner_objects(objs)) == ["Deployment", "ServiceAccount"]


@pytest.mark.parametrize("values, message", [
    ({"prefill": {"enabled": False}, "decode": {"enabled": False}, "mixed": {"enabled": True}},
     "planner.enabled needs prefill.enabled and decode.enabled"),
    ({"prefill": {"leaderWorkerSet": {"enabled": True, "size": 2}}}, "prefill.leaderWorkerSet.enabled"),
])
def test_the_chart_refuses_a_planner_it_cannot_run(values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        render({**values, "planner": {"enabled": True}})


@pytest.mark.parametrize("values, word", [
    ({"planner": {"enabled": True, "args": {"ttft-slo-ms": 0}}}, "ttft-slo-ms"),
    ({"planner": {"enabled": True, "args": {"min-decode": 0}}}, "min-decode"),
    ({"planner": {"enable": True}}, "enable"),
])
def test_the_schema_refuses_bad_planner_values(values, word):
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    assert word in str(info.value) or "/planner" in str(info.value), str(info.value)
