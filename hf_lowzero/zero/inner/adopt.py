"""Re-pointing the inner optimizer at this rank's masters: what it steps instead of each param.

After adoption the inner optimizer's groups hold, per param, this rank's master piece (a 1D row
with row shards; the param's shape when owned whole) and nothing for params owned elsewhere
([Note: two sets of param groups] in ``groups.py``). Each master's ``.grad`` is a fixed view of the
gradient store, set once.

Example::

    held = [held_piece(s, precision.step_rows[s.index]) for s in slots]   # fp32: the master rows
    grads = [held_piece(s, store.piece(s)) for s in slots]
    adopt_inner_optimizer(optimizer, slots, held, grads, rank=rank)
    optimizer.param_groups[0]["params"]   # the held pieces, not the model's params
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.inner.policy import carry_bitsandbytes_overrides
from hf_lowzero.zero.layout.params import ParamSlot


def held_piece(slot: ParamSlot, row: torch.Tensor) -> torch.Tensor | None:
    """What the inner optimizer sees of ``row`` (this rank's piece of ``slot``): the row itself
    (row shards), the param's shape (owned whole), or None (owned by another rank)."""
    if not slot.shard.whole:
        return row
    return row.view(slot.param.shape) if slot.row_numel else None


def adopt_inner_optimizer(
    optimizer: torch.optim.Optimizer,
    slots: list[ParamSlot],
    held: list[torch.Tensor | None],
    grads: list[torch.Tensor | None],
    *,
    rank: int,
) -> None:
    """Replace every managed param in ``optimizer``'s groups by its held piece (``held``, per slot)
    and give each piece its gradient view. State the inner optimizer's constructor created for a
    param (Adagrad's ``sum``) moves to its piece: this rank's slice of each element-wise tensor, as
    the row slices the param, or the whole of it."""
    for master, grad in zip(held, grads):
        if master is not None:
            master.grad = grad  # for good: a step masks the params used on no rank (UnusedMask)
    slot_of = {id(slot.param): slot for slot in slots}
    for group in optimizer.param_groups:
        adopted = []
        for slot in (slot_of[id(p)] for p in group["params"]):
            master = held[slot.index]
            if master is None:
                continue
            created = optimizer.state.pop(slot.param, None)
            if created:
                optimizer.state[master] = {
                    key: _piece_of(value, slot, master, rank=rank) for key, value in created.items()
                }
            adopted.append(master)
        group["params"] = adopted
    carry_bitsandbytes_overrides(optimizer, {id(s.param): held[s.index] for s in slots if held[s.index] is not None})


def _piece_of(value, slot: ParamSlot, master: torch.Tensor, *, rank: int):
    if isinstance(value, torch.Tensor) and value.shape == slot.param.shape:
        return slot.shard.row_of(value, rank).to(master).view(master.shape)
    return value.clone() if isinstance(value, torch.Tensor) else value
