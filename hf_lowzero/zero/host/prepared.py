"""A chunk's call of our host kernel, built once and reused while its tensors stay the same.

Example::

    storage = master_rows.data_ptr()                                   # the rows the params view
    call = PreparedCall.build(params, None, optimizer.state, storage=storage)  # after their state exists
    if call.current(params, optimizer.state, storage):                 # the same tensors as when built
        kernel.run(call.arguments, call.hyper_rows(hyper.as_row()), grad_scale=None, threads=1)

# [Note: a prepared call]
# With hundreds of small params, our kernel's call cost more than torch's fused step: each step took
# every param's tensors from the optimizer's state, checked each one, and built six arrays of pointers
# (about 5 µs per param, against torch's 3.6, for a kernel that takes 0.2 µs on 68 elements). A
# chunk's call is now built once: its arrays of pointers, element counts and update flags, and a weak
# reference to every tensor they point into. A step uses it only when each of those is still the very
# tensor it was built from, asked of the optimizer as torch's own step would read it: the state object,
# each param's state dict, its ``step``, ``exp_avg`` and ``exp_avg_sq``, and the param's ``.grad``
# (None for a param used on no rank, which the call then does not update). Anything else, and the call
# is built again, after the full checks of ``HostAdamStep.why_not``. A pointer is never used unless its
# tensor is alive and in place: a tensor replaced fails the identity check, and the inner params are
# views of the master rows, whose storage is checked too. The hyperparameters are read every step (a
# scheduler changes the lr), one row per param group.
"""

from __future__ import annotations

import ctypes
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hf_lowzero.zero.host.kernel import AdamTensors, KernelArguments, arguments_of


class _Gone:
    """An object that is gone at once: a reference to it stands for "no tensor" (``None``)."""


NOTHING = weakref.ref(_Gone())  # NOTHING() is None
STATE_ORDER = ("step", "exp_avg", "exp_avg_sq")
_deref = weakref.ref.__call__
_grad = operator.attrgetter("grad")


@dataclass(eq=False)
class PreparedCall:
    """One chunk's kernel call ([Note: a prepared call]): built by :meth:`build`, reused while
    :meth:`current`."""

    arguments: KernelArguments
    params: tuple[torch.Tensor, ...]  # the params in the call, in its order
    grads: tuple[weakref.ref, ...]  # per chunk param: its .grad when built (NOTHING: None)
    stepped: tuple[torch.Tensor, ...]  # the chunk params with a gradient and elements: their state is read
    held: tuple[tuple[weakref.ref, ...], ...]  # per STATE_ORDER key: the stepped params' tensors when built
    state: int  # id() of the optimizer's state it was built from: a quick first test
    storage: int  # the data pointer of the rows the params view

    @classmethod
    def build(
        cls, params: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None, state: dict, *, storage: int
    ) -> PreparedCall:
        """The call over ``params`` (a chunk's inner params, each with its state in ``state`` where it
        has a gradient) and their 16-bit views ``outs``; ``storage``: the rows' data pointer."""
        tensors, stepped = [], []
        for i, param in enumerate(params):
            out = outs[i] if outs else None
            grad = param.grad
            if grad is not None and param.numel():
                stepped.append(param)
            if param.numel() == 0 or (grad is None and out is None):
                continue  # nothing to step or copy (as HostAdamStep's own loop)
            own = state[param] if grad is not None else None
            moments = (own["step"], own["exp_avg"], own["exp_avg_sq"]) if own else (None, None, None)
            tensors.append(AdamTensors(param, grad, moments[1], moments[2], moments[0], out))
        grads = tuple(NOTHING if p.grad is None else weakref.ref(p.grad) for p in params)
        held = tuple(tuple(weakref.ref(state[p][key]) for p in stepped) for key in STATE_ORDER)
        params_in_call = tuple(t.param for t in tensors)
        return cls(arguments_of(tensors), params_in_call, grads, tuple(stepped), held, id(state), storage)

    def current(self, params: Sequence[torch.Tensor], state: dict, storage: int) -> bool:
        """Whether every tensor the call points into is still the one it was built from (the checks
        run in C over lists: a few µs per hundred params)."""
        if id(state) != self.state or storage != self.storage:
            return False
        if not all(map(operator.is_, map(_grad, params), map(_deref, self.grads))):
            return False
        dicts = list(map(state.get, self.stepped))
        if not all(dicts):
            return False
        for key, refs in zip(STATE_ORDER, self.held):
            if not all(map(operator.is_, map(operator.methodcaller("get", key), dicts), map(_deref, refs))):
                return False
        return True

    def hyper_rows(self, rows: tuple[float, ...] | dict[int, tuple[float, ...]]) -> ctypes.Array:
        """The kernel's six numbers per tensor (``AdamHyper.as_row``), read each step: ``rows`` is
        every param's (one group, or groups alike) or a dict id(param) -> its group's."""
        count = self.arguments.count
        if isinstance(rows, tuple):
            return (ctypes.c_double * (6 * count))(*(rows * count))
        return (ctypes.c_double * (6 * count))(*(v for p in self.params for v in rows[id(p)]))
