"""The built wheel installs exactly one top-level import name, ``pd_cluster``, with its data files."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ["common", "engine", "serving", "disagg", "prefill", "decode", "router", "transfer", "bench", "launch",
           "planner"]


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _shipped_folders() -> set[str]:
    """Folders under the role folders holding a file the wheel ships: Python, or data matching package-data."""
    patterns = _pyproject()["tool"]["setuptools"]["package-data"]["*"]
    out = set()
    for top in FOLDERS:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and (
                    path.suffix == ".py" or any(fnmatch.fnmatch(path.name, p) for p in patterns)):
                out.add(path.parent.relative_to(REPO).as_posix())
    return out


def test_package_list_matches_the_folders():
    """The package list is kept by hand: every folder with shipped files (Python or data) under a role folder is
    listed, and nothing else."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    expected = {"pd_cluster"} | {"pd_cluster." + f.replace("/", ".") for f in _shipped_folders()}
    assert listed == expected, f"missing: {sorted(expected - listed)}; extra: {sorted(listed - expected)}"


def test_console_scripts_point_into_the_namespace():
    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {"pd-serve", "pd-worker", "pd-router", "pd-bench", "pd-plan", "pd-generate", "pd-kv-store",
                            "pd-planner"}
    assert all(target.startswith("pd_cluster.") for target in scripts.values()), scripts


def _tracked_copy(dest: Path) -> Path:
    """The repository's tracked files (the working tree's versions), copied to `dest`: a build there sees no
    untracked file and no earlier build's ``build/`` (setuptools would ship whatever that still holds)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.mark.slow
def test_wheel_has_one_top_level_package(tmp_path):
    src = _tracked_copy(tmp_path / "src")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pd_cluster-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pd_cluster"}, tops
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["pd_cluster"]
    for needed in ["pd_cluster/__init__.py", "pd_cluster/engine/llm.py", "pd_cluster/serving/openai_serving.py",
                   "pd_cluster/engine/assets/stories260K/model.safetensors",
                   "pd_cluster/engine/assets/stories260K/config.json",
                   "pd_cluster/engine/attention/csrc/paged_decode.c",
                   "pd_cluster/bench/data/azure_code_1000.csv"]:
        assert needed in names, f"{needed} not in the wheel"
    assert not any(n.startswith("pd_cluster/tests/") or n.startswith("pd_cluster/docs/") for n in names)
    assert "pd_cluster/README.md" not in names, "the repository's README is the project description, not package data"
    assert "pd_cluster/engine/assets/stories260K/README.md" in names  # the embedded model's card stays
