"""Run a function in a fresh Python process whose torch has fake CUDA devices.

On a CPU-only build of torch, ``FakeTensorMode`` builds ``cuda`` tensors, but autograd needs a
CUDA device guard and accelerator hooks that such a build lacks. ``fake_cuda.cpp`` (beside this
file) supplies both; it is compiled once per torch version (a few seconds with g++ and the headers
torch ships) into ``~/.cache/hf_lowzero`` and loaded before torch is imported, so it runs in a
process of its own. On a build of torch with CUDA the process starts as it is.

Example::

    result = call_on_fake_gpus(simulate_case, case)   # any picklable function and arguments

``fake_cuda_here()`` says whether this process already has CUDA for fake tensors (a real one, or
the library), where the function can be called directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hf_lowzero.process_guard import run_tied

SOURCE = Path(__file__).with_name("fake_cuda.cpp")
CACHE_ENV = "HF_LOWZERO_CACHE"

# What the fresh process runs first: the fake device before torch, then the pickled call.
_BOOT = """
import ctypes, importlib.util, os, pickle, sys, traceback
library, job, result = sys.argv[1:4]
if library:
    torch_lib = os.path.join(os.path.dirname(importlib.util.find_spec("torch").origin), "lib")
    for path in (os.path.join(torch_lib, "libc10.so"), os.path.join(torch_lib, "libtorch_cpu.so"), library):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
try:
    with open(job, "rb") as f:
        fn, args, kwargs = pickle.load(f)
    outcome = (True, fn(*args, **kwargs))
except BaseException as e:
    outcome = (False, (e, traceback.format_exc()))
with open(result, "wb") as f:
    try:
        pickle.dump(outcome, f)
    except Exception:
        f.seek(0)
        f.truncate()
        pickle.dump((False, (RuntimeError(repr(outcome[1])[:2000]), traceback.format_exc())), f)
"""


class FakeCudaUnavailable(RuntimeError):
    """No fake CUDA device can be made here (no C++ compiler, no torch headers, or a CUDA build of
    torch on a machine without a GPU)."""


def fake_cuda_here() -> bool:
    """Whether fake ``cuda`` tensors can run forward and backward in this process."""
    import torch

    if _cuda_build(Path(torch.__file__).parent):  # only with a GPU ([Note: a CUDA build without a GPU])
        return torch.cuda.device_count() > 0
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator is not None and accelerator.type == "cuda"


def _cuda_build(torch_dir: Path) -> bool:
    return bool(list((torch_dir / "lib").glob("libtorch_cuda*")))


def fake_cuda_library() -> Path | None:
    """The compiled fake device for this torch (built on first use), or None on a CUDA build."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FakeCudaUnavailable("torch is not installed")
    torch_dir = Path(spec.origin).parent
    if _cuda_build(torch_dir):
        import torch

        if torch.cuda.device_count() == 0:
            # [Note: a CUDA build without a GPU] its CUDA hooks refuse device 0 in backward
            # ("hasPrimaryContext expects a valid device index"), and the fake device cannot replace
            # them; seen with torch 2.11.0+cu130 on a machine with no GPU.
            raise FakeCudaUnavailable(
                f"this torch ({torch.__version__}) is built with CUDA but sees no GPU, and its CUDA hooks refuse "
                "fake devices; to simulate GPUs here, install torch's CPU build "
                "(pip install torch --index-url https://download.pytorch.org/whl/cpu), or run on a machine with a GPU"
            )
        return None  # a CUDA build on a GPU machine: its own guard and hooks serve fake tensors
    include = torch_dir / "include"
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None or not (include / "c10" / "core" / "impl" / "FakeGuardImpl.h").is_file():
        raise FakeCudaUnavailable(
            "simulating CUDA on this CPU-only torch compiles a small C++ library, which needs g++ (or $CXX) and "
            f"torch's headers ({include}); install a C++ compiler (e.g. apt install g++)"
        )
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + str(torch_dir).encode() + _torch_version(torch_dir).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "hf_lowzero"))
    target = cache / f"libhf_lowzero_fake_cuda_{tag}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    command = [
        compiler,
        "-O1",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={_cxx11_abi(torch_dir)}",
        f"-I{include}",
        str(SOURCE),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(partial),
    ]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        raise FakeCudaUnavailable(f"compiling {SOURCE.name} failed:\n{built.stderr[-2000:]}")
    os.replace(partial, target)
    return target


def call_on_fake_gpus(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh process with fake CUDA devices; its result, or its
    exception re-raised here (with the child's traceback as the cause)."""
    library = fake_cuda_library()
    with tempfile.TemporaryDirectory(prefix="hf_lowzero_sim_") as tmp:
        job, result = Path(tmp) / "job.pkl", Path(tmp) / "result.pkl"
        job.write_bytes(pickle.dumps((fn, args, kwargs)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [_project_root(), env.get("PYTHONPATH", "")] if p)
        # [Note: parent death] in process_guard.py: a plan killed by its caller's timeout takes the simulation along
        run = run_tied([sys.executable, "-c", _BOOT, str(library or ""), str(job), str(result)], env=env)
        if not result.is_file():
            raise RuntimeError(f"the fake-GPU process ended with exit code {run.returncode} before reporting")
        ok, value = pickle.loads(result.read_bytes())
    if ok:
        return value
    error, trace = value
    raise error from RuntimeError(f"in the fake-GPU process:\n{trace}")


def _project_root() -> str:
    """The directory holding the ``hf_lowzero`` package (for a checkout that is not installed)."""
    return str(Path(__file__).resolve().parents[2])


def _torch_version(torch_dir: Path) -> str:
    version = torch_dir / "version.py"
    return version.read_text() if version.is_file() else ""


def _cxx11_abi(torch_dir: Path) -> int:
    import torch  # this process needs no fake device: importing torch here is fine

    return int(torch._C._GLIBCXX_USE_CXX11_ABI)
