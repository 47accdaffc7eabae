"""What a forward reads: every op's tensor inputs matched against the managed params' storages, and
the module whose forward is running at the time.

Example::

    reads = ParamReads(storages, on_read)        # storages: {storage key: slot index}
    with ModuleStack() as stack, reads:
        model(**batch)                           # on_read(slot index, stack.top()) before each op that reads one

# [Note: reads seen at dispatch]
# A param can be read without its module being called: ``nn.MultiheadAttention`` passes ``out_proj``'s
# weight to a functional call, a fused fast path (``nn.TransformerEncoderLayer`` in eval) hands every
# child's weight to one kernel, a forward pre-hook (pruning, the old ``weight_norm``) reads what it wraps.
# Each of those reaches an ATen op with the param's storage among its inputs, so ``ParamReads`` watches
# at the dispatcher (a ``TorchDispatchMode``), not at the torch-function level: a torch-function mode
# would make the fast paths' ``has_torch_function`` checks fail and send them down their slow path,
# the very reads it should see. Storages, not tensor identity: a view (``p.t()``, ``p.data``) is
# another tensor over the same storage. A write (the unpack of a landed gather) is not a read, and
# ``paused()`` hides the ops of our own waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by every view of it; fake tensors have one too)."""
    return t.untyped_storage()._cdata


class ModuleStack:
    """The modules whose forwards are running, innermost last, while entered (global forward hooks:
    they run before any module's own pre-hooks, so a pre-hook's reads count as its module's)."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []
        self._handles: list = []

    def top(self) -> nn.Module | None:
        return self.modules[-1] if self.modules else None

    def __enter__(self) -> ModuleStack:
        def push(module, _args) -> None:
            self.modules.append(module)

        def pop(module, _args, _out) -> None:
            if self.modules and self.modules[-1] is module:
                self.modules.pop()

        self._handles = [
            module_hooks.register_module_forward_pre_hook(push),
            module_hooks.register_module_forward_hook(pop, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.modules = [], []


class ParamReads(TorchDispatchMode):
    """Calls ``on_read(slot index)`` before every op that reads a managed param ([Note: reads seen
    at dispatch]). ``storages``: each managed param's :func:`storage_key` -> its slot index."""

    def __init__(self, storages: dict[int, int], on_read: Callable[[int], None]) -> None:
        super().__init__()
        self.storages, self.on_read = storages, on_read
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within: ops are not reads (our own waits: the unpack writes the params)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            outs = _written(func, args, kwargs)
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and not any(t is o for o in outs):
                    index = self.storages.get(storage_key(t))
                    if index is not None:
                        self.on_read(index)
        return func(*args, **kwargs)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes without reading them first: its ``out=`` arguments."""
    schema = func._schema
    outs = []
    for i, arg in enumerate(schema.arguments):
        if arg.is_out:
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            outs.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return outs
