"""Build a C source file of `kernels/` into a shared library with the machine's C compiler, once per machine.

carpool's CPU kernels (`paged_attention_cpu.c`, `model_ops_cpu.c`) are plain
C with no Python or torch headers: `build_library` runs the compiler (`cc`,
or `$CC`) on one file and returns the library's path for ctypes to load. The
library's name hashes the source, the flags, the compiler's version and the
CPU's model and feature flags (the code is built with `-march=native`), so a
changed source, compiler or CPU gets a build of its own; it is written under
a temporary name and renamed into place, so concurrent workers never load a
partial file. A machine without a compiler, or a build that fails, gets the
reason as a string, and its callers run their torch paths.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_COMPILE_TIMEOUT_S = 120
_COMMON_FLAGS = ("-O3", "-fopenmp-simd", "-fPIC", "-shared")
_NATIVE_FLAGS = ("-march=native",)


def kernels_cache_dir(environ: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/carpool/kernels` (or `~/.cache/...`, or the temporary folder for a user without a home
    folder); call at the edge with `os.environ`."""
    base = environ.get("XDG_CACHE_HOME")
    if not base:
        try:
            base = str(Path.home() / ".cache")
        except RuntimeError:
            base = tempfile.gettempdir()
    return Path(base) / "carpool" / "kernels"


def compiler_of(environ: Mapping[str, str]) -> str:
    """The C compiler to build with: `$CC`, else `cc`; call at the edge with `os.environ`."""
    return environ.get("CC") or "cc"


def _cpu_identity() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (Linux), else the platform."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part")
    picked = {line.split(":")[0].strip(): line for line in lines if line.split(":")[0].strip() in wanted}
    return platform.machine() + platform.processor() + "".join(sorted(picked.values()))


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> str | None:
    """None when `target` was built, else the compiler's complaint."""
    try:
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as error:
        return f"cannot write in {str(target.parent)!r}: {error}"
    os.close(handle)
    partial = Path(name)
    try:
        done = subprocess.run([compiler, *flags, "-o", str(partial), str(source), "-lm"], capture_output=True,
                              text=True, timeout=_COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        os.replace(partial, target)  # atomic: a concurrent build of the same key writes the same library
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        partial.unlink(missing_ok=True)
    return None


def build_library(source: Path, flags: tuple[str, ...], build_dir: Path, compiler: str = "cc",
                  rebuild: bool = False) -> Path | str:
    """The shared library of `source` built with `flags` (besides -O3, -march=native and the shared-library
    ones) in `build_dir`, built now unless a build for this source, compiler and CPU is there (or `rebuild`,
    for one that would not load); else why not."""
    try:
        text = source.read_bytes()
    except OSError as error:
        return f"cannot read {source.name}: {error}"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"no C compiler ({compiler!r}: {type(error).__name__}: {error})"
    native, portable = _COMMON_FLAGS + flags + _NATIVE_FLAGS, _COMMON_FLAGS + flags
    key = hashlib.sha256()
    for part in (text, compiler.encode(), version.stdout.encode(), " ".join(native).encode(),
                 _cpu_identity().encode()):
        key.update(part + b"\0")
    target = build_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists() and not rebuild:
        return target
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create {str(build_dir)!r}: {error}"
    failure = _compile(compiler, source, native, target)
    if failure is not None:  # a compiler without -march=native: portable code still beats the torch path
        failure = _compile(compiler, source, portable, target)
    if failure is not None:
        return f"compiling {source.name} failed: {failure}"
    return target


def load_library(source: Path, flags: tuple[str, ...], build_dir: Path, compiler: str,
                 wrap: Callable[[Path], T]) -> T | str:
    """`wrap(library)` of `source`'s build (`build_library`); a cached build that will not load is built again
    once. Else why not."""
    failure = ""
    for rebuild in (False, True):
        library = build_library(source, flags, build_dir, compiler, rebuild=rebuild)
        if isinstance(library, str):
            return library
        try:
            return wrap(library)
        except (OSError, AttributeError) as error:  # a truncated or foreign file, or a missing symbol
            failure = f"loading {library.name} failed: {error}"
    return failure
