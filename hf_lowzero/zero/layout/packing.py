"""The one home of the flat layouts: packing gradients into a bucket, unpacking a gathered bucket
into the params, and the views of one bucket or one param in the owned space.

A bucket's packed buffer is rank-major (``buckets.py``): chunk ``r`` holds rank ``r``'s piece of
every param of the bucket. A rank's *owned space* is one flat tensor holding its pieces bucket after
bucket (``Bucket.row_offset``, ``ParamSlot.row_offset``); the fp32 master rows and the gradient
store are laid out in it.

Example::

    pack_bucket(bucket, flat, world_size=W)          # p.grad of every param -> rank-major chunks
    bucket_view(store.flat, bucket)                  # this rank's chunk of the bucket
    piece_view(master.flat, slot)                    # this rank's piece of one param
    inner_view(slot, piece_view(master.flat, slot))  # that piece as the inner optimizer steps it
    unpack_bucket(bucket, gathered, world_size=W)    # every rank's chunks -> the params
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import repeat

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.layout.row_scatter import RowScatter, row_scatter


def bucket_view(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """This rank's chunk of ``bucket`` in an owned-space tensor (1D, ``row_numel``)."""
    return flat[bucket.row_offset : bucket.row_offset + bucket.row_numel]


def piece_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """This rank's piece of one param in an owned-space tensor (1D, ``row_numel``, possibly empty)."""
    return flat[slot.row_offset : slot.row_offset + slot.row_numel]


def inner_view(slot: ParamSlot, piece: torch.Tensor) -> torch.Tensor | None:
    """``piece`` (this rank's piece of ``slot``, 1D) as the inner optimizer steps it ([Note: inner
    params] in ``inner/adopt.py``): the row itself (row shards), in the param's shape (owned whole),
    or None (owned by another rank). A gradient piece gets the same view."""
    if not slot.shard.whole:
        return piece
    return piece.view(slot.param.shape) if slot.row_numel else None


GRAD = operator.attrgetter("grad")


def missing_any(grads) -> bool:
    """Whether any entry of ``grads`` is None (C-level scan: ``None in grads`` would call
    ``Tensor.__eq__`` on every gradient)."""
    return any(map(operator.is_, grads, repeat(None)))


def holding_any(params) -> bool:
    """Whether any of ``params`` holds a ``.grad`` (C-level scan)."""
    return any(map(operator.is_not, map(GRAD, params), repeat(None)))


@dataclass(frozen=True, eq=False)
class PackPlan:
    """What packing a bucket needs, resolved once per bucket so that a pack costs no Python work
    per param beyond reading and freeing its ``.grad``.

    ``torch._chunk_cat(grads, dim=0, num_chunks=W)`` splits each tensor into W chunks along dim 0
    (padding dim 0). That equals our flat layout (W equal pieces of the flattened param, padded at
    the end) whenever dim 0 divides by W or the tensor is 1D, so those gradients go in as they
    are; the others (``flatten``: 0-d, or dim 0 not a multiple of W) are viewed 1D first.
    """

    params: tuple[torch.nn.Parameter, ...]  # in packing order
    flatten: tuple[int, ...]  # positions whose gradient is viewed 1D before packing
    chunks: int  # W for row shards, 1 for whole params (plain concatenation)


def pack_plan(bucket: Bucket, *, world_size: int) -> PackPlan:
    chunks = 1 if bucket.whole else world_size
    flatten = tuple(
        i
        for i, slot in enumerate(bucket.slots)
        if slot.param.dim() == 0 or (slot.param.dim() > 1 and slot.param.shape[0] % chunks)
    )
    return PackPlan(tuple(slot.param for slot in bucket.slots), flatten, chunks)


