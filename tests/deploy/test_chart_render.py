"""The Helm chart renders and lints with the real Helm engine, every object validates, and the schema rejects mistakes."""

from __future__ import annotations

import copy

import helm_python as helm
import jsonschema
import pytest
import yaml
from chart_util import (CHART, KUBE_VERSION, NAMESPACE, NEWEST_KUBE_VERSION, VALUE_FILES, all_pod_templates, flag_value,
                        load_values, min_kube_version, objects, one, render, render_at, render_notes, validate)

CASES = [None, *VALUE_FILES]
IDS = ["default", *[p.stem for p in VALUE_FILES]]


def test_the_required_value_files_exist():
    names = {p.stem for p in VALUE_FILES}
    assert {"small-1p1d-values", "h200-4p4d-rdma-values", "mixed-values", "lws-values", "h200-2p2d"} <= names


def _lint(path, version: str) -> dict:
    return helm.lint(CHART, values=load_values(path), strict=True, namespace=NAMESPACE, kube_version=f"v{version}.0")


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_strict_lint_passes(path):
    report = _lint(path, min_kube_version(path))
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 warning, 3 error
    assert report["total_charts_linted"] == 1


def _template_failures(path, version: str, capfd) -> list[str]:
    """The `fail` messages of the chart's templates for `path` at Kubernetes `version` (Helm's lint logs them)."""
    capfd.readouterr()
    _lint(path, version)
    out, err = capfd.readouterr()
    return [ln for ln in (out + err).splitlines() if "fail message=" in ln]


def test_values_files_above_the_chart_floor_are_refused_below_their_own(capfd):
    """The chart supports 1.30; a values file that needs more says so, and the chart refuses it on older clusters."""
    raised = [p for p in VALUE_FILES if min_kube_version(p) != KUBE_VERSION]
    assert [p.stem for p in raised] == ["lws-values"]  # image volumes: beta in 1.33
    for path in raised:
        below = f"{min_kube_version(path).split('.')[0]}.{int(min_kube_version(path).split('.')[1]) - 1}"
        assert any("needs Kubernetes 1.33+" in m for m in _template_failures(path, below, capfd))
        assert _template_failures(path, min_kube_version(path), capfd) == []
        # outside lint (helm template --kube-version, an install on an older cluster) the guard aborts the render
        for version in (KUBE_VERSION, below):
            with pytest.raises(helm.HelmRenderError, match=r"needs Kubernetes 1\.33\+"):
                render_at(load_values(path), version)
        for obj in render_at(load_values(path), min_kube_version(path)):
            validate(obj, min_kube_version(path))
        with pytest.raises(jsonschema.ValidationError):  # why: its pods do not validate at the chart's floor
            for obj in render(load_values(path)):
                validate(obj, KUBE_VERSION)
    assert KUBE_VERSION == "1.30" and min_kube_version(CHART / "ci" / "lws-values.yaml") == "1.33"


@pytest.mark.parametrize("version", ["floor", NEWEST_KUBE_VERSION])
@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_every_object_validates_against_the_kubernetes_schemas(path, version):
    """At the oldest Kubernetes each values file is for (the chart's kubeVersion or the file's own) and the newest,
    rendered as Helm renders for a cluster of that version."""
    version = min_kube_version(path) if version == "floor" else version
    objs = render_at(load_values(path), version)
    used = {}
    for obj in objs:
        try:
            used[(obj["kind"], obj["metadata"]["name"])] = validate(obj, version)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {e.message} at {list(e.absolute_path)}")
    assert len(used) == len(objs) >= 10
    kinds = {k for k, _ in used}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert kinds & {"StatefulSet", "LeaderWorkerSet"}


