"""This rank's shard for a snapshot: its live tensors on the host, double-buffered host copies on a GPU.

Example::

    stager = ShardStager(opt)
    staged = stager.stage(step=15)      # after the step: one copy per tensor into a free host buffer
    manifest = staged.write(path)       # any thread: checksums and bytes into a file; frees the buffer
    live = stager.stage(step=16, live=True)   # on the host: no copy ([Note: written from the live shard])
    manifest = live.write(path2)              # before the next step

# [Note: double buffer]
# On a GPU a snapshot stops training for one copy of this rank's rows of the fp32 masters and
# optimizer state (12 bytes per element of its shard with AdamW), into one of two preallocated
# host buffers. A background thread writes the piece from that copy (the checksums and the bytes,
# in one pass into a file in the node's memory) once the asynchronous copy is done, so the next
# step runs while the previous snapshot is still being written from the other buffer. On the
# host the stop writes the piece itself, from the live shard, with no copy ([Note: written from
# the live shard]). ``stage()`` waits only when both buffers are still being written (a snapshot
# asked for before the one two snapshots back finished); the caller's timing of ``stage()`` counts
# it.
# On CUDA the copy itself is asynchronous: it runs on a side stream of the params' device into
# pinned buffers, after the step's kernels, while the next forward and backward run; every later
# writer of the copied tensors (the next step, a train()/eval() switch, a load) waits for it at the
# optimizer's gate ([Note: one gate for the shard's writers] in ``zero/update/write_gate.py``), and the
# encoder waits for the copy's event before it reads the buffer.

# [Note: packed staging]
# A host buffer is one block of memory laid out as the data of the piece's safetensors file (each
# tensor at its offset there, in safetensors' order), and the copy at the stop writes into views
# of it. The write then needs no per-tensor work in torch (a view, a reshape, a numpy
# array per tensor: most of the write for the main job's 84 small tensors): it checksums each
# chunk at its known offset and copies the block into the file a megabyte at a time, each block
# right after its checksums, while it is in cache (``FileLayout.write_data`` in ``file_layout.py``).

# [Note: written from the live shard]
# On the host, a piece is written by the stop itself ([Note: written at the stop] in
# ``hf_lowzero/ray/snapshots.py``), before the next step changes the shard: a copy into a staging
# buffer that is then copied into the piece's file is one copy too many, and the two buffers are
# twice the shard in host memory for nothing. ``stage(live=True)`` copies nothing there: the
# write copies the live tensors straight into the file, in one ``torch.cat`` into the mapped
# file's data (their bytes as flat views, in the file's order, worked out once per copy plan:
# ``CopyPlan.file_bytes``), and then checksums the bytes where they landed. The scalar state is
# not frozen either: the write reads it before the next step. On a GPU (or with a background
# writer) the shard is copied as ever.

# [Note: described off the loop]
# A piece's details describe the optimizer state (each whole param's state record; on rank 0
# the checkpoint metadata of every param and group): per-param Python work that took most of the
# stop (about 1 ms of 2.5 for the main job's 28 params on rank 0). The stop keeps only what the
# next step changes: the tensors (copied) and the scalar state entries (``step``: single-value
# tensors updated in place, cloned). The view's state dicts and groups are already the stop's own
# copies (``shard_state_dict``), and shapes, dtypes and owners do not change between steps, so the
# write describes the same state from the view later.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.checkpoint.layout import extra_key
from hf_lowzero.checkpoint.save import checkpoint_metadata, owned_whole
from hf_lowzero.checkpoint.shards import ShardView
from hf_lowzero.snapshot.copy_plan import CopyPlan
from hf_lowzero.snapshot.file_layout import file_layout
from hf_lowzero.snapshot.format import Manifest, Piece, encode_piece, write_piece
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.model_extras import ModelExtras
from hf_lowzero.zero.runtime import device as dev

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


@dataclass
class Staged:
    """One snapshot's copy, waiting to be encoded: rank ``rank``'s piece of the snapshot of ``step``
    at ``world_size`` ranks, its host tensors, the optimizer's part of its details, and the buffer to
    give back once encoded."""

    step: int
    rank: int
    world_size: int
    shard: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor]
    copied: Any  # the copy's CUDA event, or None (copied synchronously)
    release: Callable[[], None]
    describe: Callable[[], dict[str, Any]] = (
        dict  # the optimizer's part of the details ([Note: described off the loop])
    )
    files: MappedFiles | None = None  # the writer's kept mappings ([Note: kept mappings] in mapped.py)
    data: torch.Tensor | None = None  # ``shard``'s bytes as one buffer in file order ([Note: packed staging])
    live: tuple[torch.Tensor, ...] | None = None  # the live shard's bytes ([Note: written from the live shard])

    def details(self, **fields: Any) -> dict[str, Any]:
        """The piece's details: the optimizer's description, and ``fields`` (the Trainer's part)."""
        return {**self.describe(), **fields}

    def encode(self, **fields: Any) -> Piece:
        """The piece in memory (see ``format.encode_piece``), with ``fields`` added to its details;
        frees the buffer."""
        try:
            dev.host_waits(self.copied)
            return encode_piece(self.shard, self.extras, step=self.step, rank=self.rank, world_size=self.world_size,
                                details=self.details(**fields), shard_data=self._data())  # fmt: skip
        finally:
            self.release()

    def write(self, path: str | Path, spares: str | Path | None = None, **fields: Any) -> Manifest:
        """Write the piece into the new file ``path`` in one pass ([Note: one pass over the shard]
        in ``file_layout.py``), over a spare file of ``spares`` when there is one, with ``fields``
        added to its details; returns its manifest and frees the buffer."""
        try:
            dev.host_waits(self.copied)
            return write_piece(self.shard, self.extras, path, step=self.step, rank=self.rank,
                               world_size=self.world_size, details=self.details(**fields), spares=spares,
                               files=self.files, shard_data=self._data(), shard_bytes=self.live)  # fmt: skip
        finally:
            self.release()

    def _data(self) -> memoryview | None:
        return None if self.data is None else memoryview(self.data.numpy())


class ShardStager:
    """Two host buffers for this rank's checkpoint tensors, used in turn ([Note: double buffer])."""

    def __init__(self, opt: LowLevelZeroOptimizer) -> None:
        self.opt = opt
        self._buffers: list[tuple[dict[str, torch.Tensor], torch.Tensor | None] | None] = [None, None]
        self._planned: list[CopyPlan | None] = [None, None]  # the plan each buffer was laid out for
        self._plan: CopyPlan | None = None  # the last stop's ([Note: copy plan] in copy_plan.py)
        self._extras: ModelExtras | None = None  # rank 0's ([Note: model extras] in model_extras.py)
        self._free = [threading.Event(), threading.Event()]
        for free in self._free:
            free.set()
        self._next = 0
        self._stream = None  # a side stream of the params' device, made at the first CUDA copy
        self._files = MappedFiles()  # the pieces' files, mapped once ([Note: kept mappings] in mapped.py)

    def stage(self, step: int, live: bool = False) -> Staged:
        """Copy this rank's shard (and rank 0's persistent buffers) at ``step``; returns it staged.
        ``live``: when the shard is on the host, copy nothing: the staged shard is the live one, to
        be written before the next step changes it ([Note: written from the live shard])."""
        view = ShardView.of(self.opt)
        if self._plan is None or not self._plan.fits(view):  # [Note: copy plan] in copy_plan.py
            self._plan = CopyPlan.of(view)  # (the state is described off the loop: [Note: described off the loop])
        plan = self._plan
        live_bytes = plan.file_bytes() if live else None
        if live_bytes is not None:
            shard, copied, release, data = plan.tensors, None, _nothing, None
        else:
            shard, copied, release, data = self._copied(view, plan)
        unsharded, buffer_names, extras = self._rank0_extras(view) if view.rank == 0 else ({}, set(), {})

        def describe() -> dict[str, Any]:  # the plan's records ([Note: copy plan] in copy_plan.py)
            owned = owned_whole(view)  # the params shard_records describes
            records = plan.records(view, list(range(len(view.names))) if view.rank == 0 else owned)
            described: dict[str, Any] = {"records": {view.names[pos]: records[pos] for pos in owned}}
            if view.rank == 0:
                by_name = {view.names[pos]: record for pos, record in records.items()}
                described["zero_meta"] = _rank0_metadata(view, by_name, unsharded, buffer_names)
            return described

        return Staged(step=step, rank=view.rank, world_size=view.world_size, shard=shard, extras=extras,
                      copied=copied, release=release, describe=describe, files=self._files, data=data,
                      live=live_bytes)  # fmt: skip

    def _copied(self, view: ShardView, plan: CopyPlan):
        """The plan's tensors copied into a free host buffer ([Note: double buffer]), with the
        scalar state frozen: the staged shard, the copy's event, the buffer's release, its data."""
        tensors = plan.tensors
        i, self._next = self._next, 1 - self._next
        self._free[i].wait()
        self._free[i].clear()
        if self._planned[i] is not plan and (
            self._buffers[i] is None or _layout(self._buffers[i][0]) != _layout(tensors)
        ):
            self._buffers[i] = _staging_like(tensors)
        self._planned[i] = plan
        buffers, data = self._buffers[i]
        copied = self._copy(tensors, buffers)
        _freeze_scalars(view, plan.scalars)
        return buffers, copied, self._free[i].set, data

    def close(self) -> None:
        """Wait for the buffers' encoders and drop the buffers and the kept mappings."""
        for free in self._free:
            free.wait()
        self._buffers, self._planned, self._plan, self._extras = [None, None], [None, None], None, None
        self._files.close()

    def _rank0_extras(self, view: ShardView) -> tuple[dict[str, torch.Tensor], frozenset[str], dict[str, torch.Tensor]]:
        """The model state the optimizer does not shard (by name), the names of the persistent
        buffers among it, and copies of those buffers, which rank 0's piece stores (frozen params
        are left to the model)."""
        model = self.opt.model
        if self._extras is None or not self._extras.fits(model):  # [Note: model extras] in model_extras.py
            self._extras = ModelExtras.of(model, view.params, view.names)
        unsharded, buffer_names = self._extras.unsharded(), self._extras.buffer_names
        extras = {extra_key(name): t.detach().cpu().clone() for name, t in unsharded.items() if name in buffer_names}
        return unsharded, buffer_names, extras

    def _copy(self, tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]):
        """Copy ``tensors`` into ``buffers``: on CUDA on a side stream (returns the copy's event),
        otherwise right away (returns None)."""
        on_device = [t for t in tensors.values() if t.device.type == "cuda"]
        if not on_device:  # one call for all of them: the main job copies 84 small tensors
            torch._foreach_copy_([buffers[key] for key in tensors], list(tensors.values()))
            return None
        device = on_device[0].device  # the params' device ([Note: the params' device])
        if self._stream is None:
            self._stream = dev.side_stream(device)
        dev.stream_waits_stream(self._stream, dev.current_stream(device))  # after the step's kernels
        with dev.on_stream(self._stream):
            for key, t in tensors.items():
                buffers[key].copy_(t, non_blocking=True)
        for t in on_device:
            dev.keep_alive(t, self._stream)  # a load may replace a state tensor while it is copied
        copied = dev.record_event(self._stream)
        self.opt.register_shard_reader(copied)  # the next writer of these tensors waits for the copy
        return copied


