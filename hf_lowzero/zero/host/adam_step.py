"""The inner Adam/AdamW step on host rows (offloaded, or a CPU run's) with our kernel, chunk by chunk, where
it is exact.

Example::

    host_step = make_host_step(inner_optimizer, slots, buckets, inner_params, master.flat,
                               pin_for=shard.device, rows=store)   # pinned for the params' device
    if not host_step.step(after_chunk=gather.upload):   # False: torch's own step must run
        inner_optimizer.step()

# [Note: our kernel in torch's place]
# The inner step is torch's ``Adam``/``AdamW`` with the fused kernel; ours computes the same bits
# ([Note: rounding as torch's fused Adam] in ``kernel.py``) and also writes the params' 16-bit copy,
# so it runs in its place exactly where that holds, checked at every step (``why_not``): the
# optimizer is exactly ``Adam`` or ``AdamW`` with no step hooks and no ``found_inf``; every group has
# ``fused=True`` and ``amsgrad``, ``maximize``, ``capturable``, ``differentiable`` off; every inner
# param, gradient and state tensor is a real contiguous host tensor of the expected dtype. Anything
# else: torch's ``optimizer.step()`` runs, as before. The state stays torch's own: ``step`` (a float32
# scalar tensor), ``exp_avg`` and ``exp_avg_sq``, created as torch creates them on a param's first
# step with a gradient and incremented by the kernel as torch increments them, so ``state_dict()``,
# checkpoints and resuming are unchanged and a run can switch between the two paths at any step. A
# param whose ``.grad`` is None (used on no rank, [Note: inner params]) is not stepped and gets no
# state, as with torch; its rows are only copied into the 16-bit copy. The step's unscale-and-clip
# factor ([Note: one multiply]) comes as ``grad_factor``, set by ``StepFactor`` for the step: the
# kernel multiplies each gradient by it as it reads it, one rounding as the device path's multiply of
# the rows (a power of two, the fp16 loss scale without clipping, gives the bits of torch's divide by
# ``grad_scale``); the gradient rows are not written back (the step discards them). A bucket whose
# gradient rows the store holds in 16 bits ([Note: 16-bit rows] in ``grads/grad_store.py``) is
# stepped from those: the kernel promotes each element as it reads it (exact), so the fp32 rows the
# inner params' ``.grad`` view are neither written nor read. When torch's step runs instead, the
# store widens every bucket into those fp32 rows first.
#
# It runs wherever the fp32 masters are in host memory: offloaded, or a CPU run's own. There, on a
# model of hundreds of small params, it also takes a third of torch's time ([Note: a prepared call]
# in ``prepared.py``); the 16-bit copy is kept only with offload, where it goes to the device.
#
# Chunks are buckets, in the order the gather issues them: after the kernel finished a chunk,
# ``after_chunk(bucket index)`` starts its copy to the device while the host steps the next.
# On fake tensors (a simulation of the GPU path) torch's own fused ops do the kernel's work
# (``TorchFusedKernel``): the same reads and writes, chunk by chunk, for the simulation to check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.optim import optimizer as torch_optimizer

from hf_lowzero.zero.host.kernel import AdamHyper, AdamTensors, HostAdamKernel, TorchFusedKernel, host_kernel
from hf_lowzero.zero.host.prepared import PreparedCall
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.packing import piece_view
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime import native

STEPPED_BY_US: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
OFF_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class GradRows(Protocol):
    """Where a step finds the gradient rows held in 16 bits (the offloaded gradient store:
    [Note: 16-bit rows] in ``grads/grad_store.py``)."""

    def narrow(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s rows (1D) where held in 16 bits, else None: the params' ``.grad``."""

    def widen_all(self) -> bool:
        """Every bucket's rows into the fp32 rows the params' ``.grad`` view."""


@dataclass(frozen=True, eq=False)
class Chunk:
    """A bucket's inner params, where each one's rows start in the bucket's rows, and, where the
    params' 16-bit copy is kept, their views of it."""

    bucket_index: int
    params: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]  # per param: its first element in the bucket's rows
    outs: tuple[torch.Tensor, ...] | None  # same shapes as params, in the params' dtype; None: no copy


