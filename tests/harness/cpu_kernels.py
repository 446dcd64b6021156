"""Build carpool's CPU kernels for a test, with the machine's C compiler; a test that needs one fails without it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kernels.cpu_build import compiler_of

T = TypeVar("T")


def compiled(load: Callable[[Path, str], T | str], build_dir: Path) -> T:
    """`load(build_dir, compiler)` (a `load_cpu_*` function), asserting that it built and loaded."""
    loaded = load(build_dir, compiler_of(os.environ))
    assert not isinstance(loaded, str), f"these tests need a C compiler (cc, or $CC): {loaded}"
    return loaded