def pack_bucket(
    bucket: Bucket,
    flat: torch.Tensor,
    *,
    world_size: int,
    plan: PackPlan | None = None,
    grads: list | None = None,
    divide: bool = True,
) -> None:
    """Copy every param's ``.grad`` (or ``grads``, read from them) into the rank-major ``flat``
    buffer, then free every ``.grad``.

    One ``torch._chunk_cat`` kernel (FSDP2's packing op) pads each flattened gradient to a multiple
    of the world size and lays the W chunks out rank-major, whatever the number of params; whole
    params (ordered by owner) are simply concatenated. A param with no gradient contributes zeros
    (see [Note: bucket order]). The result is divided by ``world_size`` so that a SUM collective
    yields the average, unless ``divide`` is False (the collective divides: [Note: the divide in the
    collective] in ``runtime/comm.py``). ``plan`` is :func:`pack_plan` of the bucket, built once by the caller.
    """
    plan = plan or pack_plan(bucket, world_size=world_size)
    grads = list(map(GRAD, plan.params)) if grads is None else list(grads)
    if missing_any(grads):
        grads = [
            torch.zeros(p.shape, dtype=bucket.dtype, device=bucket.device) if g is None else g
            for p, g in zip(plan.params, grads)
        ]
    for i in plan.flatten:
        grads[i] = grads[i].reshape(-1)
    torch._chunk_cat(
        grads, dim=0, num_chunks=plan.chunks, out=flat.view(plan.chunks, bucket.packed_numel // plan.chunks)
    )
    for p in plan.params:
        p.grad = None
    if world_size > 1 and divide:
        flat.div_(world_size)


@dataclass(frozen=True, eq=False)
class UnpackPlan:
    """Where a gathered bucket goes, resolved once per bucket: the split sizes and, per param, the
    view of it that receives its part (None: a padded param, through a temporary)."""

    sizes: tuple[int, ...]
    outs: tuple[torch.Tensor | None, ...]
    padded: tuple[int, ...]  # positions of the None entries
    scatter: RowScatter | None = None  # the same copies as one call of ours ([Note: one call per unpack])


def unpack_targets(bucket: Bucket, *, world_size: int) -> UnpackPlan:
    """The :class:`UnpackPlan` of ``bucket``. Row shards: a param whose numel divides by W receives
    its rows through a ``[W, shard_numel]`` view of itself. Whole params: their flat views."""
    if bucket.whole:
        outs = tuple(slot.param.view(-1) for slot in bucket.slots)
        sizes = tuple(slot.shard.numel for slot in bucket.slots)
        scatter = row_scatter(outs, sizes, chunks=1, chunk_numel=bucket.packed_numel, device=bucket.device)
        return UnpackPlan(sizes, outs, (), scatter)
    outs = tuple(
        slot.param.view(world_size, slot.shard.shard_numel) if slot.shard.padding == 0 else None
        for slot in bucket.slots
    )
    padded = tuple(i for i, out in enumerate(outs) if out is None)
    sizes = tuple(slot.shard.shard_numel for slot in bucket.slots)
    scatter = row_scatter(outs, sizes, chunks=world_size, chunk_numel=bucket.row_numel, device=bucket.device)
    return UnpackPlan(sizes, outs, padded, scatter)


@torch.no_grad()
def unpack_bucket(
    bucket: Bucket, gathered: torch.Tensor, *, world_size: int, targets: UnpackPlan | None = None
) -> None:
    """Copy a gathered rank-major bucket (``packed_numel`` flat) into its params.

    On the CPU, small params take one call of our own kernel ([Note: one call per unpack] in
    ``row_scatter.py``). Row shards (``[W, row_numel]``): one ``split_with_sizes_copy`` kernel writes every param whose
    numel divides by W straight into it; a padded param goes through a temporary and drops its
    padding. ``targets`` is :func:`unpack_targets` of the bucket, built once by the caller. Whole
    params: the bucket is the params back to back, one ``split_with_sizes_copy`` into them all.
    """
    plan = unpack_targets(bucket, world_size=world_size) if targets is None else targets
    if plan.scatter is not None and gathered.is_contiguous() and not is_fake(gathered):
        plan.scatter(gathered)  # [Note: one call per unpack]
        return
    if bucket.whole:
        torch.split_with_sizes_copy(gathered, list(plan.sizes), out=list(plan.outs))
        return
    outs = list(plan.outs)
    for i in plan.padded:
        outs[i] = torch.empty(world_size, plan.sizes[i], dtype=bucket.dtype, device=bucket.device)
    torch.split_with_sizes_copy(gathered.view(world_size, bucket.row_numel), list(plan.sizes), dim=1, out=outs)
    for i in plan.padded:
        slot = bucket.slots[i]
        slot.param.view(-1).copy_(outs[i].view(-1)[: slot.shard.numel])
