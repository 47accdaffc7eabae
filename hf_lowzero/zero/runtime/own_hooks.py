"""Which module hooks are hf_lowzero's own: marked where they are made, so that code that inspects a
model's hooks (the snapshot's ``ModelExtras`` cache) can tell them from a user's.

Example::

    hook = mark_own_hook(state_dict_pre_hook)       # before registering it
    module.register_state_dict_pre_hook(hook)
    [h for h in module._state_dict_pre_hooks.values() if not is_own_hook(h)]   # the user's alone

A hook marked so promises not to change what it is called about: a state-dict pre-hook of ours waits
for the params' all-gathers and leaves the state dict's entries, their names and their tensors as
they are ([Note: params are current] in ``update/allgather.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

OWN_HOOK_ATTR = "_hf_lowzero"  # set to True on each hook function hf_lowzero registers

Hook = TypeVar("Hook", bound=Callable)


def mark_own_hook(hook: Hook) -> Hook:
    """Mark ``hook`` (a function) as hf_lowzero's own and return it."""
    setattr(hook, OWN_HOOK_ATTR, True)
    return hook


def is_own_hook(hook: object) -> bool:
    """Whether ``hook`` is marked by :func:`mark_own_hook` (also inside torch's ``_WrappedHook``, as
    ``register_load_state_dict_pre_hook`` stores it)."""
    inner = getattr(hook, "hook", hook)
    return getattr(inner, OWN_HOOK_ATTR, False) is True
