"""What one op of the step does, in the units the cost model prices: FLOPs and bytes moved.

- Matmuls, convolutions and attention (forward and backward) count their FLOPs with torch's own
  formulas (``torch.utils.flop_counter``), in the dtype they run in.
- Every op counts the bytes of its tensor inputs and outputs (the elements its views cover, each
  once): what a kernel reads and writes, at least.
- Views and allocations launch no kernel (``launches`` False): they cost the host its dispatch only.
- Queries of a tensor's metadata (``prim.device``, ``aten.sym_size``, ...) are no op of the step
  (``is_query``): a real tensor answers them from its own fields, and only a dispatch mode over
  fake tensors sees them (1,577 of a small GPT-2 step's 2,144 ops).

Example::

    work = op_work(torch.ops.aten.mm.default, (a, b), {}, out)
    work.flops, work.nbytes, work.matmul_dtype          # 2*m*n*k, bytes of a, b and out, "bf16"
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

# Ops that make or describe tensors without a kernel reading or writing their data.
_NO_KERNEL = frozenset(
    getattr(aten, name)
    for name in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
        "detach", "alias", "lift_fresh", "set_", "_to_copy_meta", "resize_",
    )
    if hasattr(aten, name)
)  # fmt: skip


# The CPU's flash attention, forward and backward: torch's FLOP formulas do not list them
# (``record.py`` counts them as the GPU's), and on ``cpu`` they run at a rate of their own
# ([Note: the CPU's own rates] in ``calibrate.py``).
CPU_ATTENTION = frozenset(
    {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention_for_cpu_backward"}
)

# Ops that compute per element (``erf``, ``exp``, a row's mean and variance, a sum or a norm) more
# than they move bytes: on ``cpu`` they run at a bandwidth of their own ([Note: the CPU's own rates]).
PER_ELEMENT_MATH = frozenset(
    f"aten.{name}"
    for name in ("native_layer_norm", "native_layer_norm_backward", "gelu", "gelu_backward", "_softmax",
                 "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "tanh", "tanh_backward",
                 "silu", "silu_backward", "sigmoid", "sigmoid_backward", "erf", "exp", "sum", "_foreach_norm",
                 "linalg_vector_norm")
)  # fmt: skip


# Ops over lists of tensors (``torch._foreach_norm``, the fused optimizers' steps): a CPU loops over
# the tensors, and pays for each ([Note: a cost per tensor] in ``calibrate.py``).
MULTI_TENSOR = ("aten._foreach_", "aten._fused_")

# Ops that read a tensor's metadata: a real tensor answers them without the dispatcher.
_QUERIES = frozenset(
    f"aten.{name}"
    for name in ("is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                 "_has_compatible_shallow_copy_type")
)  # fmt: skip


@dataclass(frozen=True)
class OpWork:
    """One op's work: ``flops`` (matmul-like ops only), ``nbytes`` read and written, the dtype its
    matmul runs in (``"bf16"`` for 16-bit floats, else ``"fp32"``), and whether it launches a kernel."""

    flops: float
    nbytes: int
    matmul_dtype: str
    launches: bool
    name: str = ""  # the op's name (aten's), for a look at where the time goes
    head_size: int = 0  # an attention's (``with_cpu_attention``)
    tokens: int = 0  # an attention's keys per sequence (``with_cpu_attention``)
    tensors: int = 0  # a multi-tensor op's (``_foreach_*``, ``_fused_*``) tensors per list


def op_work(func, args, kwargs, out) -> OpWork:
    """The work of ``func(*args, **kwargs)`` that returned ``out`` (see the module docstring)."""
    name, no_kernel, writes, counter = _kind(func)
    outputs = _tensors([out])
    if no_kernel or (not outputs and not writes):  # a view, an allocation, an op answering a scalar
        return OpWork(0.0, 0, "fp32", launches=False, name=name)
    tensors = _tensors(args) + _tensors(list(kwargs.values())) + outputs
    nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    flops = 0.0
    if counter is not None:
        flops = float(counter(*args, **kwargs, out_val=out))
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    sixteen = any(d in (torch.float16, torch.bfloat16) for d in floats)
    many = len(args[0]) if name.startswith(MULTI_TENSOR) and args and isinstance(args[0], (list, tuple)) else 0
    return OpWork(flops, nbytes, "bf16" if sixteen else "fp32", launches=True, name=name, tensors=many)


@functools.cache
def _kind(func) -> tuple[str, bool, bool, object]:
    """What an op is, read once from its schema: its name, whether it launches no kernel, whether it
    writes an argument, and torch's FLOP formula for it (or None)."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet), packet in _NO_KERNEL or _is_view(func), _writes(func), flop_registry.get(packet)


def with_cpu_attention(args, work: OpWork) -> OpWork:
    """The CPU's flash attention (``CPU_ATTENTION``), which torch's FLOP formulas do not list: ``work``
    with the FLOPs the GPU's formula counts, its head size and its keys per sequence (a CPU's rate
    depends on both). A causal
    mask saves the CPU's kernel nothing at a few hundred tokens (measured: 0.99-1.04 of the full
    attention's time, 64 to 512 tokens), so its FLOPs are the full attention's."""
    if work.name.endswith("backward"):
        grad_out, query, key, value = args[:4]
        flops = sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)
    else:
        query, key, value = args[:3]
        flops = sdpa_flop_count(query.shape, key.shape, value.shape)
    return OpWork(float(flops), work.nbytes, work.matmul_dtype, work.launches, work.name, head_size=query.shape[-1],
                  tokens=key.shape[-2])  # fmt: skip


def is_query(func) -> bool:
    """Whether ``func`` reads a tensor's metadata only (see the module docstring): no op of a real step."""
    name = _kind(func)[0]
    return name.startswith("prim.") or name in _QUERIES


def is_collective_op(func) -> bool:
    """Whether ``func`` is a ``c10d`` collective as the dispatcher sees it (``c10d.allreduce_``)."""
    return getattr(func, "namespace", "") == "c10d"


def _writes(func) -> bool:
    """Whether ``func`` writes one of its arguments (an in-place op, ``out=``, ``_foreach_add_``)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _is_view(func) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``, at any depth of lists and tuples."""
    return [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]
