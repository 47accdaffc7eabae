"""The squared L2 norm of this rank's gradient rows, accurate and at fp32 speed.

Example::

    >>> rows = [torch.full((2048,), 0.5), torch.ones(16)]   # block norms 16, 16 and 4
    >>> squared_norm(rows).item()
    528.0

# [Note: blocked norm]
# The global norm must be the true norm of the averaged gradients (clipping multiplies every row by
# clip / norm), over rows of millions of elements. A single fp32 reduction drifts with the length of
# the row: on this CPU kernel, 1.1e-4 relative at 2.8M elements (``benchmarks/step_ab.py``) and 2.4e-3
# at 40M. Summing in float64 is exact enough but runs at float64 speed: one float64 reduction over a
# 2.8M row (GPT-2 4x256 at W=2) took 1.1-4.7 ms, up to 3% of that step, against 0.21 ms in fp32.
# So each row is cut into blocks of NORM_BLOCK elements, each block's norm is taken in fp32 (short
# sums do not drift: 1.6e-9 relative at 2.8M elements), and the squares of the block norms are summed
# in float64, one vectorized reduction per row: per bucket, not per parameter.
# An fp32 square overflows above 1.8e19, where float64 would not; a non-finite result is therefore
# recomputed in float64, so only gradients that are truly inf/nan make the norm non-finite (a
# skipped step), exactly as before. The step asks only once its one host sync has brought the
# all-reduced total back (``update/step.py``): ``blocked_squared_norm`` itself never looks at a value.
"""

from __future__ import annotations

import torch

NORM_BLOCK = 1024  # elements per fp32 partial norm


def squared_norm(rows: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of ``rows`` (1D tensors of any float dtype, one device),
    as a 0-d float64 tensor on their device (CPU when ``rows`` is empty). See [Note: blocked norm]."""
    total = blocked_squared_norm(rows)
    if not torch.isfinite(total):  # an fp32 square overflowed, or a gradient is inf/nan: float64 decides
        total = float64_squared_norm(rows)
    return total


def blocked_squared_norm(rows: list[torch.Tensor]) -> torch.Tensor:
    """``squared_norm`` without the float64 fallback: fp32 block norms summed in float64, on the
    rows' device, never read on the host (not finite when a square overflowed fp32)."""
    partial = []
    for row in rows:
        whole = row.numel() - row.numel() % NORM_BLOCK
        if whole:
            blocks = row[:whole].reshape(-1, NORM_BLOCK)
            partial.append(torch.linalg.vector_norm(blocks, dim=1, dtype=torch.float32))
        if whole < row.numel():
            partial.append(torch.linalg.vector_norm(row[whole:], dtype=torch.float32).reshape(1))
    if not partial:
        return torch.zeros((), dtype=torch.float64)
    return torch.cat(partial).double().square().sum()


def float64_squared_norm(rows: list[torch.Tensor]) -> torch.Tensor:
    """``squared_norm`` as one float64 reduction per row: exact, at float64 speed."""
    rows = [row for row in rows if row.numel()]
    if not rows:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(rows, 2, dtype=torch.float64)).square().sum()
