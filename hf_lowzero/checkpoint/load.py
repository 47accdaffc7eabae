"""Load a sharded checkpoint saved at any world size into an optimizer at the current one.

Example::

    load_checkpoint(opt, "ckpt/step-100")   # collective; params end up equal to the saved masters

Loading at world size W' reads, on each rank, only the slices of the saved rank files that
overlap its new rows, builds this rank's shard as a state dict (``shard_state.py``), hands it to
``opt.load_state_dict`` and writes the master rows back into the params.

# [Note: validate, agree, then mutate]
# Loading reads and checks everything this rank needs into fresh tensors first; the ranks then
# exchange their verdicts so that all raise together ([Note: ranks agree on failure] in agree.py).
# A verdict is any exception, of any type: a damaged file gives a CheckpointError, anything else (a
# bug, a full disk) its type and message, and every rank raises one CheckpointError naming the ranks
# and their errors. Only when every rank succeeded is
# any state changed; the local part of that (load_state_dict) is agreed on again before the
# collective one (writing the params), so a rank that fails there cannot leave its peers waiting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.checkpoint.agree import agree
from hf_lowzero.checkpoint.layout import EXTRAS_FILE, META_FILE, extra_key, master_key, rank_file_name, state_key
from hf_lowzero.checkpoint.meta_check import dtype_named
from hf_lowzero.checkpoint.reader import ShardReader, read_metadata, read_row
from hf_lowzero.checkpoint.shards import (
    CheckpointError,
    ShardView,
    attributes_from_json,
    packed_class,
    scalar_from_json,
    unsharded_state,
)
from hf_lowzero.zero.inner.shard_state import SECTION

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


def load_checkpoint(opt: LowLevelZeroOptimizer, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint saved at any world size into ``opt`` and its model (collective).

    Returns a summary: the saved world size and stage, and the rank files this rank read.
    See [Note: validate, agree, then mutate].

    Args:
        opt: The optimizer to load into; built over the same params in the same groups as the saved
            run's. Every rank of its process group must call this.
        path: The checkpoint directory (the one holding ``zero_meta.json``), saved at any world size.

    Returns:
        ``{"saved_world_size": ..., "saved_stage": ..., "files_read": [...]}``: the world size and stage
        the checkpoint was saved at, and the names of the files this rank read.

    Raises:
        CheckpointError: On every rank alike, when any rank could not load: the checkpoint is incomplete
            or corrupted (its metadata included), or of another model (params, shapes, frozen params or
            buffers differ), or of another inner optimizer class, or its param groups differ from
            ``opt``'s, or it holds optimizer state ``opt`` cannot take (state saved whole, which row
            shards cannot split; a packed state class outside the allowlist, or that does not import),
            or any other error came on any rank (its type and message, by rank). Nothing of ``opt`` or
            the model was changed then.
    """
    path = Path(path)
    try:
        view = ShardView.of(opt)
        extras = unsharded_state(opt.model, view.params, view.names)
        meta = read_metadata(path)
        _check_compatible(view, extras, meta, path / META_FILE)
        reader = ShardReader(path, meta)
        state_dict, extra_values = _stage(view, extras, reader, meta)
        failure = None
    except Exception as e:  # any type, so that every rank raises together
        failure = e
    agree(failure, "cannot load checkpoint; nothing was changed", opt.process_group, opt.device, _describe)

    try:
        opt.load_state_dict(state_dict)
        with torch.no_grad():
            for name, value in extra_values.items():
                extras[name].copy_(value)
        opt.zero_grad()
        failure = None
    except Exception as e:
        failure = e
    inconsistent = (
        "checkpoint loaded on some ranks only; the optimizer's state is inconsistent: build it again and "
        "load a checkpoint before training"
    )
    agree(failure, inconsistent, opt.process_group, opt.device, _describe)
    opt.copy_master_to_params()
    return {"saved_world_size": meta["world_size"], "saved_stage": meta["stage"], "files_read": reader.files_read}


def _describe(error: Exception) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    return f"unexpected {type(error).__name__}: {error} (a bug or an environment problem, not a damaged file)"


