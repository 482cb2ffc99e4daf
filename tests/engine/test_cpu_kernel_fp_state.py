"""Loading the CPU attention kernel must not change the process's floating-point state.

A shared library linked with ``-ffast-math`` (gcc < 13) carries ``crtfastmath.o``, which turns on
flush-to-zero and denormals-are-zero for the whole process when it loads: every torch and numpy
computation afterwards silently treats subnormal floats as zero.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_cluster.engine.attention import cpu_backend

pytestmark = pytest.mark.slow  # starts a process (tests/conftest.py: the fast tier starts none)

CODE = """
import numpy as np
from pd_cluster.engine.attention import cpu_backend
tiny = np.float32(1e-40)  # a float32 subnormal
before = float(tiny * np.float32(3.0))
cpu_backend._library()
after = float(tiny * np.float32(3.0))
print(before, after)
"""


@pytest.mark.skipif(not cpu_backend.available(), reason="no C compiler for the CPU kernel")
def test_loading_the_cpu_kernel_keeps_subnormal_floats():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after = map(float, out.stdout.split())
    assert before == pytest.approx(3e-40, rel=1e-3)
    assert after == before, "loading the kernel flushed subnormals to zero (crtfastmath linked in?)"
