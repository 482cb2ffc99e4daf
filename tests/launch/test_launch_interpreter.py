"""Importing the Triton kernels changes no environment variable; the entry points choose the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast tier starts none)

CHECK = ("import os, sys; {setup}"
         "import pd_cluster.engine.attention.triton as k; "
         "print(os.environ.get('TRITON_INTERPRET'))")


def _run(setup: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", CHECK.format(setup=setup)], env=dict(clean, **env),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(300)
def test_importing_the_kernels_sets_nothing():
    assert _run("") == "None"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the choice on machines without CUDA")
@pytest.mark.timeout(300)
def test_the_entry_point_helper_chooses_the_interpreter_and_respects_an_explicit_value():
    helper = ("from pd_cluster.launch.interpreter import use_triton_interpreter_without_cuda; "
              "use_triton_interpreter_without_cuda(); ")
    assert _run(helper) == "1"
    assert _run(helper, TRITON_INTERPRET="0") == "0"
