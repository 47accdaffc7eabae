"""Exact reduction (``ZeroConfig(reduction="exact")``): gradients summed in integers, so a run's bits do
not depend on the world size.

- ``grid.py``: the per-parameter fixed-point grid, its overflow test and how it follows the gradients
  (pure arithmetic on host numbers);
- ``segments.py``: where each parameter lies in a packed bucket and in this rank's chunk;
- ``fixed_point.py``: the passes over a bucket (rounding to the grid, the sums' maxima, the conversion
  back), C++ kernels on the CPU (``fixed_point.cpp``) with the same bits as the torch ops elsewhere;
- ``reducer.py``: ``ExactReducer``, quantizing each micro-batch's bucket and summing it in int64;
- ``step.py``: ``ExactStepStats``, the step's decision: conversion back to float, the exact norm, skips;
- ``kernels.py``: the inner optimizer's kernels that compute an element alike wherever it sits in a row,
  and the warning when a GPU's kernels are not deterministic.

Example::

    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), reduction="exact")
    for micro_batch in my_share_of_the_global_batch:     # global micro-batch m goes to rank m % W
        opt.backward(model(**micro_batch).loss)         # each micro-batch's own loss, not divided by K
    opt.step()                                           # the mean over all micro-batches of all ranks

# [Note: exact reduction]
# A float sum depends on its order, and the order depends on the world size W (how many micro-batches
# each rank adds locally, how the collective adds the ranks). An integer sum does not. So with
# reduction="exact" every contribution (one micro-batch's gradient of one parameter, on one rank) is
# scaled to a fixed-point grid 2^-s_p (s_p per parameter; by a power of two: exact) and converted to
# int64, truncating toward zero, each as its bucket is packed. (The grid keeps 50 - log2(N) bits
# below a parameter's largest contribution once it has one step's history, so the truncation's bias
# is far below fp32's rounding; a separate rounding pass cost 10% of the quantization on CPU.) The
# int64 values are summed exactly: over micro-batches into this rank's int64 accumulator, and over
# ranks by an int64 SUM reduce-scatter (gloo and NCCL sum int64). At the step the sum is converted
# back once: x = fp32(float64(S) * c_p), c_p = float64(2^-s_p / D), D the number of contributions of
# the step over all ranks (the mean; 1 where the losses were normalized globally already, as the
# Trainer's token-count normalization does). Every value that enters this is the same at any W,
# given the same global micro-batches and deterministic kernels, so x is too, bit for bit.
# - The grid is a function of state every W shares: the previous step's global max |contribution|
#   per parameter M_p (an all-reduce MAX: exact, order-free) and the largest number of contributions
#   per step seen so far, N. With every |q| <= 2^(62 - ceil(log2 N)), no partial sum of N of them
#   leaves int64, in any order. s_p puts M_p HEADROOM_BITS below that bound. The first step, with no
#   history, assumes at most 2^16 contributions of magnitude at most 2^16 (fp16's whole range).
# - Overflow: a contribution beyond the bound, or more contributions than assumed. Whether that
#   happened depends only on the set of contributions, so every rank at every W sees the same answer
#   in the same all-reduce MAX, and the step is skipped (as for a non-finite gradient); the grid then
#   widens from the maxima observed. Non-finite gradients are flagged before quantizing, as inf maxima.
# - The norm: per parameter, the sum of squares of the converted values (in float64, before their
#   rounding to fp32: the same function of S at any W), each square rounded to a grid 2^-t_p chosen
#   from the parameter's global max so that its sum stays below 2^53 (exact in float64, in any order:
#   the ranks' partial sums are summed by an all-reduce SUM); the parameters' sums are then added on
#   the host, exactly rounded (``math.fsum``), in parameter order.
# - Two host syncs per step (the maxima, then the squares), where "ddp" has one: the conversion needs
#   every rank's maxima and counts.
# What it does not make invariant, the caller must: the micro-batches themselves (the same global
# micro-batches, dealt to ranks in any way), the loss normalization (each micro-batch's own loss), and
# the RNG (seeded per global micro-batch). The Trainer does all three (``trainer/exact.py``).
"""

from hf_lowzero.zero.exact.kernels import determinism_warning, use_row_invariant_kernels
from hf_lowzero.zero.exact.reducer import ExactReducer
from hf_lowzero.zero.exact.step import ExactStepStats

__all__ = ["ExactReducer", "ExactStepStats", "determinism_warning", "use_row_invariant_kernels"]
