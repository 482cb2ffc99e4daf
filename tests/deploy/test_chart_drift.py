"""Consistency between the chart and the code: selectors and labels, command lines, ports, flags, metrics."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import tomllib

import pytest
from chart_util import (CHART, NAMESPACE, ROOT, VALUE_FILES, WORKER_ROLES, all_pod_templates, container_env_names,
                        expand, flag_value, load_values, objects, render)

from pd_cluster.bench import args as bench_args
from pd_cluster.engine.args import COMPAT_ONLY
from pd_cluster.common.flags import is_refusal
from pd_cluster.launch import worker as launch_worker
from pd_cluster.router import args as router_args

CASES = [None, *VALUE_FILES]
IDS = ["default", *[p.stem for p in VALUE_FILES]]
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # injected by the LWS controller
PARSERS = {"pd_cluster.launch.worker": launch_worker.build_parser, "pd_cluster.router.main": router_args.build_parser,
           "pd_cluster.bench.cli": bench_args.build_parser}
FAKE_ENV = {"POD_IP": "10.1.2.3", "POD_NAME": "pd-pd-cluster-decode-0", "POD_NAMESPACE": NAMESPACE,
            "LWS_LEADER_ADDRESS": "pd-pd-cluster-decode-0.pd-pd-cluster-decode", "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": "1"}


def scripts() -> dict[str, str]:
    """Console scripts of pyproject.toml: name -> module."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: target.split(":")[0] for name, target in data["project"]["scripts"].items()}


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{parser.prog} rejects {argv}: {err.getvalue()}")