def _check_compatible(view: ShardView, extras: dict, meta: dict[str, Any], where: Path) -> None:
    saved_optimizer = meta.get("inner_optimizer")  # recorded from format version 3 on
    if saved_optimizer is not None and saved_optimizer != view.inner_optimizer:
        raise CheckpointError(
            f"{where}: saved with inner optimizer {' + '.join(saved_optimizer)}, this one wraps "
            f"{' + '.join(view.inner_optimizer)}; their states and hyperparameters differ. Build the optimizer "
            "the saved run used (for a new optimizer, load the model's weights only)"
        )
    scaler, live = meta["loss_scaler"], view.zero["loss_scaler"]
    if scaler.get("kind") == live["kind"] and set(scaler) != set(live):
        raise CheckpointError(
            f"{where}: field 'loss_scaler' has the keys {sorted(scaler)}, expected {sorted(live)}; the metadata "
            "is damaged: restore the checkpoint from a good copy, or save it again"
        )
    saved = meta["params"]
    current = dict(zip(view.names, view.params))
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: checkpoint is of a different model: parameters missing from it {missing[:5]}, "
            f"unexpected in it {unexpected[:5]}"
        )
    shapes = [
        f"{n}: saved {saved[n]['shape']}, model {list(p.shape)}"
        for n, p in current.items()
        if saved[n]["shape"] != list(p.shape)
    ]
    if shapes:
        raise CheckpointError(f"{where}: checkpoint is of a different model: shapes differ ({'; '.join(shapes[:5])})")
    saved_extras = meta.get("extras", {}) | meta.get("external", {})
    bad = [n for n, t in extras.items() if n not in saved_extras or saved_extras[n]["shape"] != list(t.shape)]
    if bad:
        raise CheckpointError(
            f"{where}: checkpoint is of a different model: frozen params/buffers missing or of another shape: {bad[:5]}"
        )
    current_groups = [list(g["param_names"]) for g in view.state_dict["param_groups"]]
    if current_groups != [g["params"] for g in meta["param_groups"]]:
        raise CheckpointError(
            f"{where}: the optimizer's param groups differ from the saved ones (same params in the same "
            "groups and order are required); build the optimizer the way the saved run did"
        )


def _whole_state(reader: ShardReader, name: str, saved: dict[str, Any], shard, param) -> dict[str, Any]:
    """The non-element-wise state of a param saved whole (factored moments, block scales, packed
    8-bit/4-bit states), read from its saved owner's file; only a whole-owned param can take it.
    """
    whole, packed = saved.get("whole_state", {}), saved.get("packed_state", {})
    if not (whole or packed):
        return {}
    if not shard.whole:
        key = next(iter(whole or packed))
        raise CheckpointError(
            f"{reader.path}: optimizer state {key!r} of {name!r} is not element-wise (saved whole by rank "
            f"{saved['owner']}), so it cannot be split into row shards; load it with partition='params' "
            "(or 'auto', which picks it for this optimizer)"
        )
    file = rank_file_name(saved["owner"], reader.saved_world_size)
    entry = {key: reader.read(file, state_key(name, key), info["shape"]) for key, info in whole.items()}
    for key, info in packed.items():
        try:
            cls = packed_class(info["class"])  # an allowlisted name only ([Note: loading runs no code])
        except (ImportError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{reader.path}: optimizer state {key!r} of {name!r}: {e}") from e
        inner = {
            attr: reader.read(file, state_key(name, f"{key}.{attr}"), spec["shape"])
            for attr, spec in info["inner"].items()
        }
        entry[key] = cls.__tensor_unflatten__(inner, attributes_from_json(info["attributes"]), param.shape, None)
    return entry


def _stage(view: ShardView, extras: dict, reader: ShardReader, meta: dict[str, Any]):
    """This rank's shard as a state dict for ``opt.load_state_dict``, read into new tensors, and
    the model's extras; nothing of the optimizer or model is touched.
    """
    masters, state = {}, {}
    for pos, name in enumerate(view.names):
        saved, shard = meta["params"][name], view.shards[pos]
        owner = saved.get("owner")  # None: saved in rows
        piece = shard.piece_numel(view.rank)
        template = view.zero["master_rows"][pos]
        masters[pos] = torch.zeros(piece, dtype=template.dtype, device=template.device)
        read_row(reader, master_key(name), saved["numel"], shard, view.rank, masters[pos], owner)
        if not saved["has_state"] or piece == 0:
            continue
        entry = {k: scalar_from_json(v) for k, v in saved["scalar_state"].items()}
        dtypes = saved.get("row_state_dtypes", {})
        for key in saved["row_state"]:
            # the saved dtype (bitsandbytes keeps uint8 states); load_state_dict casts and moves
            entry[key] = torch.zeros(piece, dtype=dtype_named(dtypes.get(key, "float32")))
            read_row(reader, state_key(name, key), saved["numel"], shard, view.rank, entry[key], owner)
        entry |= _whole_state(reader, name, saved, shard, view.params[pos])
        state[pos] = entry
    groups = []
    for g_meta, live in zip(meta["param_groups"], view.state_dict["param_groups"]):
        hyper = {k: scalar_from_json(v) for k, v in g_meta["hyperparameters"].items()}
        for k, v in live.items():  # keep the live types (tuples for betas)
            if k in hyper and isinstance(v, tuple):
                hyper[k] = tuple(hyper[k])
        groups.append(dict(hyper, params=live["params"], param_names=live["param_names"]))
    scaler = meta["loss_scaler"]
    if scaler.get("kind") != view.zero["loss_scaler"]["kind"]:
        scaler = view.zero["loss_scaler"]  # another precision than the saved run: keep this run's scaler
    zero = dict(
        view.zero,
        master_rows=masters,
        loss_scaler=scaler,
        skipped_steps=meta["skipped_steps"],
        consecutive_skips=meta["consecutive_skips"],
        exact_grid=meta.get("exact_grid"),
    )
    stored = meta.get("extras", {})  # the rest were left to the model's own checkpoint
    values = {
        name: reader.read(EXTRAS_FILE, extra_key(name), list(t.shape)) for name, t in extras.items() if name in stored
    }
    return {"state": state, "param_groups": groups, SECTION: zero}, values
