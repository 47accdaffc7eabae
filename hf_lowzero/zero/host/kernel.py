"""Our host Adam/AdamW kernel (``host_adamw.cpp``): torch's fused CPU numbers, 16-bit gradients read
as they are, and the updated params also written in 16 bits, in one pass over the rows.

Example::

    kernel = host_kernel()                    # compiled and checked against torch once, or why not
    if not isinstance(kernel, native.NativeUnavailable):
        kernel.step([AdamTensors(param, grad, exp_avg, exp_avg_sq, step, out=None)],
                    [AdamHyper(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)],
                    grad_scale=None, threads=torch.get_num_threads())

# [Note: rounding as torch's fused Adam]
# torch's fused CPU Adam/AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) rounds an element one
# of two ways. Its vector body, over all but the last ``numel % Vec::size()`` elements of a tensor,
# computes the lerp of ``exp_avg`` as one explicit FMA and everything else as separate roundings. Its
# scalar tail, over those last elements, writes the lerp and the ``exp_avg_sq`` update as sums of
# products, which torch's compiler may or may not have contracted into FMAs. Both the vector width
# (AVX-512: 16, AVX2: 8) and the contraction belong to the torch build and the CPU it runs on, so we
# do not guess them: ``host_kernel`` steps a probe (sizes 1-40 and 100, Adam and AdamW, weight decay,
# a large and a small lerp weight, a grad_scale, three steps) with torch's kernel and with ours under
# each candidate, and keeps the first candidate that is bit-equal on every tensor. None: our kernel
# is not used, and the reason is logged. Coefficients are computed in double and cast to float, as
# torch does; the step counter is torch's float32 tensor, incremented by the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_lowzero.zero.runtime import native

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_adamw.cpp")
FLAGS = ("-fno-math-errno",)  # sqrt is correctly rounded either way; without errno it vectorizes
BLOCK = 1 << 15  # elements per OpenMP task (a multiple of every vector width)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_OUT = 3


@dataclass(frozen=True)
class AdamHyper:
    """A param group's hyperparameters, as torch's Adam/AdamW reads them."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    decoupled: bool  # AdamW (or Adam(decoupled_weight_decay=True))

    def as_row(self) -> tuple[float, ...]:
        return (self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, 1.0 if self.decoupled else 0.0)


@dataclass(frozen=True, eq=False)
class AdamTensors:
    """One tensor's step: fp32 contiguous ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step`` (torch's
    float32 counter); ``grad`` fp32, bf16 or fp16 (None: cast only, no update); ``out``: where the
    updated param is also written, bf16 or fp16, or None."""

    param: torch.Tensor
    grad: torch.Tensor | None
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    step: torch.Tensor | None
    out: torch.Tensor | None = None


@dataclass(frozen=True)
class Rounding:
    """What [Note: rounding as torch's fused Adam] found: torch's vector width and whether its scalar
    tail's sums of products are FMAs."""

    tail_width: int
    fused: bool


