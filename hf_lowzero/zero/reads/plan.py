"""Where the next forward waits for each bucket's gather: learned from the reads the forward makes.

Example::

    plan = WaitPlan(model, params, gathers, check=False)   # params: (name, param, bucket index) per slot
    plan.attach()         # pre-hooks, first in line; the root's learns the reads of each kind of forward
    model(**batch)        # each module waits for the buckets it (or its fast path) reads, before anything runs
    plan.detach()

# [Note: every read waits]
# With ``overlap_allgather`` a param's gather may still be in flight when the next forward begins
# ([Note: overlapped all-gather] in ``update/allgather.py``). The unit that waits must cover every read
# of the params it holds, and a module's own forward is too small a unit:
#
# - **Learned.** The first forward of each kind (the root's ``training`` flag and grad mode: an
#   evaluation under ``no_grad`` is another kind, it may take a fused fast path) runs under
#   ``ParamReads`` ([Note: reads seen at dispatch] in ``watch.py``). Before an op reads a param whose gather is
#   in flight, that forward waits for it there and then (so it is right whatever it reads), and it
#   records the module whose forward was running: from then on that module's pre-hook waits for the
#   param's bucket. ``nn.MultiheadAttention`` reading ``out_proj.weight``, a model reading another
#   module's weight in its own forward (``F.linear(h, self.wte.weight)``) and pruning's pre-hook
#   reading ``weight_orig`` are all learned this way.
# - **Held.** Every module also waits for the params it holds directly: a branch the learned forward
#   did not take is still covered where it is read through its module.
# - **Fused readers.** Some modules read their children's weights in one kernel on a path the learned
#   forward may not take (``nn.TransformerEncoderLayer``'s fast path runs in eval under ``no_grad``
#   only): ``FUSED_READERS`` wait for every bucket below them.
# - **First in line.** Every pre-hook of ours is prepended: hooks registered before wrapping (pruning,
#   ``weight_norm``, quantization) run after ours and read current values.
#
# A read that still slips through (a path first taken after its kind was learned) is caught where it
# can be: one that gets a gradient is named at the step ([Note: overlapped all-gather]); ``check`` (the
# ``check_param_reads`` option) watches every forward and raises at the read itself, naming the param
# and the module. Learning costs one watched forward per kind (an op dispatch through Python); the
# forwards after it pay one dictionary look-up per module call.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from hf_lowzero.zero.reads.watch import ModuleStack, ParamReads, storage_key
from hf_lowzero.zero.runtime.own_hooks import mark_own_hook

# Modules that read their descendants' weights directly on a fused path ([Note: every read waits]).
FUSED_READERS: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


class Gathers(Protocol):
    """What the plan needs of the gathers in flight (``update/allgather.ParamGather``)."""

    pending: Mapping[int, object]  # bucket index -> its gather, while in flight

    def wait(self, indices: tuple[int, ...]) -> None: ...

    def wait_all(self) -> None: ...


@dataclass(frozen=True)
class WatchedParam:
    """A managed param as the plan sees it: its name, the tensor, the bucket its gather is in."""

    name: str
    param: torch.Tensor
    bucket: int


class StaleParamRead(RuntimeError):
    """A forward read a param while its all-gather was in flight (``check_param_reads``)."""


class WaitPlan:
    """The forward pre-hooks that make every read of a param wait for its gather ([Note: every read
    waits]), and the state-dict hooks that make ``state_dict()``/``load_state_dict()`` wait for all."""

    def __init__(self, model: nn.Module, params: list[WatchedParam], gathers: Gathers, *, check: bool) -> None:
        self.model, self.params, self.check = model, params, check
        self._gathers = weakref.ref(gathers)  # held weakly ([Note: hooks hold the optimizer weakly])
        self.storages = {storage_key(p.param): i for i, p in enumerate(params)}
        self.waits: dict[int, set[int]] = {}  # id(module) -> the buckets its pre-hook waits for
        self.learned: set[tuple[bool, bool]] = set()  # the kinds of forward whose reads were learned
        self._hooks: list = []
        self._hooked: set[int] = set()
        self._watch: list[tuple[ModuleStack, ParamReads] | None] = []  # the root forward's, while running
        self._unhooked: list[nn.Module] = []  # modules learned in the running forward, hooked as it ends

    # ------------------------------------------------------------------------------ attach

    def attach(self) -> None:
        """Register the hooks (see the class docstring)."""
        bucket_of = {id(p.param): p.bucket for p in self.params}
        for module in self.model.modules():
            held = {bucket_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in bucket_of}
            if isinstance(module, FUSED_READERS):
                held |= {bucket_of[id(p)] for p in module.parameters() if id(p) in bucket_of}
            if held:
                self._wait_at(module, held)
                self._hooks.append(module.register_state_dict_pre_hook(self._state_dict_hook()))
                self._hooks.append(module.register_load_state_dict_pre_hook(self._state_dict_hook()))
        root = self.model
        this = weakref.ref(self)

        @mark_own_hook
        def enter(_module, _args) -> None:
            plan = this()
            if plan is not None:
                plan._enter()

        @mark_own_hook
        def leave(_module, _args, _out) -> None:
            plan = this()
            if plan is not None:
                plan._leave()

        self._hooks.append(root.register_forward_pre_hook(enter, prepend=True))
        self._hooks.append(root.register_forward_hook(leave, always_call=True))
        self._hooks.append(root.register_state_dict_pre_hook(self._state_dict_hook()))
        self._hooks.append(root.register_load_state_dict_pre_hook(self._state_dict_hook()))

    def detach(self) -> None:
        """Remove every hook ``attach`` added."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], set()

    def _wait_at(self, module: nn.Module, buckets: set[int]) -> None:
        self.waits.setdefault(id(module), set()).update(buckets)
        if id(module) in self._hooked:
            return
        if self._watch:  # learning, inside the forward: registered as it ends (a module's hooks may be running)
            self._unhooked.append(module)
            return
        self._hooked.add(id(module))
        this = weakref.ref(self)
        key = id(module)
        order: list[tuple[int, ...]] = [()]  # the buckets in the forward's order, kept current

        @mark_own_hook
        def forward_pre_hook(_module, _args) -> None:
            plan = this()
            if plan is None:
                return
            gathers = plan._gathers()
            if gathers is not None and gathers.pending:
                if len(order[0]) != len(plan.waits[key]):
                    order[0] = tuple(sorted(plan.waits[key], reverse=True))  # the forward's order
                plan._wait(gathers, order[0])

        self._hooks.append(module.register_forward_pre_hook(forward_pre_hook, prepend=True))

    def _state_dict_hook(self):
        this = weakref.ref(self)

        @mark_own_hook
        def state_dict_pre_hook(*_args, **_kwargs) -> None:
            plan = this()
            gathers = plan._gathers() if plan is not None else None
            if gathers is not None:
                gathers.wait_all()

        return state_dict_pre_hook

    # ------------------------------------------------------------------------- the root forward

    def _enter(self) -> None:
        if _compiling():
            raise RuntimeError(
                "overlap_allgather with torch.compile on the optimizer API: the hooks that make each read of a param "
                "wait for its all-gather cannot be traced. Pass overlap_allgather=False (the Trainer does so itself "
                "with --torch_compile)."
            )
        if self._watch:  # a re-entrant call of the root (its forward calls itself): already watched
            self._watch.append(self._watch[-1])
            return
        kind = (self.model.training, torch.is_grad_enabled())
        learning = kind not in self.learned
        if not (learning or self.check):
            self._watch.append(None)
            return
        stack = ModuleStack()
        reads = ParamReads(self.storages, lambda index: self._on_read(index, stack, learning))
        stack.__enter__()
        reads.__enter__()
        self._watch.append((stack, reads))
        if learning:
            self.learned.add(kind)

    def _leave(self) -> None:
        if not self._watch:  # _enter raised
            return
        watch = self._watch.pop()
        if watch is None or self._watch:
            return
        stack, reads = watch
        reads.__exit__(None, None, None)
        stack.__exit__(None, None, None)
        unhooked, self._unhooked = self._unhooked, []
        for module in unhooked:
            self._wait_at(module, set())

    def _wait(self, gathers: Gathers, indices: tuple[int, ...]) -> None:
        watch = self._watch[-1] if self._watch else None
        if watch is None:
            gathers.wait(indices)
            return
        with watch[1].paused():  # our own unpack is no read
            gathers.wait(indices)

    def _on_read(self, index: int, stack: ModuleStack, learning: bool) -> None:
        param = self.params[index]
        module = stack.top() or self.model
        gathers = self._gathers()
        if learning:
            if param.bucket not in self.waits.get(id(module), ()):
                self._wait_at(module, {param.bucket})
            if gathers is not None and param.bucket in gathers.pending:
                self._wait(gathers, (param.bucket,))
            return
        if gathers is not None and param.bucket in gathers.pending:
            names = (name or "<root>" for name, m in self.model.named_modules() if m is module)
            where = next(names, type(module).__name__)
            raise StaleParamRead(
                f"{param.name!r} was read in the forward of {where!r} "
                f"({type(module).__name__}) while its all-gather was still in flight: the forward saw the previous "
                "step's values (check_param_reads; [Note: every read waits] in hf_lowzero/zero/reads/plan.py). A path "
                "first taken after its kind of forward was learned reads it there; call "
                "LowLevelZeroOptimizer.wait_for_params() before such a forward, or pass overlap_allgather=False."
            )


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())
