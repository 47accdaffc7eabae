"""Which inner optimizers are correct on row shards, and which way of owning state each gets.

With row shards a rank owns an arbitrary slice of every parameter, so the inner optimizer must
update each element from that element's gradient and state alone. Optimizers that look at a whole
tensor (factored second moments, trust ratios, orthogonalization, block-wise 8-bit states, line
search) would silently compute something else on a slice: they get whole-parameter ownership
(``partition="auto"``) or are refused on rows ([Note: two ways to own a parameter] in layout/partition.py).
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.inner.chain import ChainedOptimizer

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")
    if hasattr(torch.optim, name)
)
# torch's fused kernels on CPU: several times faster than the default for-loop on the host rows
# (benchmarks/offload.py measures it); used when the user left the kernel choice open.
FUSED_ON_CPU: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
WHOLE_TENSOR_OPTIMIZERS: tuple[str, ...] = ("Adafactor", "Muon", "Lamb", "LAMB", "Shampoo")
# Optimizers whose step cannot run under ZeRO at all, on either partition, and why: refused when built.
UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "its step() needs a closure that re-evaluates the loss, and ZeRO's step() takes none",
    "SparseAdam": "it needs sparse gradients, and ZeRO reduces dense ones",
}
# Group keys that choose a kernel, not a hyperparameter: they follow where the step runs (host rows
# with offload, the device otherwise), so a checkpoint never brings them back (``shard_state.py``).
KERNEL_CHOICES: tuple[str, ...] = ("fused", "foreach", "capturable")


def partition_for(optimizer: torch.optim.Optimizer, partition: str, allow_untested: bool) -> str:
    """``choose_partition`` for an optimizer instance; a ``ChainedOptimizer`` gets rows only when
    every optimizer in it may have them."""
    optimizers = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    choices = [choose_partition(type(o), partition, allow_untested) for o in optimizers]
    return "params" if "params" in choices else "rows"


def choose_partition(cls: type, partition: str, allow_untested: bool) -> str:
    """``"rows"`` or ``"params"`` for an inner optimizer of class ``cls`` (``partition``: a value
    ``ZeroConfig`` validated).

    ``"auto"`` picks rows for the known element-wise optimizers (and for any other class when
    ``allow_untested`` vouches that it is element-wise), whole params for everything else.
    ``"rows"`` refuses a class that is not known to be element-wise; ``"params"`` takes any.

    Example::

        >>> choose_partition(torch.optim.AdamW, "auto", allow_untested=False)
        'rows'
        >>> choose_partition(torch.optim.Adafactor, "auto", allow_untested=False)
        'params'

    Raises:
        ValueError: ``cls`` cannot run under ZeRO (``UNSUPPORTED_OPTIMIZERS``), or cannot run on
            ``partition="rows"``.
    """
    check_supported(cls)
    if partition == "params":
        return "params"
    if partition == "rows":
        check_optimizer_class(cls, allow_untested)
        return "rows"
    elementwise = issubclass(cls, ELEMENTWISE_OPTIMIZERS) or allow_untested
    return "rows" if whole_tensor_style(cls) is None and elementwise else "params"


def check_supported(cls: type) -> None:
    """Raise a clear error when ``cls`` is, or derives from, an optimizer ZeRO cannot step at all.

    Example::

        >>> check_supported(torch.optim.AdamW)
    """
    name = next((base.__name__ for base in cls.__mro__ if base.__name__ in UNSUPPORTED_OPTIMIZERS), None)
    if name is not None:
        raise ValueError(
            f"{cls.__name__} cannot run under ZeRO: {UNSUPPORTED_OPTIMIZERS[name]}. Use another optimizer "
            "(AdamW, SGD, Adafactor, ...), or train it without ZeRO (zero_stage=0)."
        )


def whole_tensor_style(cls: type) -> str | None:
    """The known whole-tensor optimizer ``cls`` is or derives from (``"Adafactor"``, ...), or None."""
    return next((base.__name__ for base in cls.__mro__ if base.__name__ in WHOLE_TENSOR_OPTIMIZERS), None)


def check_optimizer_class(cls: type, allow_untested: bool) -> None:
    """Raise a clear error unless ``cls`` updates each element from that element alone.

    Example::

        >>> check_optimizer_class(torch.optim.AdamW, allow_untested=False)
    """
    whole = whole_tensor_style(cls)
    if whole is not None:
        raise ValueError(
            f"{cls.__name__} updates each parameter from the whole tensor ({whole}-style), which is "
            "wrong on the row shards ZeRO gives each rank. Use partition='params' (or 'auto'), which "
            "gives each tensor whole to one rank, or an element-wise optimizer (AdamW, SGD, ...)."
        )
    if not issubclass(cls, ELEMENTWISE_OPTIMIZERS) and not allow_untested:
        raise ValueError(
            f"{cls.__name__} is not a known element-wise optimizer "
            f"({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}), so it cannot run on row shards. "
            "Use partition='params' (or 'auto'); or, if its update of each element depends on that "
            "element alone, pass allow_untested_optimizer=True."
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
    if isinstance(optimizer, ChainedOptimizer):
        for chained in optimizer.optimizers:
            prefer_fused_on_cpu(chained)
        return
    if type(optimizer) not in FUSED_ON_CPU:
        return
    for group in optimizer.param_groups:
        open_choice = group.get("fused") is None and group.get("foreach") is None
        if open_choice and not group.get("differentiable") and not group.get("capturable"):
            group["fused"] = True


def carry_bitsandbytes_overrides(optimizer: torch.optim.Optimizer, inner_param_of: dict[int, torch.Tensor]) -> None:
    """Point bitsandbytes' per-parameter overrides at the inner params that replaced the params.

    bitsandbytes optimizers take per-parameter settings from a process-wide manager: registered by
    module and attribute (``Trainer`` asks for 32-bit states of every ``nn.Embedding`` this way) and
    resolved at the first step by identity with the tensors in the param groups, then looked up by
    (group, position). Those tensors are now this rank's inner params (``inner_param_of``: id of
    the model's param -> its inner param), at positions of their own: resolve the overrides for them here, as the first
    step would have for the model's params. Optimizers of other libraries are left alone.
    """
    manager = getattr(optimizer, "mng", None)
    triples = getattr(manager, "module_weight_config_triple", None)
    if not triples:
        return
    position = {id(p): (g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}
    for module, attr, config in triples:
        inner_param = inner_param_of.get(id(getattr(module, attr, None)))
        if inner_param is not None and id(inner_param) in position:
            manager.pid2config[id(inner_param)] = config
            manager.index2config[position[id(inner_param)]] = config


def check_fresh_optimizer(optimizer: object) -> None:
    """Raise a clear error unless ``optimizer`` is a fresh ``torch.optim.Optimizer`` (which way it
    can own state is ``choose_partition``'s question; ``optimizer.check_inner_optimizer`` also
    refuses a ZeRO optimizer).

    Example::

        >>> check_fresh_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]))
    """
    cls = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer instance, got {cls.__name__}")
    if has_taken_steps(optimizer):
        raise ValueError(
            f"{cls.__name__} already has state (it has taken steps); wrap a freshly built optimizer "
            "and load state through LowLevelZeroOptimizer's checkpoint API instead."
        )
