"""Save a sharded checkpoint: every rank writes its own rows; atomic; no pickle.

Example::

    save_checkpoint(opt, "ckpt/step-100")   # collective: every rank writes its shard

# [Note: atomic save]
# Every rank writes into ``<path>.partial``; rank 0 writes the metadata last and then renames the
# directory into place: ``<path>`` to ``<path>.old``, ``<path>.partial`` to ``<path>``, then deletes
# ``<path>.old``; each rename is fsynced in its folder. A directory without ``zero_meta.json`` is never
# loaded, so a crash at any point leaves the previous checkpoint (as ``<path>`` or, cut between the
# renames, as ``<path>.old`` beside the complete ``<path>.partial``: loading names both) or a
# ``.partial`` directory that loading refuses. The next save first finishes an interrupted swap, so
# it deletes neither copy. An error on any rank (a full disk, a denied write) fails every rank at the
# step's end, with the same message ([Note: ranks agree on failure] in agree.py): none waits for it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from hf_lowzero.checkpoint.agree import agree
from hf_lowzero.checkpoint.atomic import atomic_write, replace_synced
from hf_lowzero.checkpoint.layout import (
    EXTRAS_FILE,
    META_FILE,
    extra_key,
    file_checksums,
    format_header,
    master_key,
    old_dir,
    partial_dir,
    rank_file_name,
    state_key,
)
from hf_lowzero.checkpoint.shards import ShardView, attributes_to_json, scalar_to_json, unsharded_state

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer

CRASH_POINT_ENV = "HF_LOWZERO_CRASH_POINT"  # fault injection for tests: "after_rank_files", "between_renames"


def save_checkpoint(opt: LowLevelZeroOptimizer, path: str | os.PathLike, model_extras: bool = True) -> Path:
    """Write ``opt``'s sharded state to directory ``path`` (collective; see [Note: atomic save]).

    Holds every rank's rows of the master weights (in the masters' dtype: fp32, or bf16) and of the
    optimizer state, the param groups, loss scaler and counters, and (``model_extras=True``) the
    model's frozen params and persistent buffers, so that the checkpoint alone consolidates into a
    complete model. With ``model_extras=False`` only their names and shapes are recorded: for
    callers that save the model themselves (the Trainer; a LoRA run whose frozen base is the
    pretrained model). Loadable at any world size with :func:`hf_lowzero.load_checkpoint`.

    Args:
        opt: The optimizer to save; every rank of its process group must call this.
        path: The checkpoint directory to write; an existing one is replaced once the new one is complete.
        model_extras: Whether to store the model's frozen params and persistent buffers too (rank 0
            writes them); False records only their names and shapes.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        CheckpointError: On every rank alike, when any rank failed; the message names each failed rank
            and its error: a write that failed (disk full, permission denied, a bad path), or an
            optimizer state entry that cannot be saved (a state tensor of a row-shard param that is
            neither element-wise nor a single value, a packed state with an attribute JSON cannot
            hold). The previous checkpoint at ``path`` is left in place (or, if the failure came
            between the last renames, at ``<path>.old``: the message says so).
    """
    path = Path(path)
    partial = Path(partial_dir(path))
    view = ShardView.of(opt)
    extras = unsharded_state(opt.model, view.params, view.names)
    kept = f"cannot save checkpoint {path}; the previous checkpoint there, if any, is unchanged"
    moved = (
        f"cannot save checkpoint {path}: moving it into place failed; the new checkpoint is at {path} or {partial}, "
        f"the previous one at {path} or {old_dir(path)} (load_checkpoint({str(path)!r}) names what is left and how "
        "to restore it)"
    )

    def agreed(summary: str, step, *args) -> list:
        """``step(*args)`` on this rank, then every rank's verdict ([Note: ranks agree on failure])."""
        try:
            result, failure = step(*args), None
        except Exception as e:  # any type, so that every rank raises together
            result, failure = None, e
        return agree(failure, summary, view.process_group, view.device, _describe, result)

    agreed(kept, _start, view, partial, path)
    written = agreed(kept, _write_rank_files, view, extras, partial, model_extras)
    agreed(kept, _write_metadata, view, extras, partial, written, model_extras)
    agreed(moved, _move_into_place, view.rank == 0, partial, path)
    agreed(moved, _move_into_place, True, partial, path)  # not a shared filesystem: each rank's own copy
    return path


