"""The Dockerfile (not buildable here: no Docker engine) agrees with pyproject.toml, the README and the chart."""

from __future__ import annotations

import fnmatch
import re
import tomllib

import yaml
from chart_util import CHART, ROOT, WORKER_ROLES, all_pod_templates, render

DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def ignored(path: str) -> bool:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def test_build_context_keeps_what_pip_install_needs():
    needed = ["pyproject.toml", PYPROJECT["project"]["readme"]]
    root = PYPROJECT["tool"]["setuptools"]["package-dir"]["pd_cluster"]  # "." : the role folders are the package
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    needed += ["__init__.py"] + sorted({p.split(".")[1] for p in packages if "." in p})
    needed = [str((ROOT / root / p).relative_to(ROOT)) for p in needed]
    for path in needed:
        assert not ignored(path), path
    assert ignored(".git") and ignored("tests/deploy/test_dockerfile.py") and ignored("helm/pd-cluster/values.yaml")


def test_extras_scripts_and_torch_pin_exist():
    (extras,) = re.findall(r'pip install "/tmp/pd-cluster\[([a-z0-9,]+)\]"', DOCKERFILE)
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


def _apt_packages() -> set[str]:
    pkgs: set[str] = set()
    for block in re.findall(r"apt-get install([^\n\\]*(?:\\\n[^\n\\]*)*)", DOCKERFILE):
        block = block.split("&&")[0]
        pkgs |= {w for w in re.split(r"[\s\\]+", block) if re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", w)}
    return pkgs


def test_triton_can_compile_in_the_image():
    """Triton builds each kernel's launcher with a C compiler against Python.h: both must be in the image
    (or in its base, a CUDA -devel image), and the chart's Triton cache must sit on a writable volume."""
    (base,) = re.findall(r"^ARG CUDA_IMAGE=(\S+)$", DOCKERFILE, re.M)
    pkgs = _apt_packages()
    devel_base = "-devel-" in base
    assert devel_base or pkgs & {"gcc", "clang", "build-essential"}, "no C compiler in the image"
    assert devel_base or pkgs & {"build-essential", "libc6-dev"}, "no C library headers in the image"
    assert {"python3", "python3-dev"} <= pkgs, "no Python headers (Python.h) for the python3 in the image"
    assert re.search(r"^RUN cc --version", DOCKERFILE, re.M) and "Python.h" in DOCKERFILE  # checked at build time
    workers = [(label, tpl) for label, tpl, _ in all_pod_templates(render())
               if any(label.split("/")[0].endswith(f"-{role}") for role in WORKER_ROLES)]
    assert len(workers) >= 2  # prefill and decode
    for label, tpl in workers:
        (c,) = [c for c in tpl["spec"]["containers"] if any(e["name"] == "TRITON_CACHE_DIR" for e in c.get("env", []))]
        cache_dir = next(e["value"] for e in c["env"] if e["name"] == "TRITON_CACHE_DIR")
        assert c["securityContext"]["readOnlyRootFilesystem"] is True  # so the cache must be on a volume
        (mount,) = [m for m in c["volumeMounts"] if cache_dir.startswith(m["mountPath"].rstrip("/") + "/")]
        assert not mount.get("readOnly"), label
        (volume,) = [v for v in tpl["spec"]["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in volume, f"{label}: {cache_dir} is not on a writable volume"


def test_apt_package_parser_sees_the_install_line():
    """The check above can fail: the parser finds the packages the Dockerfile lists, not just any word."""
    pkgs = _apt_packages()
    assert {"rdma-core", "ca-certificates", "python3-venv"} <= pkgs and "apt-get" not in pkgs
