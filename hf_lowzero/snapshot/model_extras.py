"""Rank 0's model state beside the shard: found by a walk of the model once per model structure.

Example::

    found = last if last is not None and last.fits(model) else ModelExtras.of(model, params, names)
    unsharded = found.unsharded()              # {name: live tensor}: frozen params, persistent buffers
    buffers = found.buffer_names               # the persistent buffers among them (rank 0's piece holds them)

# [Note: model extras]
# The optimizer shards the params it manages; the rest of the model's state dict (persistent
# buffers, which rank 0's piece holds, and frozen params, which its manifest describes) is found by
# walking ``model.state_dict()`` and ``named_buffers()``: a fifth of the main job's stop on rank 0,
# and it grows with the number of modules, a walk through every one. The answer changes only with
# the model's structure, so a walk's answer is kept as places (a module and the name of the
# parameter or buffer in it), from which each stop reads the tensors that live there now (a buffer
# replaced by another tensor is read from its place), while every module is the same object with
# the same params, buffers, non-persistent buffers and state-dict hooks (``fingerprint``: one tuple
# per module, compared at once). A model whose state dict a module writes its own way (a state-dict
# hook, extra state, its own ``_save_to_state_dict``), or whose entries are not all found in their
# modules, is walked at every stop. Our own state-dict pre-hooks (the overlapped all-gather's, which
# wait for the gathers and change no entry: ``zero/runtime/own_hooks.py``) are not the model's: a walk
# would run them and wait for every gather in flight at each stop, for entries no gather writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_lowzero.checkpoint.shards import unsharded_state
from hf_lowzero.zero.layout.params import canonical_name
from hf_lowzero.zero.runtime.own_hooks import is_own_hook

Place = tuple[torch.nn.Module, str, str]  # module, "_parameters" or "_buffers", the name in it


@dataclass(frozen=True)
class ModelExtras:
    """The model's state dict entries the optimizer does not shard, by canonical name, and which of
    them are persistent buffers; kept as places for a model of one ``fingerprint``.
    """

    fingerprint: tuple | None  # None: never reused (a module writes its state dict its own way)
    places: dict[str, Place]
    buffer_names: frozenset[str]
    walked: dict[str, torch.Tensor]  # the walk's answer (what ``unsharded`` reads without places)

    @classmethod
    def of(cls, model: torch.nn.Module, managed: list[torch.nn.Parameter], managed_names: list[str]) -> ModelExtras:
        """Walk ``model``: its entries that are not ``managed`` (params named ``managed_names``)."""
        walked = unsharded_state(model, managed, managed_names)
        buffer_names = frozenset({canonical_name(name) for name, _ in model.named_buffers()} & set(walked))
        places = _places(model) if _plain(model) else {}
        found = {name: places.get(name) for name in walked}
        if any(place is None or not _same(_read(place), walked[name]) for name, place in found.items()):
            return cls(None, {}, buffer_names, walked)
        return cls(fingerprint(model), found, buffer_names, walked)

    def fits(self, model: torch.nn.Module) -> bool:
        """Whether this walk's places are ``model``'s ([Note: model extras])."""
        return self.fingerprint is not None and fingerprint(model) == self.fingerprint

    def unsharded(self) -> dict[str, torch.Tensor]:
        """The entries, read from their places now (or the walk's, when it kept none)."""
        if self.fingerprint is None:
            return dict(self.walked)
        return {name: _read(place) for name, place in self.places.items()}


def fingerprint(model: torch.nn.Module) -> tuple:
    """What the places depend on: every module (the object), its params and buffers that are set,
    its non-persistent buffers and its state-dict hooks (a user's: not ours)."""
    return tuple(
        (
            id(m),
            tuple(k for k, v in m._parameters.items() if v is not None),
            tuple(k for k, v in m._buffers.items() if v is not None),
            tuple(m._non_persistent_buffers_set),
            _foreign(m._state_dict_hooks),
            _foreign(m._state_dict_pre_hooks),
        )
        for m in model.modules()
    )


def _plain(model: torch.nn.Module) -> bool:
    """No module writes its state dict its own way."""
    base = torch.nn.Module
    return not any(
        _foreign(m._state_dict_hooks)
        or _foreign(m._state_dict_pre_hooks)
        or type(m).get_extra_state is not base.get_extra_state
        or type(m)._save_to_state_dict is not base._save_to_state_dict
        for m in model.modules()
    )


def _foreign(hooks: dict) -> tuple[int, ...]:
    """The handle ids of ``hooks`` (a module's hook dict) that are not ours."""
    return tuple(key for key, hook in hooks.items() if not is_own_hook(hook))


def _places(model: torch.nn.Module) -> dict[str, Place]:
    """Where each state dict entry of ``model`` lives, by canonical name (the names the state dict
    gives a plain model: a module's prefix, then the param's or persistent buffer's name)."""
    places: dict[str, Place] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(canonical_name(head + name), (module, "_parameters", name))
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                places.setdefault(canonical_name(head + name), (module, "_buffers", name))
    return places


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.dtype, a.device) == (b.data_ptr(), b.shape, b.dtype, b.device)


def _read(place: Place) -> torch.Tensor:
    module, kind, name = place
    return getattr(module, kind)[name].detach()
