"""The chart's rendered command lines, run for real: probe paths answer, discovery finds the pods, output is exact.

The small 1P1D values are rendered; the prefill and decode containers' command lines
start real workers and the router's starts a real router, all on loopback (host and
port rewritten to 127.0.0.1 and free ports, ``$(POD_IP)`` expanded to 127.0.0.1). The
router keeps its rendered Kubernetes discovery flags and talks to a loopback API server
that serves pods with the rendered labels and annotations, marked Ready once the rendered
readiness probe answers 200 — as the kubelet would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from chart_util import CHART, NAMESPACE, ROOT, expand, flag_value, load_values, one, render
from fake_kube_api import FakeKubeApi

from pd_cluster.launch.cluster import free_port

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to bake a cake for her mom, so she"]
API_KEY = "test-api-key"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def localize(args: list[str], port: int, rendered_port: int) -> list[str]:
    """Rendered args on loopback: --host 127.0.0.1, the free port for the rendered one, $(POD_IP) = 127.0.0.1."""
    out = [expand(a, {"POD_IP": "127.0.0.1"}).replace(f":{rendered_port}", f":{port}") for a in args]
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


def spawn(module: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def wait_200(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process serving {url} exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} did not answer 200 within {timeout} s")


def kubeconfig(path, server: str) -> str:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server}"}}}}]
users: [{{name: fake, user: {{}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: {NAMESPACE}}}}}]
current-context: fake
""")
    return str(path)


@pytest.fixture(scope="module")
def rendered():
    return render(load_values(CHART / "ci" / "small-1p1d-values.yaml"))


@pytest.mark.timeout(600)
def test_rendered_cluster_serves_exact_greedy_output_through_discovery(rendered, tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        with FakeKubeApi(NAMESPACE) as api:
            workers = {}
            for role in ("prefill", "decode"):
                tpl = one(rendered, "StatefulSet", f"-{role}")["spec"]["template"]
                c = tpl["spec"]["containers"][0]
                port = free_port()
                procs.append(spawn("pd_cluster.launch.worker", localize(c["args"], port, c["ports"][0]["containerPort"])))
                workers[role] = (tpl, c, port, procs[-1])
            for role, (tpl, c, port, proc) in workers.items():
                base = f"http://127.0.0.1:{port}"
                wait_200(base + c["startupProbe"]["httpGet"]["path"], proc, 240)
                for probe in PROBES:
                    assert httpx.get(base + c[probe]["httpGet"]["path"]).status_code == 200, (role, probe)
                assert "pd:token_usage" in httpx.get(base + "/metrics").text  # the ServiceMonitor's path
                annotations = dict(tpl["metadata"]["annotations"], **{"pd-cluster.io/port": str(port)})
                api.put_pod(f"pd-pd-cluster-{role}-0", tpl["metadata"]["labels"], "127.0.0.1", True, annotations)
            # pods of other components must not be picked up by the rendered selectors
            router_tpl = one(rendered, "Deployment", "-router")["spec"]["template"]
            api.put_pod("pd-pd-cluster-router-abc", router_tpl["metadata"]["labels"], "127.0.0.2", True,
                        {"pd-cluster.io/port": "1"})

            rc = router_tpl["spec"]["containers"][0]
            rport = free_port()
            argv = localize(rc["args"], rport, rc["ports"][0]["containerPort"])
            argv += ["--kubeconfig", kubeconfig(tmp_path / "kubeconfig", api.url)]
            env = {"PD_ROUTER_API_KEY": API_KEY, "PD_ROUTER_ADMIN_API_KEY": "admin-key"}  # from the Secret
            procs.append(spawn("pd_cluster.router.main", argv, env))
            base = f"http://127.0.0.1:{rport}"
            wait_200(base + rc["readinessProbe"]["httpGet"]["path"], procs[-1], 60)  # /readiness: a usable pair
            for probe in PROBES:
                assert httpx.get(base + rc[probe]["httpGet"]["path"]).status_code == 200, probe
            listed = httpx.get(base + "/workers", headers={"Authorization": "Bearer admin-key"}).json()["workers"]
            assert sorted((w["role"], w["url"]) for w in listed) == sorted(
                (role, f"http://127.0.0.1:{port}") for role, (_, _, port, _) in workers.items())

            assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
            client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)
            expected = offline_greedy(workers["decode"][1]["args"], 32)
            for prompt in PROMPTS:
                got = client.completions.create(model="stories260K", prompt=prompt, max_tokens=32, temperature=0)
                assert got.choices[0].text == expected[prompt], prompt
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def offline_greedy(worker_args: list[str], max_tokens: int) -> dict[str, str]:
    """The offline engine's greedy text with the rendered KV layout (dtype and page size)."""
    from pd_cluster.engine import LLM, SamplingParams

    llm = LLM(kv_cache_dtype=flag_value(worker_args, "--kv-cache-dtype"),
              page_size=int(flag_value(worker_args, "--page-size")), kv_cache_memory="64MiB")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {p: o.text for p, o in zip(PROMPTS, outs)}
