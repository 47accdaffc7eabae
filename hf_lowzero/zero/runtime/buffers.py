"""Reusable flat buffers for bucket communication.

A bucket's collective needs bucket-sized scratch tensors (the packed gradients, the gloo
receive buffer, the all-gather output). On CUDA the caching allocator recycles them for free. On
CPU every fresh allocation of that size is new memory from the OS and pays a page fault per page
on first touch: 8 ms for a 22 MB buffer against 2 ms to reuse one (measured with torch 2.13 on
the 2-core benchmark machine), several times per step. The pool keeps returned CPU buffers and
hands out views of the smallest one that fits, so the number it holds is bounded by how many are
taken at once (buckets in flight), not by the number of buckets: a request that no free buffer
fits replaces the largest smaller free one, so mixed bucket sizes never pile up buffers (a pool
of 6 buffers shrank to 4 on GPT-2 6x512 at W=2, see benchmarks/memory.py).

Example::

    pool = BufferPool()
    flat = pool.take(numel, torch.float32, torch.device("cpu"))
    ...                       # the collective that reads or writes it has completed
    pool.give(flat)
"""

from __future__ import annotations

import torch


class BufferPool:
    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._held: list[torch.Tensor] = []  # every buffer the pool made (for the memory report)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of ``numel`` elements with unspecified contents (a view of a pooled buffer on CPU)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        free = self._free.setdefault((dtype, device), [])
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]
        if fitting:
            return free.pop(min(fitting, key=lambda i: free[i].numel()))[:numel]
        if free:  # grow: the new buffer takes the place of the largest free one (all too small)
            smaller = free.pop(max(range(len(free)), key=lambda i: free[i].numel()))
            self._held = [b for b in self._held if b is not smaller]
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self._held.append(buffer)
        return buffer

    def give(self, tensor: torch.Tensor) -> None:
        """Return a tensor from :meth:`take` once nothing (no collective in flight) uses it."""
        if tensor.device.type != "cpu":
            return
        base = tensor if tensor._base is None else tensor._base
        self._free.setdefault((base.dtype, base.device), []).append(base)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, taken or free."""
        return list(self._held)
