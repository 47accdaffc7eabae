"""Sharded checkpoints: save at any world size, load at any other, atomically, with no pickle.

A checkpoint is a directory holding
- one safetensors file per rank: that rank's real (unpadded) elements of every parameter's fp32
  master row (``master/<name>``) and of every element-wise optimizer state tensor
  (``state/<name>/<key>``), keyed by parameter name;
- ``zero_meta.json``, written last: format version, world size and stage at save time, per-param
  shape/numel and which state it has (0-dim state such as Adam's ``step`` is stored here), the
  param groups' hyperparameters, the loss-scaler state and step counters, and each rank file's
  size.

Example::

    opt.save_checkpoint("ckpt/step-100")        # collective: every rank writes its shard
    opt.load_checkpoint("ckpt/step-100")        # collective, at any world size
    weights = consolidate_checkpoint("ckpt/step-100")   # {name: full fp32 tensor}, no process group

# [Note: atomic save]
# Every rank writes into ``<path>.partial``; rank 0 writes the metadata last and then renames the
# directory into place. A directory without ``zero_meta.json`` is never loaded, so a crash at any
# point leaves either the previous checkpoint or a ``.partial`` directory that loading refuses.

# [Note: validate, agree, then mutate]
# Loading reads and checks everything this rank needs into fresh tensors first; the ranks then
# exchange their verdicts so that all raise together (a rank that raised alone would leave its
# peers waiting in the next collective). Only when every rank succeeded is any state changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_lowzero.zero import comm
from hf_lowzero.zero.partition import ParamShard

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer

FORMAT_VERSION = 1
META_FILE = "zero_meta.json"
EXTRAS_FILE = "zero_model_extras.safetensors"  # frozen params and persistent buffers (rank 0)
CRASH_POINT_ENV = "HF_LOWZERO_CRASH_POINT"  # fault injection for tests: "after_rank_files"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the problem."""


def rank_file_name(rank: int, world_size: int) -> str:
    return f"zero_shard_rank{rank:05d}_of_{world_size:05d}.safetensors"


# ------------------------------------------------------------------------------------- save


def save_checkpoint(opt: LowLevelZeroOptimizer, path: str | os.PathLike) -> Path:
    """Write ``opt``'s sharded state to directory ``path`` (collective; see [Note: atomic save])."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if opt.rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # left by an earlier crashed save
        partial.mkdir(parents=True)
    comm.barrier(opt.group)
    partial.mkdir(parents=True, exist_ok=True)  # ranks on other nodes without a shared filesystem

    if opt.rank == 0:
        extras = {f"extra/{name}": t.clone() for name, t in _extras(opt).items()}
        _atomic_write(partial / EXTRAS_FILE, lambda f: save_file(extras, f))
    tensors = {}
    for slot, master in zip(opt.slots, opt.master_rows):
        owned = slot.shard.owned_numel(opt.rank)
        tensors[f"master/{slot.name}"] = master[:owned].clone()
        for key, value in opt.optim.state.get(master, {}).items():
            if _is_row_state(value, slot):
                tensors[f"state/{slot.name}/{key}"] = value[:owned].clone()
    _atomic_write(partial / rank_file_name(opt.rank, opt.world_size), lambda f: save_file(tensors, f))
    if os.environ.get(CRASH_POINT_ENV) == "after_rank_files":
        os._exit(17)

    sizes = comm.all_gather_object((partial / rank_file_name(opt.rank, opt.world_size)).stat().st_size, opt.group)
    if opt.rank == 0:
        meta = _metadata(opt, sizes, partial)
        _atomic_write(partial / META_FILE, lambda f: Path(f).write_text(json.dumps(meta, indent=1)))
    comm.barrier(opt.group)
    if opt.rank == 0:
        _replace_dir(partial, path)
    comm.barrier(opt.group)
    if partial.exists():  # not a shared filesystem: this rank's own copy holds its shard
        _replace_dir(partial, path)
    comm.barrier(opt.group)
    return path


def _extras(opt: LowLevelZeroOptimizer) -> dict[str, torch.Tensor]:
    """Model state that is not sharded: frozen params and persistent buffers (rank 0 saves them),
    so a consolidated checkpoint is a complete model. Tied duplicates of managed params are skipped."""
    managed_ptrs = {slot.param.data_ptr() for slot in opt.slots}
    managed_names = {slot.name for slot in opt.slots}
    return {
        name: t
        for name, t in opt.model.state_dict(keep_vars=False).items()
        if t.data_ptr() not in managed_ptrs and name not in managed_names
    }


def _master_names(opt: LowLevelZeroOptimizer) -> dict[int, str]:
    """id(master row) -> parameter name."""
    return {id(m): s.name for s, m in zip(opt.slots, opt.master_rows)}


def _positions(opt: LowLevelZeroOptimizer) -> dict[int, int]:
    """id(master row) -> its index in torch's optimizer state-dict numbering (groups in order)."""
    return {id(p): i for i, p in enumerate(p for g in opt.optim.param_groups for p in g["params"])}


