"""The compile-and-load path of our C++ kernels (``hf_lowzero/zero/runtime/native.py``)."""

from __future__ import annotations

import ctypes
import hashlib

import pytest
import torch

from hf_lowzero.zero.runtime import native

SOURCE = """
#include <cstdint>
extern "C" void axpy(float* y, const float* x, float a, int64_t n) {
  #pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] + a * x[i];
}
"""


def test_a_kernel_compiles_once_and_computes_what_torch_computes(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "axpy.cpp"
    source.write_text(SOURCE)
    library = native._load(source)
    if isinstance(library, native.NativeUnavailable) and "no C++ compiler" in library.why:
        pytest.skip(library.why)
    assert not isinstance(library, native.NativeUnavailable), library.why
    built = list((tmp_path / "cache").glob("libaxpy_*.so"))
    assert len(built) == 1
    x, y = torch.randn(1000), torch.randn(1000)
    expected = y + 0.5 * x  # two roundings, as the kernel (no FMA contraction: [Note: native kernels])
    library.axpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_int64]
    library.axpy(y.data_ptr(), x.data_ptr(), 0.5, y.numel())
    assert torch.equal(y, expected)
    native._load(source)  # cached: no second library
    assert list((tmp_path / "cache").glob("libaxpy_*.so")) == built


def test_without_a_compiler_or_when_switched_off_the_reason_is_given(tmp_path, monkeypatch):
    source = tmp_path / "axpy.cpp"
    source.write_text(SOURCE)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    missing = native._load(source)
    assert isinstance(missing, native.NativeUnavailable) and "no C++ compiler" in missing.why
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert native._load(source) == native.NativeUnavailable(f"{native.SWITCH_ENV}=0")


def test_a_source_that_does_not_compile_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++")
    broken = native._load(source)
    if "no C++ compiler" in getattr(broken, "why", ""):
        pytest.skip(broken.why)
    assert isinstance(broken, native.NativeUnavailable) and "compiling broken.cpp failed" in broken.why
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-written left behind


def test_a_damaged_library_in_the_cache_is_rebuilt_not_loaded(tmp_path, monkeypatch, caplog):
    """[Note: a checked cache]: the sha256 recorded at build time is checked before every load."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "axpy.cpp"
    source.write_text(SOURCE)
    if isinstance(first := native._load(source), native.NativeUnavailable):
        pytest.skip(first.why)
    (built,) = (tmp_path / "cache").glob("libaxpy_*.so")
    assert (tmp_path / "cache" / (built.name + ".sha256")).read_text() == hashlib.sha256(built.read_bytes()).hexdigest()
    built.unlink()  # a new file, as a damaged or replaced one (the loaded one stays mapped, unharmed)
    built.write_bytes(b"\x7fELF not the library we built")
    with caplog.at_level("WARNING", logger=native.__name__):
        library = native._load(source)
    assert f"{built} does not match the sha256 recorded when it was built; rebuilding it" in caplog.text
    assert not isinstance(library, native.NativeUnavailable), library.why
    rebuilt = built.read_bytes()
    assert rebuilt.startswith(b"\x7fELF") and b"not the library" not in rebuilt
    assert (tmp_path / "cache" / (built.name + ".sha256")).read_text() == hashlib.sha256(rebuilt).hexdigest()