@dataclass(eq=False)
class ParamCopy:
    """The master rows again, in the params' 16-bit dtype (1D, host; pinned for CUDA params), the
    same layout as the masters; ``fresh`` while it holds this step's values, written by the kernel."""

    flat: torch.Tensor
    fresh: bool = False


class HostAdamStep:
    """Steps the inner ``optimizer``'s params with our kernel ([Note: our kernel in torch's place]).
    ``copy``, where kept, costs 2 bytes per row element of host memory (pinned for CUDA params);
    ``memory_report()`` counts it with the master rows."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        chunks: list[Chunk],
        *,
        kernel: HostAdamKernel | native.NativeUnavailable,
        copy: ParamCopy | None,
        rows: GradRows | None = None,
        flat: torch.Tensor | None = None,
    ) -> None:
        self.optimizer, self.chunks, self.kernel, self.copy, self.rows = optimizer, chunks, kernel, copy, rows
        self.flat = flat  # the rows the inner params view (their storage is part of a prepared call's test)
        self.last_path = "torch"  # which path the last step took: "ours" or "torch" (for tests, benchmarks)
        self.grad_factor: float | None = None  # this step's factor, set by StepFactor for the step
        self._checked: dict[int, tuple] = {}  # id(inner param) -> weak refs of the tensors last found fine
        self._calls: dict[int, PreparedCall] = {}  # chunk position -> its kernel call ([Note: a prepared call])
        self._fresh: list[PreparedCall] | None = None  # every chunk's call, as the last why_not() found them current

    def why_not(self) -> str | None:
        """Why this step must be torch's own, or None when ours computes the same bits."""
        if isinstance(self.kernel, native.NativeUnavailable) and not self._simulated():
            return self.kernel.why
        optimizer = self.optimizer
        if type(optimizer) not in STEPPED_BY_US:
            return f"the inner optimizer is {type(optimizer).__name__}, not torch's Adam or AdamW"
        if getattr(optimizer, "found_inf", None) is not None or _has_step_hooks(optimizer):
            return "the inner optimizer has step hooks or found_inf"
        for group in optimizer.param_groups:
            if not group.get("fused") or any(group.get(flag) for flag in OFF_FLAGS):
                return "a param group is not fused, or asks for amsgrad, maximize, capturable or differentiable"
        in_chunks = sum(len(chunk.params) for chunk in self.chunks)
        if in_chunks != sum(len(group["params"]) for group in optimizer.param_groups):
            return "the param groups hold params outside the buckets' chunks"
        self._fresh = self._current()
        if self._fresh is not None:
            return None  # every tensor is one the full checks below passed ([Note: a prepared call])
        grads = {p.grad.dtype for chunk in self.chunks for p in chunk.params if p.grad is not None}
        if len(grads) > 1 or not grads <= set(GRAD_DTYPES):
            return f"gradients of dtypes {sorted(map(str, grads))}"
        fake = self._simulated()
        for chunk in self.chunks:
            for param in chunk.params:
                state = optimizer.state.get(param)
                tensors = (param.grad, *(state.get(key) for key in STATE_KEYS)) if state else (param.grad,)
                if _same(self._checked.get(id(param)), tensors):
                    continue  # the same tensors as last time (a param's own never changes: fixed views)
                why = _tensor_problem(param, state, fake)
                if why:
                    return why
                self._checked[id(param)] = tuple(None if t is None else weakref.ref(t) for t in tensors)
        return None

    def _current(self) -> list[PreparedCall] | None:
        """Every chunk's prepared call, where each one is current; else None."""
        calls = [self._kept(position) for position in range(len(self.chunks))]
        return None if None in calls else calls

    def _kept(self, position: int) -> PreparedCall | None:
        """Chunk ``position``'s prepared call where it is current, else None."""
        call = self._calls.get(position)
        current = call is not None and call.current(self.chunks[position].params, self.optimizer.state, self._storage())
        return call if current else None

    def _storage(self) -> int:
        return 0 if self.flat is None or is_fake(self.flat) else self.flat.data_ptr()

    def _simulated(self) -> bool:
        """Whether the rows are fake tensors: a simulation of the step, which ``TorchFusedKernel`` runs."""
        return any(is_fake(chunk.params[0]) for chunk in self.chunks if chunk.params)

    def step(self, after_chunk: Callable[[int], None] | None = None) -> bool:
        """One step of the inner optimizer with our kernel, or False (nothing done) where it must be
        torch's. ``after_chunk(bucket_index)``: called as each chunk is done, in ``chunks``' order."""
        if self.why_not() is not None:  # also finds every chunk's call current, or not (self._fresh)
            self.last_path = "torch"
            if self.copy is not None:
                self.copy.fresh = False
            if self.rows is not None:
                self.rows.widen_all()  # torch's step reads the params' .grad: the fp32 rows
            if self.grad_factor is not None:  # promised to the kernel, so applied here for torch's step
                grads = [p.grad for chunk in self.chunks for p in chunk.params if p.grad is not None]
                torch._foreach_mul_(grads, self.grad_factor)
            return False
        adamw = type(self.optimizer) is torch.optim.AdamW
        groups = self.optimizer.param_groups  # read every step (a scheduler changes the lr)
        hypers = [_hyper(group, adamw) for group in groups]
        hyper_of = {key: hyper for group, hyper in zip(groups, hypers) for key in map(id, group["params"])}
        alike = len(set(hypers)) == 1  # one row for all, else id(param) -> its group's row
        rows = hypers[0].as_row() if alike else {key: hyper.as_row() for key, hyper in hyper_of.items()}
        scale = {"grad_factor": self.grad_factor, "threads": torch.get_num_threads()}
        scale["grad_scale"] = None if self.grad_factor is not None else getattr(self.optimizer, "grad_scale", None)
        simulated, fresh = self._simulated(), self._fresh  # fresh: the calls found current just now
        kernel = TorchFusedKernel() if simulated else self.kernel
        if self.copy is not None:
            self.copy.fresh = True  # each chunk's part is written before after_chunk reads it
        for position, chunk in enumerate(self.chunks):
            narrow = self.rows.narrow(chunk.bucket_index) if self.rows is not None else None
            if narrow is None and not simulated:  # [Note: a prepared call]
                call = fresh[position] if fresh else self._call(position)
                kernel.run(call.arguments, call.hyper_rows(rows), **scale)
            else:
                tensors = [
                    self._tensors(p, chunk.outs[i] if chunk.outs else None, narrow, chunk.starts[i])
                    for i, p in enumerate(chunk.params)
                ]
                chosen = [(t, hyper_of[id(t.param)]) for t in tensors if t is not None]
                if chosen:
                    kernel.step([t for t, _ in chosen], [h for _, h in chosen], **scale)
            if after_chunk is not None:
                after_chunk(chunk.bucket_index)
        self.last_path = "ours"
        return True

    def _call(self, position: int) -> PreparedCall:
        """Chunk ``position``'s kernel call: the one kept while current, else built again (the state
        of each param with a gradient created first, as torch creates it)."""
        call = self._kept(position)
        if call is None:
            chunk = self.chunks[position]
            for param in chunk.params:
                if param.grad is not None and param.numel():
                    _state_of(self.optimizer, param)
            call = PreparedCall.build(chunk.params, chunk.outs, self.optimizer.state, storage=self._storage())
            self._calls[position] = call
        return call

    def _tensors(
        self, param: torch.Tensor, out: torch.Tensor | None, narrow: torch.Tensor | None, start: int
    ) -> AdamTensors | None:
        if param.numel() == 0:
            return None
        if param.grad is None:  # not stepped, no state: only its 16-bit copy
            return None if out is None else AdamTensors(param, None, None, None, None, out)
        grad = param.grad if narrow is None else narrow[start : start + param.numel()]  # [Note: 16-bit rows]
        state = _state_of(self.optimizer, param)
        return AdamTensors(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], out)