def _is_row_state(value: Any, slot) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == slot.shard.shard_numel


def _scalar_to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"unsupported optimizer state tensor of shape {tuple(value.shape)}")
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return list(value)
    return value


def _scalar_from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def _metadata(opt: LowLevelZeroOptimizer, sizes: list[int], partial: Path) -> dict[str, Any]:
    params = {}
    for slot, master in zip(opt.slots, opt.master_rows):
        state = opt.optim.state.get(master, {})
        params[slot.name] = {
            "shape": list(slot.param.shape),
            "numel": slot.param.numel(),
            "dtype": str(slot.param.dtype).removeprefix("torch."),
            "has_state": bool(state),
            "row_state": sorted(k for k, v in state.items() if _is_row_state(v, slot)),
            "scalar_state": {k: _scalar_to_json(v) for k, v in state.items() if not _is_row_state(v, slot)},
        }
    names = _master_names(opt)
    groups = [
        {
            "hyperparameters": {k: _scalar_to_json(v) for k, v in g.items() if k != "params"},
            "params": [names[id(p)] for p in g["params"]],
        }
        for g in opt.optim.param_groups
    ]
    extras = {
        n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in _extras(opt).items()
    }
    return {
        "format": "hf_lowzero.zero",
        "format_version": FORMAT_VERSION,
        "world_size": opt.world_size,
        "stage": opt.config.stage,
        "params": params,
        "extras": extras,
        "param_groups": groups,
        "loss_scaler": {"kind": type(opt.scaler).__name__, **opt.scaler.state_dict()},
        "skipped_steps": opt.skipped_steps,
        "consecutive_skips": opt._consecutive_skips,
        "files": {rank_file_name(r, opt.world_size): size for r, size in enumerate(sizes)}
        | {EXTRAS_FILE: (Path(partial) / EXTRAS_FILE).stat().st_size},
    }


def _atomic_write(target: Path, write) -> None:
    tmp = target.with_name(target.name + ".tmp")
    write(str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)


def _replace_dir(partial: Path, path: Path) -> None:
    old = path.with_name(path.name + ".old")
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(partial, path)
    if old.exists():
        shutil.rmtree(old)


# ------------------------------------------------------------------------------------- load


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and check ``zero_meta.json`` of checkpoint directory ``path``."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        partial = Path(path).with_name(Path(path).name + ".partial")
        hint = f" (an unfinished save left {partial})" if partial.exists() else ""
        raise CheckpointError(f"{meta_path}: missing; not a complete hf_lowzero checkpoint{hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path}: corrupted metadata ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != "hf_lowzero.zero":
        raise CheckpointError(f"{meta_path}: not an hf_lowzero checkpoint metadata file")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: unknown format version {meta.get('format_version')!r}; this hf_lowzero "
            f"reads version {FORMAT_VERSION}. Upgrade hf_lowzero to load it."
        )
    return meta


