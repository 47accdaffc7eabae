"""What checkpoint code reads of a ``LowLevelZeroOptimizer``, through its public surface only
(``state_dict()``, ``param_groups``, ``model``, ``world_size``/``rank``/``process_group``), and the
small helpers shared by saving, loading and export.

Example::

    view = ShardView.of(opt)
    view.names[0], view.shards[0].owned_range(view.rank)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.zero.params import canonical_name
from hf_lowzero.zero.partition import ParamShard
from hf_lowzero.zero.shard_state import SECTION, is_row_state

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the problem."""


@dataclass
class ShardView:
    """This rank's shard, by position (torch's numbering: groups in order, params in order)."""

    state_dict: dict[str, Any]
    names: list[str]
    params: list[torch.nn.Parameter]
    shards: list[ParamShard]
    world_size: int
    rank: int
    process_group: Any

    @classmethod
    def of(cls, opt: LowLevelZeroOptimizer) -> ShardView:
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        return cls(
            state_dict=sd,
            names=[n for g in sd["param_groups"] for n in g["param_names"]],
            params=params,
            shards=[ParamShard(p.numel(), opt.world_size) for p in params],
            world_size=opt.world_size,
            rank=opt.rank,
            process_group=opt.process_group,
        )

    @property
    def zero(self) -> dict[str, Any]:
        return self.state_dict[SECTION]

    def row_state(self, pos: int) -> dict[str, torch.Tensor]:
        state = self.state_dict["state"].get(pos, {})
        return {k: v for k, v in state.items() if is_row_state(v, self.shards[pos], self.rank)}

    def scalar_state(self, pos: int) -> dict[str, Any]:
        state = self.state_dict["state"].get(pos, {})
        return {k: v for k, v in state.items() if not is_row_state(v, self.shards[pos], self.rank)}


def unsharded_state(model: torch.nn.Module, managed: list[torch.nn.Parameter], managed_names: list[str]):
    """Model state that is not sharded: frozen params and persistent buffers (rank 0 saves them),
    so a consolidated checkpoint is a complete model. Tied duplicates of managed params are skipped."""
    managed_ptrs = {p.data_ptr() for p in managed}
    names = set(managed_names)
    return {
        canonical_name(name): t
        for name, t in model.state_dict(keep_vars=False).items()
        if t.data_ptr() not in managed_ptrs and canonical_name(name) not in names
    }


def scalar_to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"unsupported optimizer state tensor of shape {tuple(value.shape)}")
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return list(value)
    return value


def scalar_from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def atomic_write(target: Path, write) -> None:
    """``write(tmp_path)``, fsync, then rename over ``target``: readers never see half a file."""
    tmp = target.with_name(target.name + ".tmp")
    write(str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
