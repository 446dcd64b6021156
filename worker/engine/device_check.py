"""Whether a device (cpu, cuda or cuda:N) is on this machine, as torch sees it.

The engine checks before it loads a model. `carpool up` runs ``python -m worker.engine.device_check DEVICE``
before it starts Redis, the gateway and its worker, as ``carpool generate`` refuses such a device at once: up's
own process is the gateway's and never imports torch. The module imports torch and nothing else of carpool's.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

EXIT_NO_DEVICE = 2
"""A device this machine has not is a usage error, as for ``carpool generate``."""


def check_device_available(device: str) -> None:
    """Raise ValueError unless `device` (cpu, cuda or cuda:N) is on this machine."""
    resolved = torch.device(device)
    if resolved.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device} asked for, but torch sees no CUDA GPU here")
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device: {device} asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")


def main(argv: Sequence[str]) -> int:
    """Exit 0 when the one device `argv` names is here; else `EXIT_NO_DEVICE`, the reason in one line on stderr."""
    (device,) = argv
    try:
        check_device_available(device)
    except (ValueError, RuntimeError) as e:  # RuntimeError: a device string torch cannot parse
        print(e, file=sys.stderr)
        return EXIT_NO_DEVICE
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