def selector_dict(text: str | None) -> dict[str, str] | None:
    return None if text is None else dict(term.split("=", 1) for term in text.split(","))


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def router_config(objs):
    (dep,) = [o for o in objects(objs, "Deployment") if o["metadata"]["name"].endswith("-router")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    return router_args.config_from_args(parse(router_args.build_parser(), c["args"])), dep


def serving_templates(objs, role: str) -> list[str]:
    """Labels of the pod templates that serve `role` (StatefulSet pods, LWS leaders)."""
    out = []
    for label, tpl, owner in all_pod_templates(objs):
        if owner["metadata"]["name"].endswith(f"-{role}") and not label.endswith("/worker"):
            out.append(label)
    return out


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_router_selectors_match_exactly_the_serving_worker_pods(path):
    objs = render(load_values(path))
    cfg, _ = router_config(objs)
    k8s = cfg.kubernetes
    assert k8s is not None and k8s.namespace == NAMESPACE
    selectors = {"prefill": k8s.prefill_selector, "decode": k8s.decode_selector, "mixed": k8s.worker_selector}
    templates = all_pod_templates(objs)
    enabled = [r for r in WORKER_ROLES if serving_templates(objs, r)]
    assert enabled, "no worker role rendered"
    for role in WORKER_ROLES:
        sel = selector_dict(selectors[role])
        if role not in enabled:
            assert sel is None, role
            continue
        matched = [label for label, tpl, _ in templates if matches(sel, tpl["metadata"]["labels"])]
        assert matched == serving_templates(objs, role), (role, sel, matched)
        for label in matched:
            tpl = next(t for lb, t, _ in templates if lb == label)
            port = tpl["spec"]["containers"][0]["ports"][0]["containerPort"]
            assert tpl["metadata"]["annotations"][k8s.port_annotation] == str(port)
    rbac = objects(objs, "Role")[0]["rules"]
    assert rbac == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_workload_services_and_budgets_select_their_own_pods(path):
    objs = render(load_values(path))
    templates = all_pod_templates(objs)
    for o in objects(objs, "StatefulSet") + objects(objs, "Deployment"):
        assert matches(o["spec"]["selector"]["matchLabels"], o["spec"]["template"]["metadata"]["labels"])
    for svc in objects(objs, "Service"):
        hits = {owner["metadata"]["name"] for _, tpl, owner in templates
                if matches(svc["spec"]["selector"], tpl["metadata"]["labels"]) and owner["kind"] != "Pod"}
        assert hits == {svc["metadata"]["name"]}, (svc["metadata"]["name"], hits)
    for pdb in objects(objs, "PodDisruptionBudget"):
        hits = [lb for lb, tpl, _ in templates if matches(pdb["spec"]["selector"]["matchLabels"],
                                                         tpl["metadata"]["labels"])]
        assert hits and all(not lb.endswith("/worker") for lb in hits), (pdb["metadata"]["name"], hits)


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_every_container_command_line_parses_with_the_project_cli(path):
    objs = render(load_values(path))
    names = scripts()
    seen = set()
    for label, tpl, owner in all_pod_templates(objs):
        for c in tpl["spec"]["containers"]:
            (script,) = c["command"]
            assert script in names, f"{label}: {script} is not a console script of pyproject.toml"
            module = names[script]
            defined = container_env_names(c) | (LWS_ENV if owner["kind"] == "LeaderWorkerSet" else set())
            for arg in c["args"]:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in defined, f"{label}: $({var}) is not defined in the container's env"
            argv = [expand(a, FAKE_ENV) for a in c["args"]]
            ns = parse(PARSERS[module](), argv)
            seen.add(script)
            if script == "pd-worker":
                _check_worker(ns, argv, label)
            elif script == "pd-router":
                router_args.config_from_args(ns)
            else:
                bench_args.to_config(ns)
    assert {"pd-worker", "pd-router"} <= seen


def _check_worker(ns: argparse.Namespace, argv: list[str], label: str) -> None:
    config = launch_worker.worker_config_from_args(ns)  # raises on invalid engine, transfer or worker values
    assert config.role in label.split("/")[0], label
    assert config.url == f"http://{FAKE_ENV['POD_IP']}:{config.port}"
    assert config.host == "0.0.0.0"
    assert config.engine.cache.kv_cache_dtype in ("fp8_e4m3", "bf16", "fp16", "fp32", "auto")


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_ports_agree(path):
    objs = render(load_values(path))
    cfg, dep = router_config(objs)
    router_c = dep["spec"]["template"]["spec"]["containers"][0]
    assert router_c["ports"] == [{"name": "http", "containerPort": cfg.port, "protocol": "TCP"}]
    worker_ports = set()
    for label, tpl, owner in all_pod_templates(objs):
        c = tpl["spec"]["containers"][0]
        if c["name"] != "worker":
            continue
        port = c["ports"][0]["containerPort"]
        assert c["ports"][0]["name"] == "http" and int(flag_value(c["args"], "--port")) == port, label
        assert flag_value(c["args"], "--advertise-url").endswith(f":{port}"), label
        assert tpl["metadata"]["annotations"]["pd-cluster.io/port"] == str(port), label
        worker_ports.add(port)
    assert cfg.kubernetes.port in worker_ports
    for svc in objects(objs, "Service"):
        (p,) = svc["spec"]["ports"]
        assert p["targetPort"] == "http" and p["name"] == "http"
    for np in objects(objs, "NetworkPolicy"):
        if np["metadata"]["name"].endswith("-workers"):
            assert {p["port"] for p in np["spec"]["ingress"][0]["ports"]} == worker_ports
        else:
            assert [p["port"] for p in np["spec"]["ingress"][0]["ports"]] == [cfg.port]
    for sm in objects(objs, "ServiceMonitor"):
        assert [e["port"] for e in sm["spec"]["endpoints"]] == ["http"]
        assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    for ing in objects(objs, "Ingress"):
        backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
        assert backend["port"] == {"name": "http"} and backend["name"].endswith("-router")
    for pod in objects(objs, "Pod"):  # helm test: pd-bench aims at the router Service's port
        svc_port = next(s for s in objects(objs, "Service") if s["metadata"]["name"].endswith("-router"))
        url = flag_value(pod["spec"]["containers"][0]["args"], "--base-url")
        assert url == f"http://{svc_port['metadata']['name']}:{svc_port['spec']['ports'][0]['port']}"


# ---- values.schema.json against the parsers -------------------------------------------------------
CHART_MANAGED = {
    "engineArgs": {"--role", "--disaggregation-mode", "--host", "--port", "--advertise-url", "--log-level",
                   "--timeout-graceful-shutdown", "--model", "--prefill-url", "--help",
                   "--internal-api-key", "--prefill-urls",
                   "--nnodes", "--node-rank", "--dist-init-addr"},  # a LeaderWorkerSet pod's LWS_* variables
    "routerArgs": {"--host", "--port", "--log-level", "--prefill", "--decode", "--worker", "--service-discovery",
                   "--service-discovery-namespace", "--prefill-selector", "--decode-selector", "--selector",
                   "--service-discovery-port", "--service-discovery-port-annotation", "--api-key",
                   "--admin-api-key", "--shutdown-grace-period-secs", "--kubeconfig", "--ray-discovery",
                   "--ray-address", "--ray-namespace", "--ray-actor-prefix", "--ray-poll-secs", "--help",
                   "--internal-api-key"},
}


@pytest.mark.parametrize("definition,factory", [("engineArgs", launch_worker.build_parser),
                                                ("routerArgs", router_args.build_parser)])
def test_values_schema_lists_every_flag_with_its_type(definition, factory):
    schema = json.loads((CHART / "values.schema.json").read_text())["definitions"][definition]
    assert schema["additionalProperties"] is False
    actions = {next(o for o in a.option_strings if o.startswith("--")): a for a in factory()._actions
               if a.option_strings and not is_refusal(a) and a.option_strings[0] not in COMPAT_ONLY}
    managed = CHART_MANAGED[definition]
    assert managed <= set(actions), managed - set(actions)
    assert {f"--{k}" for k in schema["properties"]} == set(actions) - managed
    for key, prop in schema["properties"].items():
        a = actions[f"--{key}"]
        types = set(prop["type"]) - {"null"}
        if isinstance(a, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            assert types == {"boolean"}, key
        elif a.nargs in ("+", "*"):
            assert types == {"array"}, key
        elif a.type is int:
            assert types == {"integer"}, key
        elif a.type is float:
            assert types == {"number"}, key
        else:
            assert "string" in types, key
        if a.choices:
            assert set(prop["enum"]) - {None} == set(a.choices), key


def test_values_yaml_names_every_engine_flag():
    schema = json.loads((CHART / "values.schema.json").read_text())["definitions"]["engineArgs"]["properties"]
    text = (CHART / "values.yaml").read_text()
    assert [k for k in schema if not re.search(rf"\b{re.escape(k)}\b", text)] == []


def test_every_schema_flag_renders_and_parses():
    """Each engine flag set in values reaches the worker command line and parses there."""
    schema = json.loads((CHART / "values.schema.json").read_text())["definitions"]["engineArgs"]["properties"]
    sample = {"integer": 3, "number": 0.5, "boolean": True, "string": "x"}
    args = {}
    for key, prop in schema.items():
        kind = next(t for t in prop["type"] if t != "null")
        args[key] = next(v for v in prop.get("enum", []) if v is not None) if "enum" in prop else sample[kind]
    args["kv-cache-memory"] = "64MiB"
    args["hicache-size"] = "1GiB"  # sizes, like kv-cache-memory, are strings with a unit
    args["tp-size"] = 1  # the chart refuses the KV store (hicache-storage-backend) with more ranks
    objs = render({"engine": {"args": args}, "gpu": {"count": 0}})
    for sts in objects(objs, "StatefulSet"):
        argv = [expand(a, FAKE_ENV) for a in sts["spec"]["template"]["spec"]["containers"][0]["args"]]
        ns = parse(launch_worker.build_parser(), argv)
        for key in schema:
            assert f"--{key}" in argv, key
        assert ns.page_size == 3 and ns.kv_transfer_progress_thread is True


# ---- Grafana dashboard against the metrics the code exports -------------------------------------------
def exported_metric_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from pd_cluster.serving.metrics import WorkerMetrics
    from pd_cluster.router.config import CircuitBreakerConfig
    from pd_cluster.router.metrics import RouterMetrics, StateCollector
    from pd_cluster.router.workers import WorkerRegistry
    from pd_cluster.transfer.metrics import TransferMetrics

    reg = CollectorRegistry()
    WorkerMetrics(reg, "decode")
    TransferMetrics(reg)
    rm = RouterMetrics()
    rm.attach_state(StateCollector(WorkerRegistry(CircuitBreakerConfig()), lambda: 0, lambda: 0, {}))
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""],
                "summary": ["_sum", "_count"]}
    names = set()
    for registry in (reg, rm.registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def test_grafana_dashboard_queries_only_exported_metrics():
    dash = json.loads((CHART / "files" / "grafana" / "pd-cluster.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = set()
    for expr in exprs:
        used |= set(re.findall(r"\b(pd(?::|_router_)[a-z0-9_:]+)", expr))
    exported = exported_metric_names()
    assert used <= exported, used - exported
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("time to first token", "inter-token", "token usage", "queue", "transfer throughput", "retries"):
        assert topic in titles, topic
    assert {"pd:kv_transfer_bytes_total", "pd_router_retries_total", "pd:token_usage"} <= used


def test_leaderworkerset_pods_get_consistent_node_args(monkeypatch):
    """Each pod of a LeaderWorkerSet group, with the environment the LWS controller gives it, is one node of the same
    instance: the leader node 0, the worker node 1, both meeting at the leader's address, and otherwise the very
    same engine configuration (`rendezvous.config_differences`: what node 0 would refuse)."""
    from pd_cluster.engine.parallel.nodes import DEFAULT_DIST_INIT_PORT
    from pd_cluster.engine.parallel.rendezvous import config_differences

    objs = render(load_values(CHART / "ci" / "lws-values.yaml"))
    for role in ("prefill", "decode"):
        (lws,) = [o for o in objects(objs, "LeaderWorkerSet") if o["metadata"]["name"].endswith(f"-{role}")]
        lwt = lws["spec"]["leaderWorkerTemplate"]
        configs = []
        for index, tpl in enumerate((lwt["leaderTemplate"], lwt["workerTemplate"])):
            env = dict(FAKE_ENV, LWS_LEADER_ADDRESS=f"pd-pd-cluster-{role}-0.pd-pd-cluster-{role}",
                       LWS_GROUP_SIZE=str(lwt["size"]), LWS_WORKER_INDEX=str(index))
            for k in LWS_ENV:
                monkeypatch.setenv(k, env[k])
            argv = [expand(a, env) for a in tpl["spec"]["containers"][0]["args"]]
            configs.append(launch_worker.worker_config_from_args(parse(launch_worker.build_parser(), argv)).engine)
        leader, worker = (c.parallel for c in configs)
        assert (leader.nnodes, leader.node_rank, worker.nnodes, worker.node_rank) == (2, 0, 2, 1), role
        assert leader.dist_init_addr == worker.dist_init_addr == (f"pd-pd-cluster-{role}-0.pd-pd-cluster-{role}:"
                                                                  f"{DEFAULT_DIST_INIT_PORT}")
        assert leader.tp_size == 16 and config_differences(configs[0], configs[1]) == [], role
        # the leader's name resolves before it is ready: the other pods meet it before the model loads
        (svc,) = [o for o in objects(objs, "Service") if o["metadata"]["name"] == lws["metadata"]["name"]]
        assert svc["spec"]["publishNotReadyAddresses"] is True and svc["spec"]["clusterIP"] == "None"
