"""The Dockerfile (not buildable here: no Docker engine) agrees with pyproject.toml, the README and the chart."""

from __future__ import annotations

import fnmatch
import re
import tomllib

import yaml
from chart_util import CHART, ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def ignored(path: str) -> bool:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_build_context_keeps_what_pip_install_needs():
    needed = ["pyproject.toml", PYPROJECT["project"]["readme"]]
    needed += ["__init__.py", *{p.split(".")[1] for p in PYPROJECT["tool"]["setuptools"]["packages"] if "." in p}]
    for path in needed:
        assert not ignored(path), path
    assert ignored(".git") and ignored("tests/deploy/test_dockerfile.py") and ignored("helm/pd-cluster/values.yaml")


def test_extras_scripts_and_torch_pin_exist():
    (extras,) = re.findall(r'pip install "/tmp/pd-cluster\[([a-z,]+)\]"', DOCKERFILE)
    assert set(extras.split(",")) <= set(PYPROJECT["project"]["optional-dependencies"])
    scripts = set(PYPROJECT["project"]["scripts"])
    assert set(re.findall(r"\b(pd-[a-z]+) --help", DOCKERFILE)) | {"pd-serve"} <= scripts
    (pin,) = re.findall(r"ARG TORCH_VERSION=(\S+)", DOCKERFILE)
    assert f"torch=={pin}" in (ROOT / "README.md").read_text()


def test_image_user_is_the_charts_non_root_user():
    (user,) = re.findall(r"^USER (\d+):(\d+)$", DOCKERFILE, re.M)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for ctx in (values["workers"]["podSecurityContext"], values["router"]["podSecurityContext"]):
        assert (str(ctx["runAsUser"]), str(ctx["runAsGroup"])) == user and ctx["runAsNonRoot"] is True
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", DOCKERFILE, re.M)
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:[0-9.]+-runtime-ubuntu", DOCKERFILE, re.M)
