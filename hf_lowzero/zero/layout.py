"""The one home of the flat layouts: packing gradients into a bucket, unpacking a gathered bucket
into the params, and the views of one bucket or one param in the owned space.

A bucket's packed buffer is rank-major (``buckets.py``): chunk ``r`` holds rank ``r``'s piece of
every param of the bucket. A rank's *owned space* is one flat tensor holding its pieces bucket after
bucket (``Bucket.row_offset``, ``ParamSlot.row_offset``); the fp32 master rows and the gradient
store are laid out in it.

Example::

    pack_bucket(bucket, flat, world_size)            # p.grad of every param -> rank-major chunks
    bucket_view(store.flat, bucket)                  # this rank's chunk of the bucket
    piece_view(master.flat, slot)                    # this rank's piece of one param
    unpack_bucket(bucket, gathered, world_size)      # every rank's chunks -> the params
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.params import ParamSlot


def bucket_view(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """This rank's chunk of ``bucket`` in an owned-space tensor (1D, ``row_numel``)."""
    return flat[bucket.row_offset : bucket.row_offset + bucket.row_numel]


def piece_view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """This rank's piece of one param in an owned-space tensor (1D, ``row_numel``, possibly empty)."""
    return flat[slot.row_offset : slot.row_offset + slot.row_numel]


def pack_bucket(bucket: Bucket, flat: torch.Tensor, world_size: int) -> None:
    """Copy every param's ``.grad`` into the rank-major ``flat`` buffer, then free it.

    One ``torch._chunk_cat`` kernel (FSDP2's packing op) pads each flattened gradient to a multiple
    of the world size and lays the W chunks out rank-major, whatever the number of params; whole
    params (ordered by owner) are simply concatenated. A param with no gradient contributes zeros
    (see [Note: bucket order]). The result is divided by ``world_size`` so that a SUM collective
    yields the average.
    """
    grads = []
    for slot in bucket.slots:
        grad = slot.param.grad
        grads.append(
            torch.zeros(slot.shard.numel, dtype=bucket.dtype, device=bucket.device) if grad is None else grad.view(-1)
        )
        slot.param.grad = None
    chunks = 1 if bucket.whole else world_size
    torch._chunk_cat(grads, dim=0, num_chunks=chunks, out=flat.view(chunks, bucket.packed_numel // chunks))
    if world_size > 1:
        flat.div_(world_size)


def unpack_targets(bucket: Bucket, world_size: int) -> list[torch.Tensor | None]:
    """Per param of a row-shard ``bucket``: its ``[W, shard_numel]`` view when its numel divides by W
    (the gathered rows land in it directly), else None (it needs a temporary to drop the padding)."""
    return [
        slot.param.view(world_size, slot.shard.shard_numel) if slot.shard.padding == 0 else None
        for slot in bucket.slots
    ]


@torch.no_grad()
def unpack_bucket(
    bucket: Bucket, gathered: torch.Tensor, world_size: int, targets: list[torch.Tensor | None] | None = None
) -> None:
    """Copy a gathered rank-major bucket (``packed_numel`` flat) into its params.

    Row shards (``[W, row_numel]``): one ``split_with_sizes_copy`` kernel writes every param whose
    numel divides by W straight into it; a padded param goes through a temporary and drops its
    padding. ``targets`` is :func:`unpack_targets` of the bucket, built once by the caller. Whole
    params: the bucket is the params back to back, one ``split_with_sizes_copy`` into them all.
    """
    if bucket.whole:
        sizes = [slot.shard.numel for slot in bucket.slots]
        torch.split_with_sizes_copy(gathered, sizes, out=[slot.param.view(-1) for slot in bucket.slots])
        return
    targets = unpack_targets(bucket, world_size) if targets is None else targets
    outs = [
        torch.empty(world_size, slot.shard.shard_numel, dtype=bucket.dtype, device=bucket.device)
        if target is None
        else target
        for slot, target in zip(bucket.slots, targets)
    ]
    sizes = [slot.shard.shard_numel for slot in bucket.slots]
    torch.split_with_sizes_copy(gathered.view(world_size, bucket.row_numel), sizes, dim=1, out=outs)
    for slot, target, out in zip(bucket.slots, targets, outs):
        if target is None:
            slot.param.view(-1).copy_(out.view(-1)[: slot.shard.numel])
