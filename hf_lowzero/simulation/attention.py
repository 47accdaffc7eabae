"""Attention on fake GPUs takes the kernel a GPU would take.

``scaled_dot_product_attention`` picks its kernel with a CUDA-only choice function; a CPU-only build
of torch lacks it, so on fake ``cuda`` tensors it falls back to the math path, which keeps the
``S x S`` scores, softmax and dropout mask per layer: gigabytes a GPU never holds. ``gpu_attention()``
routes each call to the kernel a GPU's selection takes instead: flash attention for fp16/bf16 without
a mask (head dims up to 256, multiples of 8), memory-efficient attention otherwise (masks, fp32), both
of which torch can run on fake tensors, forward and backward. They keep what the GPU kernels keep:
the output and a log-sum-exp per row; dropout is regenerated from a seed.

Example::

    with FakeTensorMode(), gpu_attention():
        loss = model(**batch).loss      # a transformers model with attn_implementation="sdpa"
        loss.backward()                 # a checkpointed layer's recomputation takes the same kernels

# [Note: attention routed in the dispatcher]
# The route is a kernel for ``aten::scaled_dot_product_attention`` at the ``AutogradCUDA`` key, which
# takes precedence over the op's composite (math-path) kernel for ``cuda`` tensors, and only while
# the context is open. It was a ``TorchFunctionMode``, which broke gradient checkpointing: a mode is
# off while its own handler runs, and ``Tensor.backward`` is a torch function, so the whole backward
# ran without the route. A checkpointed layer's recomputation (inside backward) took the math path:
# with ``use_reentrant=False`` torch.utils.checkpoint refused the step (41 tensors saved in forward,
# 38 in the recomputation, for Llama), with ``use_reentrant=True`` the plan counted the math path's
# fp32 scores in backward (a 2-layer Llama at 512 tokens: 27.3 MB of activations, 5.1 MB routed).
# The dispatcher sees every call, on any thread, inside backward or not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

FLASH_HEAD_DIMS = 256

_route: torch.library.Library | None = None  # the registration, while a gpu_attention() is open
_depth = 0  # open gpu_attention() contexts


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """See the module docstring ([Note: attention routed in the dispatcher]). Contexts may nest."""
    global _route, _depth
    if _depth == 0:
        _route = torch.library.Library("aten", "IMPL")
        _route.impl("scaled_dot_product_attention", _attention, "AutogradCUDA")
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _route._destroy()
            _route = None


def _attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> torch.Tensor:
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: every query head gets its key
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    head_dim = query.shape[-1]
    flash = (
        attn_mask is None
        and query.dtype in (torch.float16, torch.bfloat16)
        and head_dim <= FLASH_HEAD_DIMS
        and head_dim % 8 == 0
    )
    if flash:
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )
        return out[0]
    bias = None
    if attn_mask is not None:
        bias = attn_mask
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                attn_mask.logical_not(), float("-inf")
            )
        bias = bias.expand(*query.shape[:-1], key.shape[-2])  # a view: no S x S per head
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale
    )
    return out[0]