def _state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict:
    """``param``'s state, created as torch's ``Adam._init_group`` creates it for a fused group."""
    state = optimizer.state[param]
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _same(checked: tuple | None, tensors: tuple) -> bool:
    """Whether ``tensors`` are the very tensors ``checked`` refers to (weakly: a freed one never is)."""
    if checked is None or len(checked) != len(tensors):
        return False
    return all((ref is None and t is None) or (ref is not None and ref() is t) for ref, t in zip(checked, tensors))


def _hyper(group: dict, adamw: bool) -> AdamHyper:
    beta1, beta2 = group["betas"]
    decoupled = adamw or bool(group.get("decoupled_weight_decay"))  # older torch: AdamW's groups lack the key
    return AdamHyper(
        lr=float(group["lr"]), betas=(float(beta1), float(beta2)), eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]), decoupled=decoupled,
    )  # fmt: skip


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    own = optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
    return bool(own or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


def _tensor_problem(param: torch.Tensor, state: dict | None, fake: bool) -> str | None:
    numel = param.numel()

    def plain(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], count: int) -> bool:
        kind = is_fake(tensor) if fake else type(tensor) in (torch.Tensor, torch.nn.Parameter)
        return kind and tensor.device.type == "cpu" and tensor.dtype in dtypes and tensor.numel() == count and (
            tensor.is_contiguous()
        )  # fmt: skip

    if not plain(param, (torch.float32,), numel):
        return "an inner param is not a contiguous fp32 host tensor"
    if param.grad is not None and not plain(param.grad, GRAD_DTYPES, numel):
        return "a gradient is not a contiguous host tensor of the param's size"
    if state:
        step = state.get("step")
        if step is None or not plain(step, (torch.float32,), 1) or step.dim() != 0:
            return "a param's state has no float32 scalar step tensor"
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state or not plain(state[key], (torch.float32,), numel):
                return f"a param's {key} is not a contiguous fp32 host tensor"
    return None


