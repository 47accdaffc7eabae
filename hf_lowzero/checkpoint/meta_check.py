"""Checks of a parsed ``zero_meta.json`` before anything is read by it: every field that loading and
consolidation use, of the right type and in range, so damaged metadata gets a ``CheckpointError``
that names the file and the field, never a bare ``KeyError`` or ``TypeError``.

Example::

    check_metadata(json.loads(text), Path("ckpt/zero_meta.json"))   # returns, or raises CheckpointError

# [Note: loading runs no code]
# Metadata names packed state classes as ``module:qualname``; loading imports such a class to rebuild
# the state from its inner tensors. Only names in ``layout.PACKED_STATE_CLASSES`` are accepted, and the
# name is checked here, before any import: importing an arbitrary module runs its code (a planted
# ``this:Nope`` printed the Zen of Python). Nothing else in a checkpoint is imported or unpickled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from hf_lowzero.checkpoint.layout import packed_class_error
from hf_lowzero.checkpoint.shards import CheckpointError

_FIX = "the metadata is damaged: restore the checkpoint from a good copy, or save it again"


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype a checkpoint records as ``name`` (``"float32"``, ``"uint8"``, ...).

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (such as 'float32', 'bfloat16', 'uint8')")
    return value


class _Fields:
    """Type checks on one metadata file's fields, each failure a ``CheckpointError`` naming both."""

    def __init__(self, meta_path: Path) -> None:
        self.meta_path = meta_path

    def fail(self, field: str, value: Any, expected: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise CheckpointError(f"{self.meta_path}: field {field!r} is {shown}, expected {expected}; {_FIX}")

    def get(self, record: Any, key: str, field: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
        if key not in record:
            if required:
                raise CheckpointError(f"{self.meta_path}: field {field!r} is missing ({_kind_name(kind)}); {_FIX}")
            return None
        return self.need(record[key], field, kind)

    def need(self, value: Any, field: str, kind: type | tuple[type, ...]) -> Any:
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            self.fail(field, value, _kind_name(kind))
        return value

    def count(self, record: Any, key: str, field: str, low: int = 0, high: int | None = None) -> int | None:
        value = self.get(record, key, field, int)
        if value < low or (high is not None and value >= high):
            self.fail(field, value, f"an integer from {low}" + ("" if high is None else f" to {high - 1}"))
        return value

    def shape(self, record: Any, field: str) -> list[int]:
        value = self.get(record, "shape", f"{field}.shape", list)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
            self.fail(f"{field}.shape", value, "a list of sizes (integers >= 0)")
        return value

    def dtype(self, value: Any, field: str) -> None:
        try:
            dtype_named(value)
        except ValueError:
            self.fail(field, value, "a torch dtype name such as 'float32'")

    def tensors(self, record: Any, key: str, field: str, required: bool = False) -> None:
        """``{name: {"shape": [...], "dtype": name}}``: how the metadata describes stored tensors."""
        for name, info in (self.get(record, key, field, dict, required) or {}).items():
            self.need(info, f"{field}.{name}", dict)
            self.shape(info, f"{field}.{name}")
            if "dtype" in info:
                self.dtype(info["dtype"], f"{field}.{name}.dtype")

    def dtypes_within(self, value: Any, field: str) -> None:
        """Every recorded dtype inside a JSON value (scalar tensors, packed attributes)."""
        if isinstance(value, dict):
            if "dtype" in value:
                self.dtype(value["dtype"], f"{field}.dtype")
            for k, v in value.items():
                self.dtypes_within(v, f"{field}.{k}")
        elif isinstance(value, list):
            for v in value:
                self.dtypes_within(v, field)


def check_metadata(meta: dict[str, Any], meta_path: Path) -> None:
    """Check every field of ``meta`` (parsed from ``meta_path``, its format fields already checked)
    that loading and consolidation read.

    Raises:
        CheckpointError: A field is missing, of the wrong type or out of range, or a packed state names
            a class outside the allowlist; the message names the file and the field.
    """
    f = _Fields(meta_path)
    world_size = f.count(meta, "world_size", "world_size", low=1)
    stage = f.get(meta, "stage", "stage", int)
    if stage not in (1, 2):
        f.fail("stage", stage, "1 or 2")
    for name, record in f.get(meta, "params", "params", dict).items():
        _check_param(f, record, f"params.{name}", world_size)
    f.tensors(meta, "extras", "extras")
    f.tensors(meta, "external", "external")
    for i, group in enumerate(f.get(meta, "param_groups", "param_groups", list)):
        field = f"param_groups[{i}]"
        f.need(group, field, dict)
        f.dtypes_within(f.get(group, "hyperparameters", f"{field}.hyperparameters", dict), f"{field}.hyperparameters")
        if not all(isinstance(n, str) for n in f.get(group, "params", f"{field}.params", list)):
            f.fail(f"{field}.params", group["params"], "a list of parameter names")
    f.get(meta, "loss_scaler", "loss_scaler", dict)
    f.count(meta, "skipped_steps", "skipped_steps")
    f.count(meta, "consecutive_skips", "consecutive_skips")
    for name, size in f.get(meta, "files", "files", dict).items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            f.fail(f"files.{name}", size, "a size in bytes")
    classes = f.get(meta, "inner_optimizer", "inner_optimizer", list, required=False)
    if classes is not None and not all(isinstance(c, str) for c in classes):
        f.fail("inner_optimizer", classes, "a list of class names")


def _check_param(f: _Fields, record: Any, field: str, world_size: int) -> None:
    f.need(record, field, dict)
    numel = f.count(record, "numel", f"{field}.numel")
    if numel != math.prod(f.shape(record, field)):
        f.fail(f"{field}.numel", numel, f"the product of its shape {record['shape']}")
    if record.get("owner") is not None:
        f.count(record, "owner", f"{field}.owner", high=world_size)
    if "dtype" in record:
        f.dtype(record["dtype"], f"{field}.dtype")
    f.get(record, "has_state", f"{field}.has_state", bool)
    if not all(isinstance(k, str) for k in f.get(record, "row_state", f"{field}.row_state", list)):
        f.fail(f"{field}.row_state", record["row_state"], "a list of state names")
    for key, name in (f.get(record, "row_state_dtypes", f"{field}.row_state_dtypes", dict, False) or {}).items():
        f.dtype(name, f"{field}.row_state_dtypes.{key}")
    f.dtypes_within(f.get(record, "scalar_state", f"{field}.scalar_state", dict), f"{field}.scalar_state")
    f.tensors(record, "whole_state", f"{field}.whole_state")
    for key, info in (f.get(record, "packed_state", f"{field}.packed_state", dict, False) or {}).items():
        where = f"{field}.packed_state.{key}"
        f.need(info, where, dict)
        error = packed_class_error(info.get("class"))
        if error is not None:
            raise CheckpointError(f"{f.meta_path}: field '{where}.class': {error}; {_FIX}")
        f.dtypes_within(info.get("attributes"), f"{where}.attributes")
        f.tensors(info, "inner", f"{where}.inner", required=True)


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {dict: "a JSON object", list: "a JSON list", int: "an integer", str: "a string", bool: "true or false"}
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))
