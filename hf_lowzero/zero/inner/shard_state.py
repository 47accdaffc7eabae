"""This rank's optimizer shard as a ``torch.optim`` state dict, and its validation.

The format is torch's (``state`` keyed by position, ``param_groups`` listing positions, in the
order of the optimizer's groups), so code written for ``torch.optim`` can save, inspect and
restore it; the tensors are this rank's rows. One extra section, ``"zero"``, holds what torch's
format has no place for and an exact restore needs:

    {"state": {0: {"step": tensor(3.), "exp_avg": row, "exp_avg_sq": row}, ...},
     "param_groups": [{"lr": 1e-3, ..., "params": [0, 1], "param_names": ["w", "b"]}, ...],
     "zero": {"format_version": 2, "world_size": 2, "rank": 0, "stage": 2, "partition": "rows",
              "numels": [numel of each position], "owners": [None, ...],
              "master_rows": {0: row, ...},
              "loss_scaler": {...}, "skipped_steps": 0, "consecutive_skips": 0}}

A master row is 1D, in the masters' dtype (fp32, or bf16: ``ZeroConfig.master_dtype``; loading
casts, so either loads into either): this rank's piece of the param, ``ParamShard(numel,
world_size=W, owner=owner).piece_numel(rank)`` elements (padding included). With row shards (``owners`` all None) every
element-wise state tensor is such a row; with whole-parameter ownership (``partition="params"``,
``owners`` the rank of each) ``state`` holds only the owned params, with whatever state tensors the
inner optimizer keeps, in their own shapes, and the other positions' rows are empty.
Like ``torch.optim.Optimizer.state_dict()``, the tensors are references to the live state: copy or
save them before training on.

Which kernel an optimizer runs (``fused``, ``foreach``, ``capturable``: ``inner.KERNEL_CHOICES``)
is saved with the groups but never restored: it belongs to where this optimizer steps (a GPU run's
checkpoint resumed with offload keeps the fused host kernel; ``capturable=True`` from a GPU run
would break a host step), so loading keeps the loading optimizer's own choice.

Example::

    saved = shard_state_dict(parts)      # what opt.state_dict() returns
    load_shard_state(parts, saved)       # what opt.load_state_dict(saved) does
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_lowzero.zero.inner.groups import NOT_HYPERPARAMETERS, ParamGroups
from hf_lowzero.zero.inner.policy import KERNEL_CHOICES
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.layout.partition import ParamShard
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.loss_scaler import ConstantScale, DynamicLossScaler
from hf_lowzero.zero.update.step import SkipCounts
from hf_lowzero.zero.update.write_gate import WriteGate


@dataclass(frozen=True, eq=False)
class ShardParts:
    """What one rank's shard is made of, as the optimizer holds it (fixed at construction)."""

    slot_at: list[ParamSlot]  # by position: torch's numbering (groups in order, params in order)
    inner_params: list[torch.Tensor | None]  # per slot index, or None ([Note: inner params] in ``adopt.py``)
    master_rows: list[torch.Tensor]  # per slot index: 1D, this rank's piece in the masters' dtype
    optim: torch.optim.Optimizer
    groups: ParamGroups
    scaler: DynamicLossScaler | ConstantScale
    counts: SkipCounts
    gate: WriteGate  # every writer of the masters and state passes it ([Note: one gate for the shard's writers])
    stage: int
    partition: str
    shard: ShardGroup
    exact: Any = None  # the ExactReducer with reduction="exact" (its grid is saved), else None


SECTION = "zero"
SHARD_FORMAT_VERSION = 2  # 2 added "partition" and "owners"; 1 (row shards only) still loads