def make_host_step(
    optimizer: torch.optim.Optimizer,
    slots: list[ParamSlot],
    buckets: list[Bucket],
    inner_params: list[torch.Tensor | None],
    flat: torch.Tensor,
    *,
    pin_for: torch.device | None,
    rows: GradRows | None = None,
    keep_copy: bool = True,
) -> HostAdamStep:
    """The host step over fp32 master rows ``flat`` in host memory (``inner_params`` are views of it,
    per slot), chunked by bucket in the gather's order (reversed plan: the next forward's). The params'
    16-bit copy is kept when ``keep_copy`` (offload: the copy goes to the device), every bucket holds
    params of one 16-bit dtype and the inner params cover the rows. ``rows``: the gradient store,
    where buckets may be held in 16 bits."""
    chunks, dtypes = [], {bucket.dtype for bucket in buckets}
    covered = sum(p.numel() for p in inner_params if p is not None) == flat.numel()
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    keep = covered and dtype in (torch.bfloat16, torch.float16) and flat.dtype == torch.float32
    keep = keep and keep_copy and type(optimizer) in STEPPED_BY_US  # 2 bytes per row element: only where ours may run
    copy = ParamCopy(dev.host_buffer(flat.numel(), dtype, pin_for)) if keep else None
    for bucket in reversed(buckets):
        held = [(slot, inner_params[slot.index]) for slot in bucket.slots if inner_params[slot.index] is not None]
        outs = tuple(piece_view(copy.flat, slot).view(p.shape) for slot, p in held) if copy else None
        starts = tuple(slot.row_offset - bucket.row_offset for slot, _ in held)
        chunks.append(Chunk(bucket.index, tuple(p for _, p in held), starts, outs))
    if type(optimizer) not in STEPPED_BY_US:
        kernel = native.NativeUnavailable("not Adam or AdamW")
    elif is_fake(flat):  # a simulation: nothing to compile or probe ([Note: our kernel in torch's place])
        kernel = native.NativeUnavailable("fake tensors")
    else:
        kernel = host_kernel()
    return HostAdamStep(optimizer, chunks, kernel=kernel, copy=copy, rows=rows, flat=flat)
