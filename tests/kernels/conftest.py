"""Kernel tests run the Triton kernels in Triton's interpreter when there is no CUDA device.

The variable must be set before anything imports ``triton`` (its own library
functions are decorated at import), so it is set here, when pytest loads this
folder, rather than in the tests.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
