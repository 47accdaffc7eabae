"""The managed parameters: which ones the optimizer shards, and the guard that they stay as wrapped.

Example::

    slots = managed_slots(model, inner_optimizer, world_size=2)
    ...
    check_unchanged(slots)   # raises if someone ran model.half() after wrapping

# [Note: params are fixed at wrap time]
# Buckets (their dtype, device and byte size), the fp32 master rows and the all-gather targets are
# built from each parameter's dtype, device and storage when the optimizer is created. A later
# ``model.half()``, ``model.to(device)`` or ``p.data = ...`` replaces that storage: the buckets would
# then reduce in the old dtype (fp16 with no loss scaling) and updates would go to tensors the model
# no longer uses. Every ``backward()`` (before autograd runs) and every ``step()`` (before anything
# is updated) checks each parameter against what was recorded, and refuses with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_lowzero.zero.layout.partition import ParamShard, assign_owners


@dataclass(eq=False)
class ParamSlot:
    """One managed parameter: where its shard sits in its bucket and in the owned-rows space."""

    index: int  # position in the model's registration order of managed params
    name: str
    param: torch.nn.Parameter
    shard: ParamShard
    bucket_index: int = -1
    row_offset: int = -1  # start of this rank's piece in the owned-rows space
    row_numel: int = -1  # length of this rank's piece (``shard.piece_numel(rank)``)
    wrapped_as: tuple = field(default=(), repr=False)  # (dtype, device, data_ptr) at wrap time

    def __post_init__(self) -> None:
        self.wrapped_as = _identity(self.param)


def canonical_name(name: str) -> str:
    """A parameter or buffer name as the uncompiled model has it: ``torch.compile`` wraps a module
    in an ``OptimizedModule`` whose names carry ``_orig_mod.``; checkpoints never do, so compiled
    and uncompiled runs share checkpoints and consolidation yields names ``from_pretrained`` knows."""
    return name.replace("_orig_mod.", "")


def _identity(p: torch.Tensor) -> tuple:
    return p.dtype, p.device, p.data_ptr()


class WrapGuard:
    """Checks that no managed param changed dtype, device or storage since wrapping (see
    [Note: params are fixed at wrap time]). Any such change gives a param new storage, so one
    pass over the data pointers decides; the details are worked out only for the error."""

    def __init__(self, slots: list[ParamSlot]) -> None:
        self.slots = slots
        self._params = [slot.param for slot in slots]
        self._pointers = [slot.wrapped_as[2] for slot in slots]

    def check(self) -> None:
        if list(map(torch.Tensor.data_ptr, self._params)) != self._pointers:
            check_unchanged(self.slots)


def check_unchanged(slots: list[ParamSlot]) -> None:
    """Raise if a managed param's dtype, device or storage changed since wrapping (see
    [Note: params are fixed at wrap time])."""
    for slot in slots:
        now = _identity(slot.param)
        if now == slot.wrapped_as:
            continue
        (old_dtype, old_device, _), (dtype, device, _) = slot.wrapped_as, now
        if dtype != old_dtype:
            what = f"dtype changed from {old_dtype} to {dtype}"
        elif device != old_device:
            what = f"device changed from {old_device} to {device}"
        else:
            what = "storage was replaced (p.data = ... or a module conversion)"
        raise RuntimeError(
            f"parameter {slot.name!r}: {what} after it was wrapped by LowLevelZeroOptimizer; nothing was "
            "reduced or updated. The optimizer's buckets and fp32 master rows are built for the tensors "
            "it was given: cast or move the model first (model.to(torch.bfloat16), model.cuda(), ...), "
            "then build the inner optimizer and wrap it."
        )


def managed_slots(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, world_size: int, whole: bool = False
) -> list[ParamSlot]:
    """Validate that ``optimizer`` holds exactly ``model``'s trainable params; one slot each, split
    in rows or (``whole``) owned whole by one rank each ([Note: two ways to own a parameter])."""
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    in_optimizer: set[int] = set()
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model; build the inner optimizer from model.parameters() (or "
                    "groups of them) of the same model you pass to LowLevelZeroOptimizer."
                )
            if not p.requires_grad:
                raise ValueError(
                    f"parameter {names[id(p)]!r} is in the optimizer but has requires_grad=False; "
                    "leave frozen parameters out of the optimizer."
                )
            in_optimizer.add(id(p))
    trainable = [(canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in trainable if id(p) not in in_optimizer]
    if missing:
        raise ValueError(
            f"model parameters {missing[:5]}{'...' if len(missing) > 5 else ''} require grad but are "
            "not in the optimizer; add them to a param group or set requires_grad=False."
        )
    if not trainable:
        raise ValueError("the model has no trainable parameters (none with requires_grad=True)")
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        raise ValueError(f"all trainable parameters must be on one device, found {sorted(map(str, devices))}")
    for n, p in trainable:
        if not p.is_floating_point() or not p.is_contiguous():
            raise ValueError(f"parameter {n!r} must be a contiguous floating-point tensor (got {p.dtype})")
    owners = (
        assign_owners([p.numel() for _, p in trainable], world_size=world_size) if whole else [None] * len(trainable)
    )
    return [
        ParamSlot(index=i, name=n, param=p, shard=ParamShard(p.numel(), world_size=world_size, owner=owner))
        for i, ((n, p), owner) in enumerate(zip(trainable, owners))
    ]
