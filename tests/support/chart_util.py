"""Rendering the Helm chart with the real Helm engine (helm-python-sdk, Helm v4) and validating objects.

Core objects are validated against the Kubernetes OpenAPI schemas shipped by
``kubernetes-validate`` for `KUBE_VERSION`; the two CRD kinds the chart can emit
(LeaderWorkerSet, ServiceMonitor) against the field lists in ``tests/deploy/crd_schemas/``,
whose embedded pod templates and selectors resolve to the same Kubernetes definitions.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import referencing
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pd-cluster"
NEWEST_KUBE_VERSION = "1.37"  # the newest schema the validator ships


def chart_kube_floor() -> str:
    """The minor version the chart declares as its minimum (`kubeVersion: ">=1.30.0-0"` -> "1.30")."""
    declared = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    m = re.fullmatch(r">=\s*v?(\d+)\.(\d+)(?:\.\d+)?(?:-0)?", declared.strip())
    assert m, f"kubeVersion {declared!r} is not a plain >= floor"
    return f"{m.group(1)}.{m.group(2)}"


KUBE_VERSION = chart_kube_floor()  # every values file is validated at the floor it is declared for
KUBE_VERSIONS = (KUBE_VERSION, NEWEST_KUBE_VERSION)
_MIN_KUBE = re.compile(r"^# minKubeVersion: (\d+)\.(\d+)\b", re.M)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def min_kube_version(path: Path | None) -> str:
    """The oldest Kubernetes a values file is for: the chart's floor, or a higher `# minKubeVersion: X.Y` line."""
    if path is None:
        return KUBE_VERSION
    m = _MIN_KUBE.search(path.read_text())
    if not m:
        return KUBE_VERSION
    declared = f"{m.group(1)}.{m.group(2)}"
    assert _minor(declared) > _minor(KUBE_VERSION), f"{path.name}: minKubeVersion {declared} is not above the chart's"
    return declared
RELEASE = "pd"
NAMESPACE = "llm"
VALUE_FILES = sorted(CHART.glob("ci/*.yaml")) + sorted(CHART.glob("examples/*.yaml"))
CRD_SCHEMAS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-v1.json",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json"}
WORKER_ROLES = ("prefill", "decode", "mixed")


@functools.cache
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def load_values(path: Path | None) -> dict[str, Any]:
    return {} if path is None else yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart renders for `values` (release `RELEASE` in `NAMESPACE`), NOTES excluded."""
    out = []
    for path, text in sorted(chart().render(values=values or {}, name=RELEASE, namespace=NAMESPACE).items()):
        if path.endswith("NOTES.txt"):
            continue
        out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def render_at(values: dict[str, Any] | None, kube_version: str) -> list[dict[str, Any]]:
    """As `render`, as ``helm template --kube-version`` or an install on a cluster of `kube_version` ("1.32")
    renders it: ``.Capabilities.KubeVersion`` is that version, and a template's ``fail`` aborts the render
    (raises ``helm_python.HelmRenderError``), unlike under lint, where Helm only logs it. helm-python's
    ``Chart.render`` takes no Kubernetes version, so this passes Helm's own render option through its native
    call."""
    import json

    from helm_python import _native

    opts = {"name": RELEASE, "namespace": NAMESPACE, "kube_version": f"v{kube_version}.0"}
    manifests = json.loads(_native.call_string("helm_render", chart()._raw(), json.dumps(values or {}),
                                               json.dumps(opts)))
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def render_notes(values: dict[str, Any] | None = None) -> str:
    manifests = chart().render(values=values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


def objects(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name_suffix: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_templates(obj: dict) -> Iterator[tuple[str, dict]]:
    """(label, pod template) pairs of a workload; a bare Pod is its own template."""
    kind = obj["kind"]
    name = obj["metadata"]["name"]
    if kind in ("Deployment", "StatefulSet"):
        yield name, obj["spec"]["template"]
    elif kind == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        yield f"{name}/leader", lwt["leaderTemplate"]
        yield f"{name}/worker", lwt["workerTemplate"]
    elif kind == "Pod":
        yield name, obj


def all_pod_templates(objs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(label, template, owner object) of every pod the objects would create."""
    return [(label, tpl, o) for o in objs for label, tpl in pod_templates(o)]


def container_env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a command-line item."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# ---- schema validation -----------------------------------------------------------------------
@functools.cache
def _k8s_registry(version: str) -> referencing.Registry:
    import importlib.resources

    base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    defs = json.loads((base / f"v{version}.0-local-strict" / "_definitions.json").read_text())
    return referencing.Resource.from_contents(defs) @ referencing.Registry()


def validate(obj: dict, version: str = KUBE_VERSION) -> str:
    """Validate one object for Kubernetes `version` (strict: unknown fields fail); returns the schema used.

    Raises:
        jsonschema.ValidationError: the object does not validate.
    """
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is None:
        return f"kubernetes {kubernetes_validate.validate(obj, version, strict=True)}"
    schema = json.loads((ROOT / "tests" / "deploy" / "crd_schemas" / crd).read_text())
    jsonschema.Draft202012Validator(schema, registry=_k8s_registry(version)).validate(obj)
    return crd
