"""Full (unsharded) views of the optimizer: model weights from a checkpoint on disk, and the
whole inner-optimizer state in torch's format from a live optimizer.

Example::

    weights = consolidate_checkpoint("ckpt/step-100")   # {name: full fp32 tensor}, no process group
    full = full_state_dict(opt)                         # collective; torch format on rank 0
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.checkpoint.layout import EXTRAS_FILE, extra_key, master_key
from hf_lowzero.checkpoint.reader import ShardReader, read_metadata, read_row
from hf_lowzero.checkpoint.shards import CheckpointError, ShardView
from hf_lowzero.zero.layout.params import canonical_name
from hf_lowzero.zero.layout.partition import ParamShard
from hf_lowzero.zero.runtime import comm

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


def consolidate_checkpoint(
    path: str | os.PathLike, base: torch.nn.Module | Mapping[str, torch.Tensor] | None = None
) -> OrderedDict[str, torch.Tensor]:
    """Full model weights by name from a sharded checkpoint (reads every rank file; no process group).

    Trainable params come from the master weights, as fp32 (bf16 masters are cast up, exactly);
    frozen params and persistent buffers are returned in the dtype they were saved in. A checkpoint
    saved with ``model_extras=False`` (the Trainer's; a LoRA run's) holds only the trainable params:
    ``base`` (a model, or its state dict) supplies the rest, which must have the recorded names and
    shapes.

    Example::

        >>> weights = consolidate_checkpoint("out/checkpoint-100/zero_optimizer", base=model)
        >>> model.load_state_dict(weights)

    Args:
        path: The checkpoint directory (the one holding ``zero_meta.json``).
        base: The model, or its state dict, that supplies the frozen params and persistent buffers a
            checkpoint saved with ``model_extras=False`` left out; unused (may be None) for a checkpoint
            that holds them.

    Returns:
        Every param and persistent buffer of the model by name, each a full tensor on the CPU.

    Raises:
        CheckpointError: The checkpoint is incomplete or corrupted (missing or unreadable metadata, a
            missing or truncated file, a tensor that is missing, of another shape or fails its checksum),
            or it needs ``base`` and ``base`` is None or lacks (or has other shapes for) the params and
            buffers it should supply.
    """
    path = Path(path)
    meta = read_metadata(path)
    reader = ShardReader(path, meta)
    full = OrderedDict()
    for name, saved in meta["params"].items():
        flat = torch.empty(saved["numel"], dtype=torch.float32)
        read_row(
            reader,
            master_key(name),
            saved["numel"],
            ParamShard(saved["numel"], world_size=1),
            0,
            flat,
            saved.get("owner"),
        )
        full[name] = flat.view(saved["shape"])
    for name, info in meta.get("extras", {}).items():
        full[name] = reader.read(EXTRAS_FILE, extra_key(name), info["shape"])
    external = meta.get("external", {})
    if external:
        full.update(_from_base(path, external, base))
    return full


def _from_base(path: Path, external: dict[str, Any], base) -> dict[str, torch.Tensor]:
    """The entries the checkpoint left to the model's own save, taken from ``base``."""
    if base is None:
        raise CheckpointError(
            f"{path}: holds only the trainable params; the frozen params/buffers {sorted(external)[:5]} "
            f"({len(external)} in all) were left to the model's own checkpoint. Pass base=<the model or "
            "its state dict> (CLI: --base-weights DIR_OR_FILE) to consolidate a complete model."
        )
    if isinstance(base, torch.nn.Module):
        base = base.state_dict()
    base = {canonical_name(k): v for k, v in base.items()}
    missing = [n for n, info in external.items() if n not in base or list(base[n].shape) != info["shape"]]
    if missing:
        raise CheckpointError(
            f"{path}: the base model lacks (or has other shapes for) {missing[:5]}; pass the base model "
            "this run was trained from"
        )
    return {n: base[n].detach().cpu() for n in external}


def full_state_dict(opt: LowLevelZeroOptimizer) -> dict[str, Any] | None:
    """The whole inner-optimizer state in torch's format, on rank 0 (None elsewhere). Collective.

    State tensors are full-size (the param's shape, unpadded, fp32); ``param_groups`` list params
    by position like ``torch.optim.Optimizer.state_dict()`` and by ``param_names``, so the result
    loads into a plain torch optimizer built over the same params in the same groups.

    Args:
        opt: The optimizer whose state to gather; every rank of its process group must call this.

    Returns:
        On rank 0, ``{"state": ..., "param_groups": ...}`` as ``torch.optim.Optimizer.state_dict()``
        returns it; None on every other rank.
    """
    view = ShardView.of(opt)
    state: dict[int, dict[str, Any]] = {}
    owned: dict[int, dict[str, Any]] = {}  # whole params this rank owns: their state as it is
    for pos, shard in enumerate(view.shards):
        if shard.whole:
            entry = view.state_dict["state"].get(pos)
            if entry and shard.owner == view.rank:
                owned[pos] = {
                    k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()
                }
            continue
        rows = view.row_state(pos)
        entry = dict(view.scalar_state(pos))
        for key in sorted(rows):
            # Gathered on the params' device: with offload the rows live in host memory, which NCCL
            # cannot send.
            value = rows[key].to(view.device)
            out = torch.empty(view.world_size * shard.shard_numel, dtype=value.dtype, device=view.device)
            comm.all_gather(out, value.contiguous(), view.process_group)
            entry[key] = out[: shard.numel].view(view.params[pos].shape).cpu()
        if entry:
            state[pos] = entry
    if any(shard.whole for shard in view.shards):
        parts = comm.gather_object(owned, view.process_group, view.device)  # on rank 0 only
        for part in parts or ():
            state.update(part)
        state = dict(sorted(state.items()))
    if view.rank != 0:
        return None
    groups = [{k: v for k, v in g.items()} for g in view.state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
