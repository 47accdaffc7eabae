"""Unpacking a gathered bucket into many small params on the CPU with one call of our own kernel.

Example::

    scatter = row_scatter(outs, sizes, chunks=W, device=bucket.device)   # None: torch's copy instead
    scatter(gathered)                                                    # every param current

# [Note: one call per unpack]
# On the CPU, ``torch.split_with_sizes_copy`` costs a few microseconds per param, whatever its size:
# 0.8 ms of a 25 ms step for 300 tiny params at W=2 (``benchmarks/step_ab.py``, many_small_300),
# about a third of what stage 1 then cost over DDP. ``unpack_rows.cpp`` does the same copies as
# plain ``memcpy`` in one call through ``ctypes`` (~10 microseconds there), compiled on first use
# (``runtime/native.py``). It is used where every param of the bucket receives its pieces in place
# (no padding), on real CPU tensors, and where the params are small on average (at most GRAIN
# elements: below torch's grain size its copy runs on one thread too, so one thread of ours loses
# nothing); elsewhere, or without a compiler, torch's copy runs. The targets are the views the
# unpack plan holds (their storage stays alive with the plan, so a param whose storage was replaced
# after wrapping gets no write into freed memory: the wrap guard names it at the next backward). The
# kernel writes behind autograd's back, so each call bumps the params' version counters, as an
# in-place torch op would: a tensor autograd saved before the write is still caught when used.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.graph import increment_version

from hf_lowzero.zero.runtime import native

SOURCE = Path(__file__).with_name("unpack_rows.cpp")
GRAIN = 32768  # torch's internal grain size: elements per param, on average, at most


@dataclass(frozen=True, eq=False)
class RowScatter:
    """One bucket's unpack as one kernel call: the pieces' byte lengths and targets, resolved once."""

    function: object  # the kernel's ctypes function
    chunks: int
    chunk_bytes: int
    pieces: ctypes.Array
    targets: ctypes.Array
    outs: tuple[torch.Tensor, ...]  # the targets' tensors: their storage stays alive, their versions move

    def __call__(self, gathered: torch.Tensor) -> None:
        """Copy ``gathered`` (``chunks * chunk_bytes`` bytes, contiguous, on the CPU) into the params."""
        self.function(gathered.data_ptr(), self.chunks, self.chunk_bytes, len(self.outs), self.pieces, self.targets)
        increment_version(self.outs)


def row_scatter(
    outs: tuple[torch.Tensor | None, ...],
    sizes: tuple[int, ...],
    *,
    chunks: int,
    chunk_numel: int,
    device: torch.device,
) -> RowScatter | None:
    """The kernel call for a bucket whose param ``i`` receives ``sizes[i]`` elements from each of
    ``chunks`` chunks of ``chunk_numel`` into ``outs[i]`` (its rows, contiguous); None where [Note:
    one call per unpack] says torch's copy runs instead."""
    if torch.device(device).type != "cpu" or not outs or any(out is None for out in outs):
        return None
    if sum(sizes) != chunk_numel or len({out.dtype for out in outs}) != 1:
        return None
    if any(is_fake(out) or not out.is_contiguous() for out in outs) or sum(sizes) * chunks > GRAIN * len(outs):
        return None
    library = native.load(SOURCE)
    if isinstance(library, native.NativeUnavailable):
        return None
    function = library.hf_lowzero_unpack_rows
    function.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    function.restype = None
    itemsize = outs[0].element_size()
    pieces = (ctypes.c_int64 * len(outs))(*(size * itemsize for size in sizes))
    targets = (ctypes.c_void_p * len(outs))(*(out.data_ptr() for out in outs))
    return RowScatter(function, chunks, sum(sizes) * itemsize, pieces, targets, tuple(outs))