def test_the_validator_rejects_broken_objects():
    """The checks above can fail: an unknown field, a wrong type and a bad enum are each caught."""
    objs = render()
    sts = copy.deepcopy(one(objs, "StatefulSet", "-decode"))
    sts["spec"]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(sts)
    sts = copy.deepcopy(one(objs, "StatefulSet", "-decode"))
    sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(jsonschema.ValidationError):
        validate(sts)
    lws = copy.deepcopy(one(render(load_values(CHART / "ci" / "lws-values.yaml")), "LeaderWorkerSet", "-prefill"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws["spec"]["leaderWorkerTemplate"] = {"sise": 2}
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)


BAD_VALUES = [
    ({"decode": {"replica": 2}}, "/decode", "replica"),
    ({"decode": {"replicas": "2"}}, "/decode/replicas", "integer"),
    ({"prefill": {"args": {"chunked-prefil-size": 4096}}}, "/prefill/args", "chunked-prefil-size"),
    ({"engine": {"args": {"page-size": "64"}}}, "/engine/args/page-size", "integer"),
    ({"engine": {"args": {"kv-cache-dtype": "fp4"}}}, "/engine/args/kv-cache-dtype", "fp8_e4m3"),
    ({"engine": {"args": {"port": 9000}}}, "/engine/args", "port"),
    ({"router": {"args": {"decode-policy": "fastest"}}}, "/router/args/decode-policy", "least_kv_usage"),
    ({"router": {"args": {"prefill-selector": ["a=b"]}}}, "/router/args", "prefill-selector"),
    ({"router": {"service": {"type": "External"}}}, "/router/service/type", "LoadBalancer"),
    ({"workers": {"port": 70000}}, "/workers/port", "maximum"),
    ({"workers": {"antiAffinity": "strict"}}, "/workers/antiAffinity", "hard"),
    ({"workers": {"readinessProbe": {"path": "health", "periodSeconds": 5, "timeoutSeconds": 1,
                                     "failureThreshold": 1}}}, "/workers/readinessProbe/path", "^/"),
    ({"ucx": {"env": {"CUDA_VISIBLE_DEVICES": "0"}}}, "", "UCX|NIXL"),
    ({"model": {"source": "s3"}}, "/model/source", "pvc"),
    ({"rdma": {"enable": True}}, "/rdma", "enable"),
    ({"gpu": {"count": -1}}, "/gpu/count", "minimum"),
    ({"imageTag": "v1"}, "", "imageTag"),
]


@pytest.mark.parametrize("values,where,word", BAD_VALUES, ids=[str(v) for v, _, _ in BAD_VALUES])
def test_schema_rejects_mistakes(values, where, word):
    with pytest.raises(helm.HelmValuesError) as info:
        render(values)
    message = str(info.value)
    assert f"at '{where}'" in message and word in message, message
    report = helm.lint(CHART, values=values, strict=True, namespace=NAMESPACE)
    assert report["errors"], report


def _args(objs, kind, suffix):
    return one(objs, kind, suffix)["spec"]["template"]["spec"]["containers"][0]["args"]


def test_default_is_one_prefill_and_one_decode_8xh200_node_with_fp8_kv():
    objs = render()
    pre, dec = _args(objs, "StatefulSet", "-prefill"), _args(objs, "StatefulSet", "-decode")
    for args in (pre, dec):
        assert flag_value(args, "--kv-cache-dtype") == "fp8_e4m3"
        assert flag_value(args, "--page-size") == "64"
        assert flag_value(args, "--mem-fraction-static") == "0.88"
        assert flag_value(args, "--tp-size") == "8"
    assert flag_value(pre, "--chunked-prefill-size") == "8192" and "--disable-cuda-graph" in pre
    assert flag_value(dec, "--cuda-graph-max-bs") == "256" and "--disable-cuda-graph" not in dec
    for sts in objects(objs, "StatefulSet"):
        assert sts["spec"]["replicas"] == 1
        res = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 8
    assert not objects(objs, "LeaderWorkerSet") and not objects(objs, "ServiceMonitor")
    assert one(objs, "Service", "-router")["spec"]["type"] == "ClusterIP"


def test_tp_size_is_set_in_one_place():
    lines = [ln.split("#")[0] for ln in (CHART / "values.yaml").read_text().splitlines()]
    assert sum("tp-size:" in ln for ln in lines) == 1
    objs = render({"engine": {"args": {"tp-size": 4}}})
    for sts in objects(objs, "StatefulSet"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert flag_value(c["args"], "--tp-size") == "4" and c["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_per_role_tp_size_renders_each_roles_flag_and_gpus():
    """P TP 2 -> D TP 1 (the KV transfer splits and merges heads): each role's pods get their own --tp-size and as
    many GPUs."""
    objs = render({"prefill": {"args": {"tp-size": 2}}, "decode": {"args": {"tp-size": 1}}})
    for suffix, tp in (("-prefill", 2), ("-decode", 1)):
        c = one(objs, "StatefulSet", suffix)["spec"]["template"]["spec"]["containers"][0]
        assert flag_value(c["args"], "--tp-size") == str(tp) and c["resources"]["limits"]["nvidia.com/gpu"] == tp


def test_role_args_override_shared_args_including_false():
    objs = render({"engine": {"args": {"disable-cuda-graph": True}}, "decode": {"args": {"disable-cuda-graph": False}},
                   "prefill": {"args": {"page-size": 32}}})
    assert "--disable-cuda-graph" in _args(objs, "StatefulSet", "-prefill")
    assert "--disable-cuda-graph" not in _args(objs, "StatefulSet", "-decode")
    assert flag_value(_args(objs, "StatefulSet", "-prefill"), "--page-size") == "32"
    big = render({"engine": {"args": {"num-pages": 16777216}}})
    assert flag_value(_args(big, "StatefulSet", "-decode"), "--num-pages") == "16777216"  # no 1.6777216e+07


def test_role_overrides_merge_with_shared_worker_settings():
    objs = render({"decode": {"resources": {"limits": {"memory": "256Gi"}}, "nodeSelector": {"pool": "decode"}}})
    dec = one(objs, "StatefulSet", "-decode")["spec"]["template"]["spec"]
    pre = one(objs, "StatefulSet", "-prefill")["spec"]["template"]["spec"]
    assert dec["containers"][0]["resources"]["limits"]["memory"] == "256Gi"
    assert dec["containers"][0]["resources"]["requests"]["memory"] == "512Gi"  # kept from `workers`
    assert dec["nodeSelector"] == {"pool": "decode"} and "nodeSelector" not in pre


def test_4p4d_h200_rdma_cluster():
    objs = render(load_values(CHART / "ci" / "h200-4p4d-rdma-values.yaml"))
    for role in ("prefill", "decode"):
        sts = one(objs, "StatefulSet", f"-{role}")
        spec = sts["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert sts["spec"]["replicas"] == 4
        assert c["resources"]["limits"]["rdma/ib"] == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"].count("mlx5_") == 8
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert spec["priorityClassName"] == "inference-critical"
    hpa = one(objs, "HorizontalPodAutoscaler", "-router")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert "replicas" not in one(objs, "Deployment", "-router")["spec"]
    assert one(objs, "Service", "-router")["spec"]["type"] == "LoadBalancer"
    assert one(objs, "Ingress", "-router")["spec"]["rules"][0]["host"] == "llm.example.com"
    assert objects(objs, "ServiceMonitor") and objects(objs, "ConfigMap")
    assert [s["metadata"]["name"] for s in objects(objs, "Secret")] == ["pd-pd-cluster-internal-key"]  # no auth one
    env = {e["name"]: e for e in one(objs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PD_ROUTER_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "pd-cluster-api-keys"


def test_mixed_install_has_only_mixed_workers():
    objs = render(load_values(CHART / "ci" / "mixed-values.yaml"))
    assert [s["metadata"]["name"] for s in objects(objs, "StatefulSet")] == ["pd-pd-cluster-mixed"]
    args = _args(objs, "Deployment", "-router")
    assert "--selector" in args and "--prefill-selector" not in args and "--decode-selector" not in args
    assert not objects(objs, "PodDisruptionBudget") or all(
        "router" not in p["metadata"]["name"] for p in objects(objs, "PodDisruptionBudget"))  # 1 router replica


def test_leaderworkerset_groups_span_nodes():
    objs = render(load_values(CHART / "ci" / "lws-values.yaml"))
    assert not objects(objs, "StatefulSet")
    for role in ("prefill", "decode"):
        lws = one(objs, "LeaderWorkerSet", f"-{role}")
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lws["spec"]["replicas"] == 2 and lwt["size"] == 2
        assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
        leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
        assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == f"{role}-lws-worker"
        for tpl in (leader, worker):
            c = tpl["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 8  # tp-size 16 over 2 nodes
            assert flag_value(c["args"], "--tp-size") == "16"
            assert tpl["spec"]["volumes"][-1]["image"]["reference"].endswith("fp8:v1")
    with pytest.raises(helm.HelmError, match="not a multiple"):
        render({"workers": {"leaderWorkerSet": {"enabled": True, "size": 3}}})


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_containers_are_locked_down(path):
    values = load_values(path)
    rdma = values.get("rdma", {}).get("enabled", False)
    for label, tpl, owner in all_pod_templates(render(values)):
        (c,) = tpl["spec"]["containers"]
        worker = c["name"] == "worker"
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, label
        assert sc["capabilities"]["drop"] == ["ALL"], label
        assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma and worker else []), label
        if not (rdma and worker):  # IPC_LOCK takes effect for root only: the RDMA example runs workers as root
            assert tpl["spec"]["securityContext"]["runAsNonRoot"] is True, label
        assert tpl["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, label


@pytest.mark.parametrize("path", CASES, ids=IDS)
def test_probes_budget_and_draining(path):
    values = load_values(path)
    for label, tpl, owner in all_pod_templates(render(values)):
        c = tpl["spec"]["containers"][0]
        if owner["kind"] == "Pod":
            continue
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["port"] == "http", label
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = tpl["spec"]["terminationGracePeriodSeconds"]
        if c["name"] == "worker":
            drain = int(flag_value(c["args"], "--timeout-graceful-shutdown"))
            assert grace > drain + pre_stop, label
            if path is None or "h200" in path.name:  # a 70B model gets an hour to load
                s = c["startupProbe"]
                assert s["periodSeconds"] * s["failureThreshold"] >= 3600
        else:
            assert grace > int(flag_value(c["args"], "--shutdown-grace-period-secs")) + pre_stop


def test_workers_have_pdbs_and_the_router_one_only_with_two_replicas():
    objs = render()
    pdbs = {p["metadata"]["name"]: p["spec"] for p in objects(objs, "PodDisruptionBudget")}
    assert pdbs["pd-pd-cluster-prefill"]["maxUnavailable"] == 1 and pdbs["pd-pd-cluster-router"]["minAvailable"] == 1
    one_router = {p["metadata"]["name"] for p in objects(render({"router": {"replicas": 1}}), "PodDisruptionBudget")}
    assert one_router == {"pd-pd-cluster-prefill", "pd-pd-cluster-decode"}
    min_avail = render({"decode": {"pdb": {"minAvailable": "50%"}}})
    assert one(min_avail, "PodDisruptionBudget", "-decode")["spec"] == {
        "minAvailable": "50%", "selector": one(min_avail, "PodDisruptionBudget", "-decode")["spec"]["selector"]}


def test_auth_secret_and_disabled_auth():
    objs = render({"router": {"auth": {"apiKey": "k-123"}}})
    secret = one(objs, "Secret", "-router-auth")
    import base64

    assert base64.b64decode(secret["data"]["api-key"]).decode() == "k-123"
    assert len(base64.b64decode(secret["data"]["admin-api-key"])) == 48  # generated
    off = render({"router": {"auth": {"enabled": False}}})
    assert [s["metadata"]["name"] for s in objects(off, "Secret")] == ["pd-pd-cluster-internal-key"]
    env = one(off, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "PD_ROUTER_API_KEY" not in {e["name"] for e in env}


def _router_pod(values):
    return one(render(values), "Deployment", "-router")["spec"]["template"]["spec"]


def test_router_gets_the_workers_tokenizer_from_the_model_volume_read_only_when_asked():
    """router.tokenizerFromModel true (model.source=pvc): --tokenizer-path model.path, the workers' model volume
    mounted read-only."""
    on = {"router": {"tokenizerFromModel": True}}
    objs = render(on)
    dep = one(objs, "Deployment", "-router")
    validate(dep, KUBE_VERSION)  # at the chart's declared minimum Kubernetes
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert flag_value(c["args"], "--tokenizer-path") == "/models/Llama-3.1-70B-Instruct"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    worker = one(objs, "StatefulSet", "-decode")["spec"]["template"]["spec"]
    model_volume = next(v for v in spec["volumes"] if v["name"] == "model")
    assert model_volume == next(v for v in worker["volumes"] if v["name"] == "model")
    assert model_volume["persistentVolumeClaim"]["readOnly"] is True
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in c["env"]
    sub = _router_pod(dict(on, model={"pvc": {"subPath": "weights"}}))["containers"][0]["volumeMounts"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "weights"} in sub
    # the decode role's own tokenizer wins over model.path, as for the workers
    c = _router_pod(dict(on, decode={"args": {"tokenizer": "/models/tok"}}))["containers"][0]
    assert flag_value(c["args"], "--tokenizer-path") == "/models/tok"
    # hostPath: the same volume
    values = load_values(CHART / "ci" / "mixed-values.yaml")
    values.setdefault("router", {})["tokenizerFromModel"] = True
    host = _router_pod(values)
    assert flag_value(host["containers"][0]["args"], "--tokenizer-path") == "/models/Qwen2.5-7B-Instruct"
    assert {"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in host["volumes"]
    # image: the folder is in the (shared) image, so no mount
    image = _router_pod(dict(on, model={"source": "image"}))
    assert flag_value(image["containers"][0]["args"], "--tokenizer-path") == "/models/Llama-3.1-70B-Instruct"
    assert [v["name"] for v in image["volumes"]] == ["tmp"]


@pytest.mark.parametrize("values", [
    {},
    {"router": {"tokenizerFromModel": False}},
    {"router": {"tokenizerFromModel": True}, "model": {"source": "embedded"}},
    {"router": {"args": {"tokenizer-path": "/elsewhere"}}},
    {"router": {"extraArgs": ["--tokenizer=/elsewhere"]}},
], ids=["default", "off", "embedded", "args", "extraArgs"])
def test_router_gets_no_model_tokenizer_when_off_or_unavailable_or_named(values):
    objs = render(values)
    dep = one(objs, "Deployment", "-router")
    validate(dep, KUBE_VERSION)
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert [m["name"] for m in c["volumeMounts"]] == ["tmp"] and [v["name"] for v in spec["volumes"]] == ["tmp"]
    assert "HF_HUB_OFFLINE" not in {e["name"] for e in c["env"]}
    named = values["router"].get("args", {}).get("tokenizer-path") if "router" in values else None
    assert c["args"].count("--tokenizer-path") == (1 if named else 0)
    if named:
        assert flag_value(c["args"], "--tokenizer-path") == named


def test_network_policy_admits_router_and_peers_only():
    objs = render()
    workers = one(objs, "NetworkPolicy", "-workers")["spec"]
    from_router, from_peers = workers["ingress"]
    assert from_router["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "pd-cluster", "app.kubernetes.io/instance": "pd",
        "app.kubernetes.io/component": "router"}}}]
    assert from_router["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert from_peers["from"][0]["podSelector"] == workers["podSelector"] and "ports" not in from_peers
    assert not objects(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy")


def test_notes_tell_how_to_reach_the_endpoint_and_run_pd_bench():
    notes = render_notes()
    assert "kubectl -n llm port-forward svc/pd-pd-cluster-router 8000:8000" in notes
    assert "http://pd-pd-cluster-router.llm.svc:8000/v1" in notes
    assert "pd-bench --base-url $ROUTER" in notes and "helm test pd -n llm" in notes
    assert "get secret pd-pd-cluster-router-auth" in notes
    lb = render_notes(load_values(CHART / "ci" / "h200-4p4d-rdma-values.yaml"))
    assert "https://llm.example.com/v1" in lb and "RDMA" in lb


def test_values_files_are_valid_yaml_mappings():
    for path in [CHART / "values.yaml", *VALUE_FILES]:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path
