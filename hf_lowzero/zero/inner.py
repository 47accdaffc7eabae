"""Which inner optimizers are correct on shards.

A rank owns an arbitrary slice of every parameter, so the inner optimizer must update each element
from that element's gradient and state alone. Optimizers that look at a whole tensor (factored
second moments, trust ratios, orthogonalization, line search) would silently compute something
else on a slice; they are refused.
"""

from __future__ import annotations

import torch

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
# torch's fused kernels on CPU: several times faster than the default for-loop on the host rows
# (benchmarks/offload.py measures it); used when the user left the kernel choice open.
FUSED_ON_CPU: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
WHOLE_TENSOR_OPTIMIZERS: tuple[str, ...] = ("Adafactor", "LBFGS", "Muon", "SparseAdam", "Lamb", "LAMB", "Shampoo")


def check_optimizer_class(cls: type, allow_untested: bool) -> None:
    """Raise a clear error unless ``cls`` updates each element from that element alone.

    Example::

        >>> check_optimizer_class(torch.optim.AdamW, allow_untested=False)
    """
    whole = next((base.__name__ for base in cls.__mro__ if base.__name__ in WHOLE_TENSOR_OPTIMIZERS), None)
    if whole is not None:
        raise ValueError(
            f"{cls.__name__} updates each parameter from the whole tensor ({whole}-style), which is "
            "wrong on the row shards ZeRO gives each rank. Use an element-wise optimizer "
            "(AdamW, Adam, SGD, Adagrad, RMSprop, ...)."
        )
    if not issubclass(cls, ELEMENTWISE_OPTIMIZERS) and not allow_untested:
        raise ValueError(
            f"{cls.__name__} is not a known element-wise optimizer "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}). If its update of each "
            "element depends on that element alone, pass allow_untested_optimizer=True."
        )


def has_taken_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds state from steps it took. State its constructor creates (Adagrad's
    ``sum`` and ``step`` = 0) is not: there every entry carries a ``step`` of 0.

    Example::

        >>> has_taken_steps(torch.optim.Adagrad([torch.nn.Parameter(torch.ones(2))]))
        False
    """
    return any(entry and float(entry.get("step", 1)) > 0 for entry in optimizer.state.values())


def prefer_fused_on_cpu(optimizer: torch.optim.Optimizer) -> None:
    """For rows in host memory (offload, or a CPU model): switch groups whose kernel is left to
    torch's default (``fused`` and ``foreach`` both None) to the fused CPU kernel."""
    if type(optimizer) not in FUSED_ON_CPU:
        return
    for group in optimizer.param_groups:
        open_choice = group.get("fused") is None and group.get("foreach") is None
        if open_choice and not group.get("differentiable") and not group.get("capturable"):
            group["fused"] = True