class _ShardReader:
    """Opens checkpoint files lazily, validates each once, and reads slices of their tensors."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.saved_world_size = meta["world_size"]
        self._open: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}

    def file(self, name: str):
        if name not in self._open:
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(
                    f"{file}: file missing (the checkpoint was saved by {self.saved_world_size} ranks)"
                )
            expected = self.meta["files"].get(name)
            if expected is not None and file.stat().st_size != expected:
                raise CheckpointError(
                    f"{file}: truncated or corrupted ({file.stat().st_size} bytes, metadata says {expected})"
                )
            try:
                self._open[name] = safe_open(str(file), framework="pt")
                self._keys[name] = set(self._open[name].keys())
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise CheckpointError(f"{file}: truncated or corrupted ({e})") from e
        return self._open[name]

    def read(self, name: str, key: str, shape: list[int], start: int | None = None, end: int | None = None):
        """Tensor ``key`` of ``shape`` from file ``name``; elements ``[start, end)`` if given (1D)."""
        f = self.file(name)
        if key not in self._keys[name]:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} missing")
        sl = f.get_slice(key)
        if list(sl.get_shape()) != shape:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} has shape {sl.get_shape()}, expected {shape}")
        try:
            return sl[start:end] if start is not None else f.get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{self.path / name}: tensor {key!r} unreadable ({e})") from e

    @property
    def files_read(self) -> list[str]:
        return sorted(self._open)


def _read_row(reader: _ShardReader, key: str, numel: int, new: ParamShard, rank: int, out: torch.Tensor) -> None:
    """Fill ``out`` (this rank's new row, padding zero) from the saved ranks whose rows overlap it."""
    start, end = new.owned_range(rank)
    old = ParamShard(numel, reader.saved_world_size)
    first = start // old.shard_numel
    for old_rank in range(first, reader.saved_world_size):
        old_start, old_end = old.owned_range(old_rank)
        if old_start >= end:
            break
        lo, hi = max(start, old_start), min(end, old_end)
        if lo < hi:
            name = rank_file_name(old_rank, reader.saved_world_size)
            saved = reader.read(name, key, [old_end - old_start], lo - old_start, hi - old_start)
            out[lo - start : hi - start].copy_(saved)


def _check_compatible(opt: LowLevelZeroOptimizer, meta: dict[str, Any], where: Path) -> None:
    saved = meta["params"]
    current = {s.name: s for s in opt.slots}
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: checkpoint is of a different model: parameters missing from it {missing[:5]}, "
            f"unexpected in it {unexpected[:5]}"
        )
    shapes = [
        f"{n}: saved {saved[n]['shape']}, model {list(s.param.shape)}"
        for n, s in current.items()
        if saved[n]["shape"] != list(s.param.shape)
    ]
    if shapes:
        raise CheckpointError(f"{where}: checkpoint is of a different model: shapes differ ({'; '.join(shapes[:5])})")
    extras = _extras(opt)
    saved_extras = meta.get("extras", {})
    bad = [n for n, t in extras.items() if n not in saved_extras or saved_extras[n]["shape"] != list(t.shape)]
    if bad:
        raise CheckpointError(
            f"{where}: checkpoint is of a different model: frozen params/buffers missing or of another shape: {bad[:5]}"
        )
    names = _master_names(opt)
    current_groups = [[names[id(p)] for p in g["params"]] for g in opt.optim.param_groups]
    if current_groups != [g["params"] for g in meta["param_groups"]]:
        raise CheckpointError(
            f"{where}: the optimizer's param groups differ from the saved ones (same params in the same "
            "groups and order are required); build the optimizer the way the saved run did"
        )