def _start(view: ShardView, partial: Path, path: Path) -> None:
    """Rank 0 makes the empty ``partial`` directory (after finishing an interrupted swap)."""
    if view.rank == 0:
        _finish_interrupted_swap(partial, path)
        if partial.exists():
            shutil.rmtree(partial)  # left unfinished by an earlier crashed save
        partial.mkdir(parents=True)


def _write_rank_files(view: ShardView, extras: dict, partial: Path, model_extras: bool) -> tuple[int, dict]:
    """This rank's file (and rank 0's extras file): its size and the records of the whole params it owns."""
    partial.mkdir(parents=True, exist_ok=True)  # ranks on other nodes without a shared filesystem
    if view.rank == 0 and model_extras:
        tensors = {extra_key(name): t.detach().cpu().clone() for name, t in extras.items()}
        _write_tensors(partial / EXTRAS_FILE, tensors)
    tensors, records = shard_tensors(view)
    tensors = {key: t.detach().cpu().clone() for key, t in tensors.items()}
    own_file = partial / rank_file_name(view.rank, view.world_size)
    _write_tensors(own_file, tensors)
    if os.environ.get(CRASH_POINT_ENV) == "after_rank_files":
        os._exit(17)
    return own_file.stat().st_size, records


def _write_metadata(view: ShardView, extras: dict, partial: Path, written: list, model_extras: bool) -> None:
    """Rank 0 writes ``zero_meta.json`` last: a whole param's state is described by its owner, the only
    rank holding it (``written``: every rank's file size and records).
    """
    if view.rank != 0:
        return
    sizes = [size for size, _ in written]
    described = {name: record for _, ranks_records in written for name, record in ranks_records.items()}
    extras_size = (partial / EXTRAS_FILE).stat().st_size if model_extras else None
    meta = checkpoint_metadata(view, described, extras, sizes, extras_size)
    atomic_write(partial / META_FILE, lambda f: Path(f).write_text(json.dumps(meta, indent=1)))


def _move_into_place(mine: bool, partial: Path, path: Path) -> None:
    if mine and partial.exists():
        _replace_dir(partial, path)


