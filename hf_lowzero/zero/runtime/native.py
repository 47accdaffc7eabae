"""Small C++ kernels of our own, compiled on first use and called through ``ctypes``.

A kernel is one C++ file of plain ``extern "C"`` functions on raw pointers (no torch headers: it
compiles in about a second). ``load`` compiles it with the system's ``g++`` (or ``$CXX``) into the
cache (``$HF_LOWZERO_CACHE``, default ``~/.cache/hf_lowzero``, the fake device's cache too), once per
source, flags and CPU, and loads it. Where no compiler is found, or ``HF_LOWZERO_NATIVE=0``, or the
build fails, ``load`` returns a ``NativeUnavailable`` record saying why, and the caller keeps its torch
path; the reason is logged once per kernel.

Example::

    library = native.load(Path(__file__).with_name("host_adamw.cpp"))
    if isinstance(library, native.NativeUnavailable):
        ...                                   # library.why: what to install, or what failed
    else:
        library.my_kernel.argtypes = [...]    # ctypes releases the GIL for the call

# [Note: native kernels]
# ``-march=native`` is safe because the cache key holds the CPU's flags (``/proc/cpuinfo``), so a home
# directory shared by machines of different CPUs builds one library per CPU. ``-ffp-contract=off``:
# the compiler may not fuse a multiply and an add into one FMA on its own, so every rounding in a
# kernel is one its source writes down (a kernel that must round like another writes its FMAs by
# hand). ``-fopenmp``: kernels split their rows over ``omp_set_num_threads`` threads, which the
# caller sets from ``torch.get_num_threads()`` (the worker's cores).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "HF_LOWZERO_CACHE"
SWITCH_ENV = "HF_LOWZERO_NATIVE"  # "0": never compile or load a kernel (the torch paths run)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


@dataclass(frozen=True)
class NativeUnavailable:
    """Why a kernel could not be loaded (the caller's torch path runs instead)."""

    why: str


_loaded: dict[Path, ctypes.CDLL | NativeUnavailable] = {}


def load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | NativeUnavailable:
    """The compiled ``source`` (built on first use, cached), or why not. Memoized per process.
    ``extra_flags``: g++ flags after FLAGS, for this kernel (e.g. ``-fno-math-errno``)."""
    source = Path(source).resolve()
    if source not in _loaded:
        _loaded[source] = _load(source, extra_flags)
        if isinstance(_loaded[source], NativeUnavailable):
            logger.info("[hf_lowzero] %s not used: %s", source.name, _loaded[source].why)
    return _loaded[source]


def _load(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | NativeUnavailable:
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return NativeUnavailable(f"{SWITCH_ENV}=0")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return NativeUnavailable("no C++ compiler (g++ or $CXX) on PATH; install one (e.g. apt install g++)")
    text = source.read_bytes()
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(text + " ".join(flags).encode() + compiler.encode() + _cpu_flags().encode()).hexdigest()
    cache = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "hf_lowzero"))
    target = cache / f"lib{source.stem}_{key[:16]}.so"
    checked = _matches_recorded_digest(target)  # [Note: a checked cache]
    if target.is_file() and not checked:
        logger.warning("[hf_lowzero] %s does not match the sha256 recorded when it was built; rebuilding it", target)
    if not checked:
        cache.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")  # another process may build it meanwhile
        built = subprocess.run([compiler, *flags, str(source), "-o", str(partial)], capture_output=True, text=True)
        if built.returncode != 0:
            partial.unlink(missing_ok=True)
            return NativeUnavailable(f"compiling {source.name} failed:\n{built.stderr[-1500:]}")
        digest = _digest_path(target)
        digest.with_suffix(f".{os.getpid()}.partial").write_text(_sha256(partial))
        os.replace(digest.with_suffix(f".{os.getpid()}.partial"), digest)
        os.replace(partial, target)  # atomic: a reader sees no half-written library
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        return NativeUnavailable(f"loading {target} failed: {error}")


# [Note: a checked cache] A library in the cache is loaded only if its sha256 is the one recorded
# beside it (``<library>.sha256``) when this code built it: a library damaged or replaced in the cache
# is rebuilt, not loaded. This guards against corruption and stray files; whoever can write the cache
# can write the digest too, so it is no defence against tampering: keep the cache private.
def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _matches_recorded_digest(library: Path) -> bool:
    try:
        return _digest_path(library).read_text().strip() == _sha256(library)
    except OSError:
        return False


def _cpu_flags() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), or the machine's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()