def state_dict_error(state_dict: Any, expected: dict[str, Any]) -> str | None:
    """Why ``state_dict`` cannot be loaded into the shard described by ``expected`` (the ``"zero"``
    section of this optimizer's own state dict, plus ``group_sizes``), or None when it can."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups", SECTION} <= set(state_dict):
        return (
            "not a LowLevelZeroOptimizer state dict (expected the keys 'state', 'param_groups' and "
            f"'{SECTION}'); a plain torch optimizer's state dict cannot be loaded into a sharded "
            "optimizer, and sharded checkpoints load with hf_lowzero.load_checkpoint()"
        )
    zero = state_dict[SECTION]
    if zero.get("format_version") not in (1, SHARD_FORMAT_VERSION):
        return (
            f"unknown shard state format version {zero.get('format_version')!r} "
            f"(this code reads 1 to {SHARD_FORMAT_VERSION})"
        )
    where = (zero.get("rank"), zero.get("world_size"))
    if where != (expected["rank"], expected["world_size"]):
        return (
            f"the state dict holds the shard of rank {where[0]} of {where[1]}, this is rank "
            f"{expected['rank']} of {expected['world_size']}; load_state_dict() restores the same rank "
            "at the same world size. Use hf_lowzero.save_checkpoint()/load_checkpoint() to change it."
        )
    sizes = [len(g.get("params", ())) for g in state_dict["param_groups"]]
    if sizes != expected["group_sizes"]:
        return f"param group sizes {sizes} differ from this optimizer's {expected['group_sizes']}"
    if list(zero.get("numels", ())) != expected["numels"]:
        return "the parameters' sizes differ from this optimizer's: a state dict of another model"
    partition, owners = zero.get("partition", "rows"), list(zero.get("owners", [None] * len(expected["numels"])))
    if (partition, owners) != (expected["partition"], expected["owners"]):
        return (
            f"the state dict was saved with partition={partition!r}, this optimizer uses "
            f"partition={expected['partition']!r} (or another owner plan); load_state_dict() restores the same "
            "layout. Use hf_lowzero.save_checkpoint()/load_checkpoint() to change it."
        )
    positions = set(range(len(expected["numels"])))
    if [p for g in state_dict["param_groups"] for p in g["params"]] != sorted(positions):
        return "param_groups must list positions 0..N-1 in order, as torch's state_dict() does"
    masters = zero.get("master_rows", {})
    if set(masters) != positions:
        return f"master rows for positions {sorted(masters)[:5]}..., expected one per position"
    for pos, (numel, owner) in enumerate(zip(expected["numels"], owners)):
        row_numel = ParamShard(numel, world_size=expected["world_size"], owner=owner).piece_numel(expected["rank"])
        if tuple(masters[pos].shape) != (row_numel,):
            return f"master row {pos} has shape {tuple(masters[pos].shape)}, expected ({row_numel},)"
        for key, value in state_dict["state"].get(pos, {}).items():
            if owner is not None:  # whole params: the inner optimizer's own state shapes
                if row_numel == 0:
                    return f"state {key!r} of position {pos}, which rank {owner} owns, not this rank"
                continue
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != (row_numel,):
                return f"state {key!r} of position {pos} has shape {tuple(value.shape)}, expected ({row_numel},)"
    if set(state_dict["state"]) - positions:
        return f"state for unknown positions {sorted(set(state_dict['state']) - positions)[:5]}"
    return None


def is_row_state(value: Any, shard: ParamShard, *, rank: int) -> bool:
    """An element-wise state tensor: one value per element of ``rank``'s piece (a 1D row, or a whole
    param's state in any shape of the param's numel), as opposed to a scalar or a tensor of
    another size (factored moments, block scales, quantization maps: ``is_whole_state``)."""
    numel = shard.piece_numel(rank)
    return (
        isinstance(value, torch.Tensor)
        and numel > 0
        and value.numel() == numel
        and (value.dim() == 1 if not shard.whole else value.dim() >= 1)
    )


def is_whole_state(value: Any, shard: ParamShard, *, rank: int) -> bool:
    """A state tensor of a whole-owned param that is neither element-wise nor a scalar."""
    return (
        shard.whole
        and isinstance(value, torch.Tensor)
        and not is_row_state(value, shard, rank=rank)
        and value.dim() >= 1  # 0-dim tensors (``step``) are scalars
    )


def shard_state_dict(parts: ShardParts) -> dict[str, Any]:
    """The shard in the format above. Local and cheap: no communication, no copies."""
    inner = parts.optim.state
    state = {}
    for pos, slot in enumerate(parts.slot_at):
        inner_param = parts.inner_params[slot.index]
        entry = inner.get(inner_param) if inner_param is not None else None
        if entry:
            state[pos] = dict(entry)
    parts.groups.sync()
    groups, pos = [], 0
    for group in parts.groups.outer:
        n = len(group["params"])
        names = [s.name for s in parts.slot_at[pos : pos + n]]
        groups.append(dict(group, params=list(range(pos, pos + n)), param_names=names))
        pos += n
    zero = {
        "format_version": SHARD_FORMAT_VERSION,
        "world_size": parts.shard.world_size,
        "rank": parts.shard.rank,
        "stage": parts.stage,
        "partition": parts.partition,
        "numels": [s.shard.numel for s in parts.slot_at],
        "owners": [s.shard.owner for s in parts.slot_at],
        "master_rows": {pos: parts.master_rows[s.index] for pos, s in enumerate(parts.slot_at)},
        "loss_scaler": parts.scaler.state_dict(),
        "skipped_steps": parts.counts.skipped,
        "consecutive_skips": parts.counts.consecutive,
        "exact_grid": None if parts.exact is None else parts.exact.grid_state(),  # [Note: exact reduction]
    }
    return {"state": state, "param_groups": groups, SECTION: zero}


def load_shard_state(parts: ShardParts, state_dict: dict[str, Any]) -> None:
    """Restore the shard from :func:`shard_state_dict` of the same rank and world size, validated
    before anything changes. Local: the model's params are not touched. Kernel choices stay the
    loading optimizer's (see the module docstring)."""
    own = shard_state_dict(parts)[SECTION]
    expected = own | {"group_sizes": [len(g["params"]) for g in parts.groups.outer]}
    error = state_dict_error(state_dict, expected)
    if error is None and state_dict[SECTION]["loss_scaler"].get("kind") != own["loss_scaler"]["kind"]:
        error = (
            f"loss scaler {state_dict[SECTION]['loss_scaler'].get('kind')!r} saved, this optimizer uses "
            f"{own['loss_scaler']['kind']!r}: the params' dtype differs from the saved run's"
        )
    if error is not None:
        raise ValueError(f"LowLevelZeroOptimizer.load_state_dict: {error}")
    zero = state_dict[SECTION]
    parts.gate.before_write()  # [Note: one gate for the shard's writers]
    with torch.no_grad():
        for pos, slot in enumerate(parts.slot_at):
            parts.master_rows[slot.index].copy_(zero["master_rows"][pos])
    saved_groups = state_dict["param_groups"]
    skipped = (*NOT_HYPERPARAMETERS, *KERNEL_CHOICES)
    hyper = [{k: v for k, v in g.items() if k not in skipped} for g in saved_groups]
    # Positions of the params this rank has an inner param for, renumbered as the inner optimizer lists them.
    stepped = [pos for pos, s in enumerate(parts.slot_at) if parts.inner_params[s.index] is not None]
    inner_pos = {pos: i for i, pos in enumerate(stepped)}
    kernels = [{k: g[k] for k in KERNEL_CHOICES if k in g} for g in parts.optim.param_groups]
    inner_groups = [
        dict(h, **kernel, params=[inner_pos[p] for p in g["params"] if p in inner_pos])
        for h, kernel, g in zip(hyper, kernels, saved_groups)
    ]
    state = {
        inner_pos[pos]: {k: _in_shape(v, parts.slot_at[pos]) for k, v in entry.items()}
        for pos, entry in state_dict["state"].items()
        if pos in inner_pos
    }
    parts.optim.load_state_dict({"state": state, "param_groups": inner_groups})
    for group, h in zip(parts.groups.outer, hyper):
        group.update(h)
    parts.groups.sync()
    parts.scaler.load_state_dict(zero["loss_scaler"])
    parts.counts.skipped = int(zero["skipped_steps"])
    parts.counts.consecutive = int(zero["consecutive_skips"])
    if parts.exact is not None and zero.get("exact_grid"):
        parts.exact.load_grid_state(zero["exact_grid"])


def _in_shape(value, slot):
    """A whole param's element-wise state saved flat (checkpoints store it 1D) in the param's shape."""
    if slot.shard.whole and isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == slot.shard.numel:
        return value.view(slot.param.shape)
    return value
