"""Exact reduction's passes over a bucket ([Note: exact reduction] in ``__init__.py``): rounding a
packed bucket to the grid, the maxima of this rank's int64 sums, and their conversion back.

Each pass has two implementations that give the same bits:
- on the CPU, a C++ kernel (``fixed_point.cpp``, built by ``runtime/native.py``) that reads the buffer
  once, on ``torch.get_num_threads()`` threads;
- elsewhere (CUDA, or where no compiler is found), torch ops per parameter segment.
``tests/test_exact_fixed_point.py`` checks that they agree, NaN, inf, huge and tiny values included.

Example::

    quantize(packed, values, factors, max_abs, out, add=False)   # out: int64 of values * 2**s, truncated
    int_max_abs(owned, sums, maxima)                              # maxima[slot] = float64 max |sum|
    convert(owned, sums, factors, square_factors, rows, squares)  # rows = fp32(sums * factor); squares
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from hf_lowzero.zero.exact.segments import Segments
from hf_lowzero.zero.runtime import native

SOURCE = Path(__file__).with_name("fixed_point.cpp")
_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "exact_quantize": [_POINTER, _SIZE, _SIZE, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER]
    + [ctypes.c_int, ctypes.c_int],
    "exact_int_max_abs": [_POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, ctypes.c_int],
    "exact_convert": [_POINTER, _SIZE, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER]
    + [ctypes.c_int],
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load(SOURCE)
    if isinstance(library, native.NativeUnavailable):
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = None
    return library


def native_kernels(*tensors: tuple[torch.Tensor, torch.dtype]) -> ctypes.CDLL | None:
    """The C++ kernels where every tensor is a plain, contiguous CPU one of the dtype it is paired with
    (not a memory plan's fake tensor: no data to read), and they could be built; else None."""
    if all(_plain(t) and t.device.type == "cpu" and t.is_contiguous() and t.dtype == dtype for t, dtype in tensors):
        return _library()
    return None


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter


def _doubles(values: list[float]) -> ctypes.Array:
    return (ctypes.c_double * len(values))(*values)


def _table(segments: Segments) -> tuple[int, int, int]:
    """Pointers to ``segments``' slots, starts and lengths (int64, CPU)."""
    base, stride = segments.table.data_ptr(), segments.table.stride(0) * 8
    return base, base + stride, base + 2 * stride


def quantize(
    packed: Segments,
    values: torch.Tensor,
    factors: list[float],
    max_abs: torch.Tensor,
    out: torch.Tensor,
    *,
    add: bool,
    use_native: bool = True,
) -> None:
    """Round ``values`` (fp32, 1D, ``packed.rows * packed.cols``) to the grid in int64: each element
    times its param's factor (``factors``: a power of two per listed param), truncated toward zero,
    written to ``out`` (int64, like ``values``), or added into it with ``add``. ``max_abs`` (fp32,
    ``[params]``) takes each listed param's largest |value| where larger (inf for a NaN). ``values``
    may be scaled in place. ``use_native=False``: the torch ops (the tests' reference)."""
    if not packed.slots:
        return
    library = (
        native_kernels((values, torch.float32), (max_abs, torch.float32), (out, torch.int64)) if use_native else None
    )
    if library is not None:
        library.exact_quantize(
            values.data_ptr(),
            packed.rows,
            packed.cols,
            len(packed.slots),
            *_table(packed),
            _doubles(factors),
            max_abs.data_ptr(),
            out.data_ptr(),
            int(add),
            torch.get_num_threads(),
        )
        return
    seen = packed.max_abs(values).nan_to_num_(nan=math.inf, posinf=math.inf)  # a non-finite gradient: inf
    max_abs[packed.index] = torch.maximum(max_abs[packed.index], seen)
    packed.scale(values, factors)  # by powers of two: exact
    out.add_(values.to(out.dtype)) if add else out.copy_(values)  # truncated toward zero


def int_max_abs(owned: Segments, sums: torch.Tensor, maxima: torch.Tensor, *, use_native: bool = True) -> None:
    """``maxima[slot]`` (float64) = the largest |value| of each listed param's int64 ``sums``,
    rounded to float64 (monotonically: the rounded maximum of the rounded values)."""
    if not owned.slots:
        return
    library = native_kernels((sums, torch.int64), (maxima, torch.float64)) if use_native else None
    if library is not None:
        slots, starts, lengths = _table(owned)
        library.exact_int_max_abs(
            sums.data_ptr(), len(owned.slots), slots, starts, lengths, maxima.data_ptr(), torch.get_num_threads()
        )
        return
    maxima[owned.index] = owned.max_abs(sums).to(torch.float64)


def convert(
    owned: Segments,
    sums: torch.Tensor,
    factors: list[float],
    square_factors: list[float],
    rows: torch.Tensor,
    squares: torch.Tensor,
    *,
    use_native: bool = True,
) -> None:
    """``rows`` (fp32) = ``fp32(float64(sums) * factor)`` per listed param (``factors``, one each);
    ``squares[slot]`` (float64) = the sum of its values' squares (in float64, before the rounding to
    fp32) times its ``square_factors`` entry (a power of two), each rounded to an integer: exact when
    the grid keeps the sum below 2**53 (``grid.square_exponents``)."""
    if not owned.slots:
        return
    library = (
        native_kernels((sums, torch.int64), (rows, torch.float32), (squares, torch.float64)) if use_native else None
    )
    if library is not None:
        slots, starts, lengths = _table(owned)
        library.exact_convert(
            sums.data_ptr(),
            len(owned.slots),
            slots,
            starts,
            lengths,
            _doubles(factors),
            _doubles(square_factors),
            rows.data_ptr(),
            squares.data_ptr(),
            torch.get_num_threads(),
        )
        return
    values = sums.to(torch.float64)
    owned.scale(values, factors)
    rows.copy_(values)  # the rounding to fp32
    values.square_()  # the norm of the float64 values: deterministic, a 2**-24 relative step from fp32's
    owned.scale(values, square_factors)  # exact: powers of two
    values.round_()
    squares[owned.index] = owned.sums(values)  # integers summing below 2**53: exact in float64
