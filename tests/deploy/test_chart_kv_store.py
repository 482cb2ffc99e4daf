"""The Helm chart's cluster-wide KV store (``kvStore``): a Mooncake master and its memory, and workers pointed at it."""

from __future__ import annotations

import pytest
import helm_python as helm
from chart_util import KUBE_VERSION, expand, flag_value, objects, one, render, render_at, validate

from pd_cluster.engine.args import config_from_args
from pd_cluster.launch import kv_store, worker as launch_worker

pytestmark = pytest.mark.slow  # helm renders in a process

# the engine's store is built for one rank per worker (tp-size 1) so far
ON = {"kvStore": {"enabled": True, "size": "8GiB"}, "engine": {"args": {"tp-size": 1}}}
FAKE_ENV = {"POD_IP": "10.1.2.3"}


def test_off_by_default():
    objs = render()
    assert not [o for o in objects(objs, "Deployment") if "-kv-" in o["metadata"]["name"]]
    for sts in objects(objs, "StatefulSet"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert "--hicache-storage-backend" not in c["args"]
        assert "MOONCAKE_MASTER" not in {e["name"] for e in c.get("env", [])}


def test_master_store_and_workers_pointed_at_it():
    objs = render(ON)
    master, store = one(objs, "Deployment", "-kv-master"), one(objs, "Deployment", "-kv-store")
    svc = one(objs, "Service", "-kv-master")
    for obj in (master, store, svc):
        validate(obj)  # raises on an invalid object
    parser = kv_store.build_parser()
    (mc,) = master["spec"]["template"]["spec"]["containers"]
    margs = parser.parse_args(mc["args"])
    assert mc["command"] == ["pd-kv-store"] and margs.what == "master" and margs.host == "0.0.0.0"
    assert svc["spec"]["ports"] == [{"name": "rpc", "port": margs.rpc_port, "targetPort": "rpc", "protocol": "TCP"}]
    assert svc["spec"]["selector"].items() <= master["spec"]["template"]["metadata"]["labels"].items()
    (sc,) = store["spec"]["template"]["spec"]["containers"]
    sargs = parser.parse_args([expand(a, FAKE_ENV) for a in sc["args"]])
    address = f"{svc['metadata']['name']}:{margs.rpc_port}"
    assert sargs.what == "store" and sargs.master == address and sargs.size == "8GiB" and sargs.host == "10.1.2.3"
    for tpl in (master["spec"]["template"], store["spec"]["template"]):
        (c,) = tpl["spec"]["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert tpl["spec"]["securityContext"]["runAsNonRoot"] is True
    for sts in objects(objs, "StatefulSet"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["MOONCAKE_MASTER"] == address and env["MOONCAKE_LOCAL_HOSTNAME"] == "$(POD_IP)"
        assert [e["name"] for e in c["env"]].index("POD_IP") < [e["name"] for e in c["env"]].index(
            "MOONCAKE_LOCAL_HOSTNAME")  # $(POD_IP) expands only from a variable defined before it
        ns = launch_worker.build_parser().parse_args([expand(a, FAKE_ENV) for a in c["args"]])
        assert config_from_args(ns).cache.hicache_storage_backend == "mooncake"
        assert flag_value(c["args"], "--hicache-storage-backend") == "mooncake"
    policy = one(objs, "NetworkPolicy", "-workers")
    peers = [p["podSelector"]["matchLabels"] for p in policy["spec"]["ingress"][1]["from"]]
    assert any(m.get("app.kubernetes.io/component") == "kv-store" for m in peers)


def test_an_explicit_file_store_is_kept():
    objs = render({**ON, "engine": {"args": {"tp-size": 1, "hicache-storage-backend": "file"}}})
    for sts in objects(objs, "StatefulSet"):
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args.count("--hicache-storage-backend") == 1 and flag_value(args, "--hicache-storage-backend") == "file"


def test_a_store_with_tp_size_above_one_is_refused_at_render():
    with pytest.raises(helm.HelmRenderError, match=r"not built for tp-size > 1"):
        render_at({"kvStore": {"enabled": True}}, KUBE_VERSION)
    with pytest.raises(helm.HelmRenderError, match=r"not built for tp-size > 1"):
        render_at({"engine": {"args": {"tp-size": 2, "hicache-storage-backend": "file"}}}, KUBE_VERSION)
