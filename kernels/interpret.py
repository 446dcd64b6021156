"""Whether a Triton kernel can run on a tensor's device.

`triton.jit` decides at decoration time (module import) between compiling
for the GPU and the numpy interpreter, so `TRITON_INTERPRET=1` has to be
in the environment before `kernels` is first imported.
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel: object) -> bool:
    return isinstance(kernel, InterpretedFunction)


def check_launchable(device: torch.device, kernel: object) -> None:
    """Raise a clear error instead of Triton's obscure one for CPU tensors without the interpreter."""
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "the Triton attention backend got CPU tensors, but its kernels were compiled for the GPU: "
            "set TRITON_INTERPRET=1 in the environment before importing `kernels` to run them on CPU, "
            'or use attention_backend="torch"'
        )
