"""The inner optimizer's kernels with row shards in exact mode: only those that compute an element alike
wherever it sits in its row.

With ``partition="rows"`` a rank steps its row of each parameter, and where an element sits in that
row changes with the world size. torch's fused CPU kernels (``fused=True``: Adam, AdamW, SGD, Adagrad)
compute the vectorized body of a tensor and its last few elements with different instructions, which
round differently: measured with torch 2.13, element 16 of a 20-element row (the tail at W=2) came out
one ulp off its value at W=1 (the body), after three AdamW steps. The foreach and single-tensor kernels
compute every element alike (``tests/test_exact_reduction.py`` checks AdamW, Adam, SGD, RMSprop and
Adagrad), and whole-parameter ownership steps the same tensors at any world size. So in exact mode the
CPU is not switched to fused kernels, and a group that asks for one (transformers' default optimizer,
``adamw_torch_fused``, does) is switched to foreach, with a warning.

On a GPU the model's own kernels must be deterministic too: with torch's deterministic algorithms off,
``index_add_`` (an embedding's backward), other atomic-add kernels and the memory-efficient attention's
backward sum in an order that changes from run to run, so no two runs agree, at any world size.
``determinism_warning`` says so, once, when an exact optimizer is built over CUDA params.

Example::

    inner = torch.optim.AdamW(params, fused=True)
    use_row_invariant_kernels(inner, "rows", torch.device("cpu"))   # now foreach=True, fused=False
    determinism_warning(torch.device("cuda", 0))   # a warning's text, or None when deterministic
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def use_row_invariant_kernels(optimizer: torch.optim.Optimizer, partition: str, device: torch.device | str) -> None:
    """Switch ``optimizer``'s groups that ask for a fused kernel to foreach, where it steps row shards
    on the CPU (see the module docstring).

    Args:
        optimizer: The inner optimizer (a ``ChainedOptimizer``'s parts each).
        partition: ``"rows"`` or ``"params"``.
        device: Where the inner step runs (the master rows' device).
    """
    if partition != "rows" or torch.device(device).type != "cpu":
        return
    for part in getattr(optimizer, "optimizers", [optimizer]):
        fused = [group for group in part.param_groups if group.get("fused")]
        for group in fused:
            group["fused"], group["foreach"] = False, True
        if fused:
            logger.warning(
                "[hf_lowzero] reduction='exact': %s(fused=True) switched to foreach: on the CPU the fused kernel "
                "rounds the last elements of a row differently from the rest, and where an element sits in its "
                "row changes with the world size (partition='params' keeps fused kernels)",
                type(part).__name__,
            )


def determinism_warning(device: torch.device | str) -> str | None:
    """What to tell a user of exact mode whose params are on ``device``: None on the CPU or where
    ``torch.are_deterministic_algorithms_enabled()``; on CUDA otherwise, what breaks and what to set."""
    if torch.device(device).type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return None
    return (
        "reduction='exact' on CUDA with torch's deterministic algorithms off: index_add_ (an embedding's "
        "backward), atomic-add kernels and the memory-efficient attention's backward sum in a run-dependent "
        "order, so runs at different world sizes (or twice at one) will differ despite the exact reduction. "
        "Call torch.use_deterministic_algorithms(True) and set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the "
        "environment before CUDA starts."
    )
