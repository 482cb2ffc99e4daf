"""The Helm chart generates the cluster's internal key once and gives it to the router and every worker."""

from __future__ import annotations

import base64

from chart_util import objects, one, render


def _key_refs(pod_spec: dict) -> list[dict]:
    return [e["valueFrom"]["secretKeyRef"] for c in pod_spec["containers"] for e in c.get("env", [])
            if e["name"] == "PD_INTERNAL_API_KEY"]


def test_router_and_workers_read_one_generated_internal_key():
    objs = render({})
    secret = one(objs, "Secret", "-internal-key")
    key = base64.b64decode(secret["data"]["internal-api-key"]).decode()
    assert len(key) == 48 and key.isalnum()
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet")
            and "template" in o.get("spec", {})]
    refs = [r for spec in pods for r in _key_refs(spec)]
    assert len(refs) >= 3  # the router, prefill and decode
    assert {(r["name"], r["key"]) for r in refs} == {(secret["metadata"]["name"], "internal-api-key")}
    for o in objs:  # the key is never in a command line or a plain env value
        assert key not in str(o) or o is secret
    assert len(objects(objs, "Secret")) >= 1