def _rank0_metadata(
    view: ShardView, records: dict[str, Any], unsharded: dict[str, torch.Tensor], buffer_names: set[str]
) -> dict[str, Any]:
    """The checkpoint metadata as rank 0 knows it, from its view's state ``records`` of every param
    (file sizes and other owners' records are filled in at restore): the persistent buffers
    (``buffer_names``) are stored, the rest of ``unsharded`` is left to the model."""
    meta = checkpoint_metadata(view, records, unsharded, [0] * view.world_size, None)
    meta["extras"] = {name: meta["external"].pop(name) for name in unsharded if name in buffer_names}
    return meta


def _freeze_scalars(view: ShardView, scalars: tuple[tuple[int, str], ...]) -> None:
    """Replace the view's scalar state tensors (``step``, updated in place by the next step: at the
    positions and keys ``scalars``) and tensor hyperparameters with copies ([Note: described off
    the loop]); the view's state dicts and groups are its own."""
    state = view.state_dict["state"]
    for pos, key in scalars:
        state[pos][key] = state[pos][key].detach().clone()
    for group in view.state_dict["param_groups"]:  # a tensor LR is set in place by the scheduler
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                group[key] = value.detach().clone()


def _nothing() -> None:
    pass


def _layout(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]


def _staging_like(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Host buffers for ``tensors`` ([Note: packed staging]): views of one buffer laid out as their
    file's data, and that buffer; or a buffer each (and None) when a tensor's place in the file is
    not a multiple of its element size.
    """
    layout = file_layout(tensors)
    pin_for = next((t.device for t in tensors.values() if t.is_cuda), None)
    if any(start % element_size for _, start, _, element_size in layout.spans):
        return {k: _host_like(t) for k, t in tensors.items()}, None
    data = dev.host_buffer(layout.data_size, torch.uint8, pin_for, zero=False)
    views = {key: data[start:end].view(tensors[key].dtype).view(tensors[key].shape)
             for key, start, end, _ in layout.spans}  # fmt: skip
    return {key: views[key] for key in tensors}, data


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return dev.host_buffer(t.numel(), t.dtype, t.device, zero=False).view(t.shape)
