"""What a snapshot's stop copies, worked out once and reused while the shard keeps its tensors.

Example::

    plan = last if last is not None and last.fits(view) else CopyPlan.of(view)
    for key, t in plan.tensors.items():       # the live tensors (slices of them), by checkpoint key
        buffers[key].copy_(t)

# [Note: copy plan]
# ``shard_tensors`` sorts every state entry of every param (element-wise, whole, packed, scalar)
# and slices each one, and the stop then finds the scalar entries to freeze the same way: most of
# the stop's Python for the main job's 84 small tensors (``benchmarks/snapshot_write.py``). Between
# two snapshots the optimizer updates its state in place, so the last stop's answer holds as long
# as every state entry and master row is the same tensor object over the same memory, with the
# same shape and dtype, and every other entry has the same type: ``fits`` checks exactly that (a
# tuple per entry, compared at once). A load, a new state entry (the first step creates AdamW's)
# or a replaced tensor makes a new plan. The plan holds the state's tensors, so no other tensor
# can take their ids while it lives. A plan is never reused when a tensor it copies is not a view
# of the live one (a reshape of a non-contiguous entry copies), nor when a state entry is packed
# (a tensor subclass, whose inner tensors can change under the same object): such a shard is
# worked out at every stop.
#
# The same holds for the state records a piece's manifest describes (``state_record``: each param's
# shape, its state entries' kinds and dtypes, its scalar values), which the background thread
# works out per param at every snapshot: under one plan only the scalar values (AdamW's ``step``)
# change, so ``records`` works each param's record out once and then only reads its scalars again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lowzero.checkpoint.save import shard_tensors, state_record
from hf_lowzero.checkpoint.shards import ShardView, scalar_to_json
from hf_lowzero.snapshot.file_layout import file_layout
from hf_lowzero.zero.runtime.memory import is_packed


@dataclass(frozen=True)
class CopyPlan:
    """The tensors a stop copies (live tensors, by checkpoint key, in ``shard_tensors``' order) and
    the positions and keys of the scalar state tensors it freezes, for shards of one ``signature``.
    """

    signature: tuple | None  # None: never reused (a packed state)
    tensors: dict[str, torch.Tensor]
    scalars: tuple[tuple[int, str], ...]
    sources: tuple[torch.Tensor, ...] = ()  # the state's tensors, held: their ids stay theirs
    _records: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    _bytes: list[tuple[torch.Tensor, ...] | None] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def of(cls, view: ShardView) -> CopyPlan:
        """The plan of ``view``'s shard, worked out from the view."""
        tensors, _ = shard_tensors(view, describe=False)
        scalars = tuple(
            (pos, key)
            for pos in view.state_dict["state"]
            for key, value in view.scalar_state(pos).items()
            if isinstance(value, torch.Tensor)
        )
        sources = tuple(_state_tensors(view))
        live = {t.untyped_storage().data_ptr() for t in sources}
        views = all(t.untyped_storage().data_ptr() in live for t in tensors.values())
        return cls(signature(view) if views else None, tensors, scalars, sources)

    def fits(self, view: ShardView) -> bool:
        """Whether this plan is ``view``'s ([Note: copy plan])."""
        return self.signature is not None and signature(view) == self.signature

    def file_bytes(self) -> tuple[torch.Tensor, ...] | None:
        """The tensors' bytes (flat ``uint8`` views) in their file's data order, to be copied
        straight into a piece's file ([Note: written from the live shard] in ``stager.py``); None
        when a tensor is not contiguous or not on the host. Worked out once per plan: for a plan
        that fits, they are views of the live tensors."""
        if not self._bytes:
            self._bytes.append(_file_bytes(self.tensors))
        return self._bytes[0]

    def records(self, view: ShardView, positions: list[int]) -> dict[int, dict[str, Any]]:
        """``state_record(view, pos)`` of each of ``positions``, for a view this plan fits: worked
        out once per param, then with only its scalar values read again ([Note: copy plan])."""
        records = {}
        for pos in positions:
            known = self._records.get(pos) if self.signature is not None else None
            if known is None:
                known = self._records[pos] = state_record(view, pos)
            state = view.state_dict["state"].get(pos, {})
            records[pos] = {**known, "scalar_state": {k: scalar_to_json(state[k]) for k in known["scalar_state"]}}
        return records


def _file_bytes(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    if any(not t.is_contiguous() or t.device.type != "cpu" for t in tensors.values()):
        return None
    return tuple(tensors[key].detach().reshape(-1).view(torch.uint8) for key, *_ in file_layout(tensors).spans)


def _state_tensors(view: ShardView):
    for state in view.state_dict["state"].values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor) and not is_packed(v))
    yield from view.zero["master_rows"].values()


def signature(view: ShardView) -> tuple | None:
    """What a plan depends on: every state entry's tensor (its id, memory, shape, dtype and type)
    or type, and every master row's tensor; None when a state entry is packed."""
    entries: list[tuple] = []
    for pos, state in view.state_dict["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                entries.append((pos, key, type(value)))
            elif is_packed(value):
                return None
            else:
                entries.append((pos, key, type(value), id(value), value.data_ptr(), value.shape, value.dtype))
    for pos, rows in view.zero["master_rows"].items():
        entries.append((pos, id(rows), rows.data_ptr(), rows.shape, rows.dtype))
    return tuple(entries)
