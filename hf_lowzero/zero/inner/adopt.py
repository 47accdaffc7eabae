"""Re-pointing the inner optimizer at this rank's masters: its inner params instead of the model's.

Example::

    inner_params = precision.inner_params                         # fp32 masters: views of the master rows
    inner_grads = [inner_view(s, store.piece(s)) for s in slots]
    adopt_inner_optimizer(optimizer, slots, inner_params, inner_grads, rank=rank)
    optimizer.param_groups[0]["params"]   # the inner params, not the model's params

# [Note: inner params]
# The inner optimizer steps one tensor per managed param that this rank owns a piece of, its
# *inner param*: this rank's master row (row shards, 1D), or the owned param's master in the param's
# shape (whole-parameter ownership); None for a param owned elsewhere (``layout.packing.inner_view``).
# With bf16 masters they are fp32 views of the step's scratch ([Note: bf16 masters] in
# ``update/master_precision.py``). They are fixed at construction, so they key the inner
# optimizer's state for good. Each one's ``.grad`` is the same view of the gradient store, set
# once (a step masks params used on no rank by setting it to None: ``update.step.UnusedMask``).
# After adoption the inner optimizer's groups hold the inner params, in the groups and order the
# model's params had ([Note: two sets of param groups] in ``groups.py``).
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.inner.policy import carry_bitsandbytes_overrides
from hf_lowzero.zero.layout.params import ParamSlot


def adopt_inner_optimizer(
    optimizer: torch.optim.Optimizer,
    slots: list[ParamSlot],
    inner_params: list[torch.Tensor | None],
    inner_grads: list[torch.Tensor | None],
    *,
    rank: int,
) -> None:
    """Replace every managed param in ``optimizer``'s groups by its inner param (``inner_params``,
    per slot; [Note: inner params]) and give each its gradient view (``inner_grads``). State the
    inner optimizer's constructor created for a param (Adagrad's ``sum``) moves to its inner param:
    this rank's slice of each element-wise tensor, as the row slices the param, or the whole of it."""
    for inner_param, grad in zip(inner_params, inner_grads):
        if inner_param is not None:
            inner_param.grad = grad  # for good: a step masks the params used on no rank (UnusedMask)
    slot_of = {id(slot.param): slot for slot in slots}
    for group in optimizer.param_groups:
        adopted = []
        for slot in (slot_of[id(p)] for p in group["params"]):
            inner_param = inner_params[slot.index]
            if inner_param is None:
                continue
            created = optimizer.state.pop(slot.param, None)
            if created:
                optimizer.state[inner_param] = {
                    key: _piece_of(value, slot, inner_param, rank=rank) for key, value in created.items()
                }
            adopted.append(inner_param)
        group["params"] = adopted
    carry_bitsandbytes_overrides(
        optimizer, {id(s.param): inner_params[s.index] for s in slots if inner_params[s.index] is not None}
    )


def _piece_of(value, slot: ParamSlot, inner_param: torch.Tensor, *, rank: int):
    if isinstance(value, torch.Tensor) and value.shape == slot.param.shape:
        return slot.shard.row_of(value, rank).to(inner_param).view(inner_param.shape)
    return value.clone() if isinstance(value, torch.Tensor) else value
