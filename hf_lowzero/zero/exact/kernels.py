"""Which inner-optimizer kernels keep exact reduction's promise with row shards.

With ``partition="rows"`` a rank steps its row of each parameter, and where an element sits in that
row changes with the world size. torch's fused CPU kernels (``fused=True``: Adam, AdamW, SGD, Adagrad)
compute the vectorized body of a tensor and its last few elements with different instructions, which
round differently: measured with torch 2.13, an element 16 of a 20-element row (the tail at W=2) came
out one ulp off its value at W=1 (the body), after three AdamW steps. The foreach and single-tensor
kernels compute every element alike (``tests/test_exact_reduction.py`` checks AdamW, Adam, SGD,
RMSprop and Adagrad), and whole-parameter ownership steps the same tensors at any world size. So in
exact mode the CPU is not switched to fused kernels, and a fused kernel asked for is refused.

Example::

    check_row_kernels(torch.optim.AdamW(params, fused=True), "rows", "cpu")   # ValueError
"""

from __future__ import annotations

import torch


def check_row_kernels(optimizer: torch.optim.Optimizer, partition: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` where ``optimizer`` would step row shards on the CPU with a fused kernel.

    Args:
        optimizer: The inner optimizer (a ``ChainedOptimizer``'s parts are checked each).
        partition: ``"rows"`` or ``"params"``.
        device: Where the inner step runs (the master rows' device).

    Raises:
        ValueError: A param group asks for ``fused=True`` with row shards on the CPU.
    """
    if partition != "rows" or torch.device(device).type != "cpu":
        return
    for part in getattr(optimizer, "optimizers", [optimizer]):
        if any(group.get("fused") for group in part.param_groups):
            raise ValueError(
                f"reduction='exact' with {type(part).__name__}(fused=True) on row shards on the CPU: the fused CPU "
                "kernel rounds the last elements of a row differently from the rest, and where an element sits "
                "in its row changes with the world size. Use fused=False (the foreach kernel), or "
                "partition='params'."
            )