def load_checkpoint(opt: LowLevelZeroOptimizer, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint saved at any world size into ``opt`` and its model (collective).

    Returns a summary: the saved world size and stage, and the rank files this rank read.
    See [Note: validate, agree, then mutate].
    """
    path = Path(path)
    staged, error, reader = None, None, None
    try:
        meta = read_metadata(path)
        _check_compatible(opt, meta, path / META_FILE)
        reader = _ShardReader(path, meta)
        staged = _stage(opt, reader, meta)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in comm.all_gather_object(error, opt.group) if e is not None]
    if errors:
        unique = list(dict.fromkeys(errors))
        raise CheckpointError("cannot load checkpoint; nothing was changed: " + " | ".join(unique))

    masters, torch_state, extras = staged
    with torch.no_grad():
        for row, new in zip(opt.master_rows, masters):
            row.copy_(new)
        live = _extras(opt)
        for name, value in extras.items():
            live[name].copy_(value)
    opt.optim.load_state_dict(torch_state)
    if meta["loss_scaler"]["kind"] == type(opt.scaler).__name__:
        opt.scaler.load_state_dict(meta["loss_scaler"])
    opt.skipped_steps = meta["skipped_steps"]
    opt._consecutive_skips = meta["consecutive_skips"]
    opt.zero_grad()
    opt._gather_params()
    return {"saved_world_size": meta["world_size"], "saved_stage": meta["stage"], "files_read": reader.files_read}


def _stage(opt: LowLevelZeroOptimizer, reader: _ShardReader, meta: dict[str, Any]):
    """Read everything this rank needs into new tensors; no state of ``opt`` is touched."""
    masters, state = [], {}
    position = _positions(opt)
    for slot, master in zip(opt.slots, opt.master_rows):
        saved = meta["params"][slot.name]
        row = torch.zeros_like(master)
        _read_row(reader, f"master/{slot.name}", saved["numel"], slot.shard, opt.rank, row)
        masters.append(row)
        if not saved["has_state"]:
            continue
        entry = {k: _scalar_from_json(v) for k, v in saved["scalar_state"].items()}
        for key in saved["row_state"]:
            key_row = torch.zeros_like(master)  # fp32 like the master; load_state_dict casts anyway
            _read_row(reader, f"state/{slot.name}/{key}", saved["numel"], slot.shard, opt.rank, key_row)
            entry[key] = key_row
        state[position[id(master)]] = entry
    groups = []
    for g_meta, g in zip(meta["param_groups"], opt.optim.param_groups):
        hyper = {k: _scalar_from_json(v) for k, v in g_meta["hyperparameters"].items()}
        for k, v in g.items():  # keep the live types (tuples for betas, tensors for lr)
            if k in hyper and isinstance(v, tuple):
                hyper[k] = tuple(hyper[k])
        groups.append({**hyper, "params": [position[id(p)] for p in g["params"]]})
    extras = {name: _read_extra(reader, name, shape=t.shape) for name, t in _extras(opt).items()}
    return masters, {"state": state, "param_groups": groups}, extras


def _read_extra(reader: _ShardReader, name: str, shape) -> torch.Tensor:
    return reader.read(EXTRAS_FILE, f"extra/{name}", list(shape))


# ------------------------------------------------------------------------------ consolidate


def consolidate_checkpoint(path: str | os.PathLike) -> OrderedDict[str, torch.Tensor]:
    """Full model weights by name from a sharded checkpoint (reads every rank file; no process group).

    Trainable params come from the fp32 master weights; frozen params and persistent buffers are
    returned in the dtype they were saved in.

    Example::

        >>> weights = consolidate_checkpoint("out/checkpoint-100/zero")
        >>> model.load_state_dict(weights, strict=False)
    """
    path = Path(path)
    meta = read_metadata(path)
    reader = _ShardReader(path, meta)
    full = OrderedDict()
    for name, saved in meta["params"].items():
        flat = torch.empty(saved["numel"], dtype=torch.float32)
        _read_row(reader, f"master/{name}", saved["numel"], ParamShard(saved["numel"], 1), 0, flat)
        full[name] = flat.view(saved["shape"])
    for name, info in meta.get("extras", {}).items():
        full[name] = _read_extra(reader, name, torch.Size(info["shape"]))
    return full


# ------------------------------------------------------------------------- full state dict


def full_state_dict(opt: LowLevelZeroOptimizer) -> dict[str, Any] | None:
    """The whole inner-optimizer state in torch's format, on rank 0 (None elsewhere). Collective.

    State tensors are full-size (the param's shape, unpadded, fp32); ``param_groups`` list params
    by position like ``torch.optim.Optimizer.state_dict()`` and also by ``param_names``, so the
    result loads into a plain torch optimizer built over the same params in the same groups.
    """
    names = _master_names(opt)
    position = _positions(opt)
    state: dict[int, dict[str, Any]] = {}
    for slot, master in zip(opt.slots, opt.master_rows):
        entry = {}
        for key, value in sorted(opt.optim.state.get(master, {}).items()):
            if _is_row_state(value, slot):
                out = torch.empty(opt.world_size * slot.shard.shard_numel, dtype=value.dtype, device=value.device)
                comm.all_gather(out, value.contiguous(), opt.group)
                value = out[: slot.shard.numel].view(slot.param.shape).cpu()
            entry[key] = value
        if entry:
            state[position[id(master)]] = entry
    if opt.rank != 0:
        return None
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [position[id(p)] for p in g["params"]],
            "param_names": [names[id(p)] for p in g["params"]],
        }
        for g in opt.optim.param_groups
    ]
    return {"state": state, "param_groups": groups}