def shard_tensors(view: ShardView, describe: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What this rank's file of a checkpoint holds: ``{key: tensor}`` (the live tensors, not copies,
    wherever they are: callers copy them) and the state records of the whole params it owns (their
    owner is the only rank that can describe them). A memory snapshot holds the same tensors
    (``hf_lowzero.snapshot``).

    Args:
        view: This rank's shard.
        describe: Also describe the state (``shard_records``); False: the records are ``{}``.

    Returns:
        The tensors by key (``layout.master_key``, ``layout.state_key``) and the state records of the
        whole params this rank owns, by param name.

    Raises:
        ValueError: The state of a whole param this rank owns cannot be described in JSON (see
            ``state_record``).
    """
    tensors = {}
    for pos, name in enumerate(view.names):
        shard = view.shards[pos]
        owned = shard.owned_numel(view.rank)
        if shard.whole and not owned:
            continue  # another rank owns this param whole and writes it
        tensors[master_key(name)] = view.zero["master_rows"][pos][:owned]
        for key, value in view.row_state(pos).items():
            tensors[state_key(name, key)] = value[:owned]
        for key, value in view.whole_state(pos).items():
            tensors[state_key(name, key)] = value.detach()
        for key, value in view.packed_state(pos).items():
            attrs, _ = value.__tensor_flatten__()
            for attr in attrs:
                tensors[state_key(name, f"{key}.{attr}")] = getattr(value, attr).detach()
    return tensors, shard_records(view) if describe else {}


def shard_records(view: ShardView) -> dict[str, Any]:
    """The state records of the whole params this rank owns, by param name (their owner is the only
    rank that can describe them; row-shard params: every rank holds the same kind of state, and rank
    0 describes it in the metadata).
    """
    return {view.names[pos]: state_record(view, pos) for pos in owned_whole(view)}


def owned_whole(view: ShardView) -> list[int]:
    """The positions of the whole params this rank owns (the params ``shard_records`` describes)."""
    return [pos for pos, shard in enumerate(view.shards) if shard.whole and shard.owned_numel(view.rank)]


def state_record(view: ShardView, pos: int) -> dict[str, Any]:
    """What a loader needs to know of param ``pos``'s optimizer state, from a rank that holds it.

    Args:
        view: The shard of a rank that holds the param's state.
        pos: The param's position (torch's numbering over the groups).

    Returns:
        The param's shape, size, dtype and owner, and the names, kinds and dtypes of its state entries,
        as ``zero_meta.json`` records them.

    Raises:
        ValueError: A state entry cannot be described in JSON: a tensor of a row-shard param that is
            neither element-wise nor a single value, or a packed state's attribute of an unsupported type.
    """
    p = view.params[pos]
    rows = view.row_state(pos)
    record = {
        "shape": list(p.shape),
        "numel": p.numel(),
        "dtype": _dtype_name(p),
        "owner": view.shards[pos].owner,
        "has_state": pos in view.state_dict["state"],
        "row_state": sorted(rows),
        "row_state_dtypes": {k: _dtype_name(v) for k, v in rows.items()},
        "scalar_state": {k: scalar_to_json(v) for k, v in view.scalar_state(pos).items()},
    }
    whole = view.whole_state(pos)
    if whole:
        record["whole_state"] = {k: {"shape": list(v.shape), "dtype": _dtype_name(v)} for k, v in whole.items()}
    packed = view.packed_state(pos)
    if packed:
        record["packed_state"] = {}
        for key, value in packed.items():
            attrs, context = value.__tensor_flatten__()
            inner = {a: getattr(value, a) for a in attrs}
            record["packed_state"][key] = {
                "class": f"{type(value).__module__}:{type(value).__qualname__}",
                "attributes": attributes_to_json(context),
                "inner": {a: {"shape": list(t.shape), "dtype": _dtype_name(t)} for a, t in inner.items()},
            }
    return record


def checkpoint_metadata(
    view: ShardView, described: dict[str, Any], extras: dict, sizes: list[int], extras_size: int | None
) -> dict[str, Any]:
    """``zero_meta.json`` as rank 0 writes it: ``described`` holds every whole param's state record
    (from its owner), ``sizes`` each rank file's bytes, ``extras_size`` the extras file's bytes, or
    None when the extras are left to the model's own save (only their names and shapes are kept).

    Args:
        view: Rank 0's shard.
        described: Every whole param's state record, by name, from the rank that owns it.
        extras: The model's frozen params and persistent buffers, by name.
        sizes: The bytes of each rank file, by rank.
        extras_size: The bytes of the extras file, or None when the extras are not stored.

    Returns:
        The metadata as a JSON-ready dict.

    Raises:
        ValueError: A hyperparameter or state entry cannot be described in JSON (see ``state_record``).
    """
    stored = extras_size is not None
    params = {name: described.get(name) or state_record(view, pos) for pos, name in enumerate(view.names)}
    groups = [
        {
            "hyperparameters": {k: scalar_to_json(v) for k, v in g.items() if k not in ("params", "param_names")},
            "params": list(g["param_names"]),
        }
        for g in view.state_dict["param_groups"]
    ]
    return {
        **format_header(),
        "world_size": view.world_size,
        "stage": view.zero["stage"],
        "partition": view.zero.get("partition", "rows"),
        "inner_optimizer": view.inner_optimizer,
        "params": params,
        # frozen params and persistent buffers: stored in EXTRAS_FILE, or left to the model's own save
        "extras" if stored else "external": {
            n: {"shape": list(t.shape), "dtype": _dtype_name(t)} for n, t in extras.items()
        },
        "param_groups": groups,
        "loss_scaler": view.zero["loss_scaler"],
        "skipped_steps": view.zero["skipped_steps"],
        "consecutive_skips": view.zero["consecutive_skips"],
        "exact_grid": view.zero.get("exact_grid"),  # reduction="exact": by param name, any world size
        "files": {rank_file_name(r, view.world_size): size for r, size in enumerate(sizes)}
        | ({EXTRAS_FILE: extras_size} if stored else {}),
    }


def _write_tensors(target: Path, tensors: dict) -> None:
    """One safetensors file, each tensor's checksums in its metadata ([Note: checksums])."""
    metadata = file_checksums(tensors)
    atomic_write(target, lambda f: save_file(tensors, f, metadata=metadata))


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _replace_dir(partial: Path, path: Path) -> None:
    old = Path(old_dir(path))
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        replace_synced(path, old)
    if os.environ.get(CRASH_POINT_ENV) == "between_renames":
        os._exit(17)
    replace_synced(partial, path)
    if old.exists():
        shutil.rmtree(old)


def _finish_interrupted_swap(partial: Path, path: Path) -> None:
    """A save cut between its renames left ``path`` missing, the complete new checkpoint in
    ``partial`` and maybe the previous one in ``<path>.old``: finish the swap before this save starts,
    so that it deletes neither ([Note: atomic save]).
    """
    if not path.exists() and (partial / META_FILE).is_file():
        replace_synced(partial, path)
