"""torch set-up for every test folder that loads torch; its conftest imports this module first.

Test models are tiny, so an op has nothing worth splitting across threads, and on a
CI box whose few cores are busy the intra-op pool's threads wait on each other: one
engine `generate` of 32 prompts took 16.8 s with torch's default threads and 0.7 s
with one. Every test in the session (and every in-process worker) runs single-threaded.

Triton picks compiling or its numpy interpreter when a kernel is defined (at
import), so without a GPU the interpreter goes on before any test imports `kernels`.
"""

from __future__ import annotations

import os

import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
