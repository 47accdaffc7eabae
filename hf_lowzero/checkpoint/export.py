"""Full (unsharded) views of the optimizer: model weights from a checkpoint on disk, and the
whole inner-optimizer state in torch's format from a live optimizer.

Example::

    weights = consolidate_checkpoint("ckpt/step-100")   # {name: full fp32 tensor}, no process group
    full = full_state_dict(opt)                         # collective; torch format on rank 0
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.checkpoint.layout import EXTRAS_FILE
from hf_lowzero.checkpoint.reader import ShardReader, read_metadata, read_row
from hf_lowzero.checkpoint.shards import ShardView
from hf_lowzero.zero import comm
from hf_lowzero.zero.partition import ParamShard

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


def consolidate_checkpoint(path: str | os.PathLike) -> OrderedDict[str, torch.Tensor]:
    """Full model weights by name from a sharded checkpoint (reads every rank file; no process group).

    Trainable params come from the fp32 master weights; frozen params and persistent buffers are
    returned in the dtype they were saved in.

    Example::

        >>> weights = consolidate_checkpoint("out/checkpoint-100/zero_optimizer")
        >>> model.load_state_dict(weights, strict=False)
    """
    path = Path(path)
    meta = read_metadata(path)
    reader = ShardReader(path, meta)
    full = OrderedDict()
    for name, saved in meta["params"].items():
        flat = torch.empty(saved["numel"], dtype=torch.float32)
        read_row(reader, f"master/{name}", saved["numel"], ParamShard(saved["numel"], 1), 0, flat)
        full[name] = flat.view(saved["shape"])
    for name, info in meta.get("extras", {}).items():
        full[name] = reader.read(EXTRAS_FILE, f"extra/{name}", info["shape"])
    return full


def full_state_dict(opt: LowLevelZeroOptimizer) -> dict[str, Any] | None:
    """The whole inner-optimizer state in torch's format, on rank 0 (None elsewhere). Collective.

    State tensors are full-size (the param's shape, unpadded, fp32); ``param_groups`` list params
    by position like ``torch.optim.Optimizer.state_dict()`` and by ``param_names``, so the result
    loads into a plain torch optimizer built over the same params in the same groups.
    """
    view = ShardView.of(opt)
    state: dict[int, dict[str, Any]] = {}
    for pos, shard in enumerate(view.shards):
        rows = view.row_state(pos)
        entry = dict(view.scalar_state(pos))
        for key in sorted(rows):
            value = rows[key]
            out = torch.empty(view.world_size * shard.shard_numel, dtype=value.dtype, device=value.device)
            comm.all_gather(out, value.contiguous(), view.process_group)
            entry[key] = out[: shard.numel].view(view.params[pos].shape).cpu()
        if entry:
            state[pos] = entry
    if view.rank != 0:
        return None
    groups = [{k: v for k, v in g.items()} for g in view.state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}