class HostAdamKernel:
    """The compiled kernel, with the rounding that matches torch's here."""

    def __init__(self, library: ctypes.CDLL, rounding: Rounding) -> None:
        self.library, self.rounding = library, rounding
        fn = library.host_adam_step
        pointers = ctypes.c_void_p
        fn.argtypes = [
            ctypes.c_int64, pointers, pointers, ctypes.c_int32, pointers, pointers, pointers, pointers, pointers,
            pointers, pointers, ctypes.c_int32, pointers, ctypes.c_int32, ctypes.c_int64, ctypes.c_int32,
            ctypes.c_int64, ctypes.c_int32,
        ]  # fmt: skip
        fn.restype = ctypes.c_int64
        self._fn = fn

    def step(
        self,
        tensors: list[AdamTensors],
        hyper: list[AdamHyper],
        *,
        grad_scale: torch.Tensor | None,
        threads: int,
        grad_factor: float | None = None,
    ) -> int:
        """One step of every tensor (``hyper[i]`` for ``tensors[i]``). Every ``grad`` given has one
        dtype, every ``out`` one dtype. ``grad_scale``: a float32 scalar tensor every gradient is
        divided by (torch's ``grad_scale``; the gradients are not written back); or ``grad_factor``:
        a number every gradient is multiplied by instead (not both). Returns the elements
        stepped. Checks nothing: the caller passes tensors as described (``HostAdamStep`` does)."""
        if not tensors:
            return 0
        rows = (ctypes.c_double * (6 * len(tensors)))(*(v for h in hyper for v in h.as_row()))
        return self.run(arguments_of(tensors), rows, grad_scale=grad_scale, threads=threads, grad_factor=grad_factor)

    def run(
        self,
        arguments: KernelArguments,
        rows: ctypes.Array,
        *,
        grad_scale: torch.Tensor | None,
        threads: int,
        grad_factor: float | None = None,
    ) -> int:
        """:meth:`step` on arguments already built (``rows``: six numbers per tensor, ``AdamHyper.as_row``)."""
        if arguments.count == 0:
            return 0
        if grad_scale is not None and grad_factor is not None:
            raise ValueError("give grad_scale (a divisor) or grad_factor (a multiplier), not both")
        scale = grad_scale.detach().to(torch.float32).reshape(()) if grad_scale is not None else None
        if grad_factor is not None:
            scale = torch.tensor(grad_factor, dtype=torch.float32)
        a = arguments
        return self._fn(
            a.count, a.params, a.grads, a.grad_code, a.exp_avgs, a.exp_avg_sqs, a.steps, a.numels, rows, a.update,
            a.outs, a.out_code, None if scale is None else scale.data_ptr(), int(grad_factor is not None),
            self.rounding.tail_width, int(self.rounding.fused), BLOCK, max(1, threads),
        )  # fmt: skip


@dataclass(frozen=True)
class KernelArguments:
    """What the kernel reads of some tensors besides their hyperparameters: per tensor, pointers to
    the param, its gradient, its two moments, its step counter and its 16-bit copy, its element count
    and whether it is updated (a param without a gradient is only copied)."""

    count: int
    params: ctypes.Array
    grads: ctypes.Array
    exp_avgs: ctypes.Array
    exp_avg_sqs: ctypes.Array
    steps: ctypes.Array
    numels: ctypes.Array
    update: ctypes.Array
    outs: ctypes.Array
    grad_code: int
    out_code: int


def arguments_of(tensors: list[AdamTensors]) -> KernelArguments:
    """The kernel's arguments for ``tensors`` (every ``grad`` given of one dtype, every ``out`` of one)."""
    count = len(tensors)

    def pointers(values) -> ctypes.Array:
        return (ctypes.c_void_p * count)(*(None if t is None else t.data_ptr() for t in values))

    grads = [t.grad for t in tensors if t.grad is not None]
    outs = [t.out for t in tensors if t.out is not None]
    return KernelArguments(
        count=count, params=pointers(t.param for t in tensors), grads=pointers(t.grad for t in tensors),
        exp_avgs=pointers(t.exp_avg for t in tensors), exp_avg_sqs=pointers(t.exp_avg_sq for t in tensors),
        steps=pointers(t.step for t in tensors), numels=(ctypes.c_int64 * count)(*(t.param.numel() for t in tensors)),
        update=(ctypes.c_uint8 * count)(*(t.grad is not None for t in tensors)), outs=pointers(t.out for t in tensors),
        grad_code=DTYPE_CODES[grads[0].dtype] if grads else 0, out_code=DTYPE_CODES[outs[0].dtype] if outs else NO_OUT,
    )  # fmt: skip


