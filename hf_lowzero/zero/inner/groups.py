"""The optimizer's two sets of param groups and the hyperparameter sync between them.

# [Note: two sets of param groups]
# ``opt.param_groups`` is what torch.optim code sees: the model's own parameters, in the groups
# and order the inner optimizer was built with, with their hyperparameters. The inner optimizer
# keeps the same groups over this rank's inner params ([Note: inner params] in ``adopt.py``):
# views of its master rows. Hyperparameters may be changed on either side: by code holding the
# ZeRO optimizer (LR schedulers, Trainer, user code) or by code holding the inner one (a scheduler
# built before wrapping, a Trainer given ``optimizers=(inner, scheduler)``). Before every step,
# every ``state_dict()`` and every read of ``opt.param_groups``, each key changed on one side only
# since the last sync is copied to the other; a key changed on both sides takes the outer value.

Example::

    groups = ParamGroups(inner_optimizer)       # outer groups: the inner's, before it is re-pointed
    inner_optimizer.param_groups[0]["lr"] = 0.1  # e.g. a scheduler bound to the inner optimizer
    groups.sync()
    groups.outer[0]["lr"]                        # 0.1
"""

from __future__ import annotations

from typing import Any

import torch

NOT_HYPERPARAMETERS = ("params", "param_names")
# The hook tables torch.optim.Optimizer's step/state_dict wrappers and LR schedulers expect; an
# optimizer that presents another's groups (and skips Optimizer.__init__) still needs them.
HOOK_TABLES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    try:
        return bool(a == b)
    except Exception:  # values without a usable == are treated as changed
        return False


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else v
        for k, v in group.items()
        if k not in NOT_HYPERPARAMETERS
    }


class ParamGroups:
    """Outer groups (the model's params) for an inner optimizer, kept in sync with its groups."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.outer: list[dict[str, Any]] = [dict(g, params=list(g["params"])) for g in inner.param_groups]
        self._last = [_snapshot(g) for g in self.outer]

    def sync(self) -> None:
        """Copy every hyperparameter changed on one side since the last sync to the other side."""
        for outer, inner, last in zip(self.outer, self.inner.param_groups, self._last):
            for key in (set(outer) | set(inner)) - set(NOT_HYPERPARAMETERS):
                o, i = outer.get(key, _MISSING), inner.get(key, _MISSING)
                if o is _MISSING:
                    outer[key] = i
                elif i is _MISSING or _same(i, o):
                    inner[key] = o
                elif _same(o, last.get(key, _MISSING)):
                    outer[key] = i  # changed on the inner side only
                else:
                    inner[key] = o
        self._last = [_snapshot(g) for g in self.outer]

    def replace(self, groups: list[dict[str, Any]]) -> None:
        """Adopt new outer group dicts (same params, same sizes), as ``opt.param_groups = ...`` does."""
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(g["params"]) for g in self.outer]:
            raise ValueError(
                f"param groups of sizes {sizes} cannot replace those of sizes "
                f"{[len(g['params']) for g in self.outer]}: the sharded optimizer's params are fixed at construction"
            )
        self.outer = list(groups)
        self._last = [{} for _ in self.outer]  # every key counts as changed on the outer side
        self.sync()

    def freeze_sizes(self) -> None:
        """Remember how many params each group holds on both sides (once the inner optimizer holds
        its inner params); ``check_sizes`` refuses any change."""
        self._sizes = self._current_sizes()

    def check_sizes(self) -> None:
        if self._current_sizes() != self._sizes:
            raise RuntimeError(
                f"opt.param_groups changed shape after wrapping (group sizes now {self._current_sizes()[0]}); "
                "the sharded optimizer's params are fixed at construction: edit hyperparameters only"
            )

    def _current_sizes(self) -> tuple[list[int], list[int]]:
        return [len(g["params"]) for g in self.outer], [len(g["params"]) for g in self.inner.param_groups]