class TorchFusedKernel:
    """The same step through torch's own fused ops (``torch._fused_adam_``/``_fused_adamw_``), for
    tensors our kernel cannot read: fake tensors, when a simulation runs the real step on fake GPUs
    (``hf_lowzero.simulation``). It reads and writes what ours does, chunk by chunk, so the
    simulation checks the same order of host writes and copies; the 16-bit copy is a cast."""

    def step(
        self, tensors: list[AdamTensors], hyper: list[AdamHyper], *, grad_scale, threads: int, grad_factor=None
    ) -> int:
        stepped = [(t, h) for t, h in zip(tensors, hyper) if t.grad is not None]
        grads = {id(t): t.grad.float() for t, _ in stepped}  # promoted as ours does (16-bit rows: a copy)
        if grad_factor is not None:  # the multiply ours does as it reads, in fp32
            torch._foreach_mul_(list(grads.values()), grad_factor)
        for same in dict.fromkeys(h for _, h in stepped):
            group = [t for t, h in stepped if h == same]
            torch._foreach_add_([t.step for t in group], 1)
            fused = torch._fused_adamw_ if same.decoupled else torch._fused_adam_
            fused(
                [t.param for t in group], [grads[id(t)] for t in group], [t.exp_avg for t in group],
                [t.exp_avg_sq for t in group], [], [t.step for t in group], lr=same.lr, beta1=same.betas[0],
                beta2=same.betas[1], weight_decay=same.weight_decay, eps=same.eps, amsgrad=False, maximize=False,
                grad_scale=grad_scale, found_inf=None,
            )  # fmt: skip
        for t in tensors:
            if t.out is not None:
                t.out.copy_(t.param)
        return sum(t.param.numel() for t, _ in stepped)


@functools.cache
def host_kernel() -> HostAdamKernel | native.NativeUnavailable:
    """The kernel, compiled and checked against torch's fused one on first use ([Note: rounding as
    torch's fused Adam]), or why not. Memoized per process; a build that fails is logged by
    ``native.load``, a kernel that rounds otherwise than torch's here is logged once here."""
    library = native.load(SOURCE, FLAGS)
    if isinstance(library, native.NativeUnavailable):
        return library
    for rounding in (Rounding(8, True), Rounding(16, True), Rounding(8, False), Rounding(16, False)):
        kernel = HostAdamKernel(library, rounding)
        if rounds_as_torch(kernel):
            return kernel
    why = native.NativeUnavailable("it does not round as torch's fused CPU Adam on this machine and torch build")
    logger.info("[hf_lowzero] our host AdamW kernel is not used: %s", why.why)
    return why


PROBE_SIZES = (*range(1, 41), 100)
PROBE_HYPER = (
    AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True),
    AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=False),
    AdamHyper(lr=3e-3, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.0, decoupled=True),
)


def rounds_as_torch(kernel: HostAdamKernel, steps: int = 3) -> bool:
    """Whether ``kernel`` is bit-equal to torch's fused Adam/AdamW on the probe (params, both moments)."""
    g = torch.Generator().manual_seed(0)
    for hyper in PROBE_HYPER:
        params = [torch.randn(n, generator=g) for n in PROBE_SIZES]
        theirs = [p.clone().requires_grad_() for p in params]
        kind = torch.optim.AdamW if hyper.decoupled else torch.optim.Adam
        reference = kind(theirs, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                         fused=True)  # fmt: skip
        state = [(torch.zeros(n), torch.zeros(n), torch.zeros((), dtype=torch.float32)) for n in PROBE_SIZES]
        scale = torch.tensor(3.0)
        for _ in range(steps):
            grads = [torch.randn(n, generator=g) * 3.0 for n in PROBE_SIZES]
            for p, grad in zip(theirs, grads):
                p.grad = grad.clone()
            reference.grad_scale = scale
            reference.step()
            tensors = [AdamTensors(p, grad, m, v, s) for p, grad, (m, v, s) in zip(params, grads, state)]
            kernel.step(tensors, [hyper] * len(tensors), grad_scale=scale, threads=1)
        for p, t, (m, v, _) in zip(params, theirs, state):
            torch_state = reference.state[t]
            same = torch.equal(p, t.detach()) and torch.equal(m, torch_state["exp_avg"])
            if not (same and torch.equal(v, torch_state["exp_avg_sq"])):
                return False
    return True
