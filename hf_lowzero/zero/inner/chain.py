"""ChainedOptimizer: several torch optimizers over disjoint params, as one ``torch.optim.Optimizer``.

For recipes that give different params to different optimizers, such as Muon for the 2-D weight
matrices and AdamW for embeddings, biases and norms. The chain is one optimizer to everything that
expects one: ``Trainer(optimizers=(chain, None))``, LR schedulers, DDP training, and
``LowLevelZeroOptimizer`` (which gives it whole-parameter ownership when one of its optimizers is
not element-wise, so each owner runs Muon on whole matrices).

Example::

    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "wte" not in n)]
    chain = ChainedOptimizer(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-4))
    trainer = LowZeroTrainer(model=model, args=args, optimizers=(chain, None), train_dataset=ds)

``param_groups`` are the optimizers' own group dicts, in order (a hyperparameter set there reaches
the optimizer that owns the group); ``state`` reads and writes through to the optimizer holding the
param; ``state_dict()`` numbers params across the chain as torch does for one optimizer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from hf_lowzero.zero.inner.groups import HOOK_TABLES


class _ChainState(MutableMapping):
    """The optimizers' ``state`` dicts as one mapping, each key in the optimizer holding it."""

    def __init__(self, chain: ChainedOptimizer) -> None:
        self._chain = chain

    def _holder(self, key) -> torch.optim.Optimizer | None:
        return next((o for o in self._chain.optimizers if key in o.state), None)

    def __getitem__(self, key):
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        return holder.state[key]

    def __setitem__(self, key, value) -> None:
        self._chain.optimizer_of(key).state[key] = value

    def __delitem__(self, key) -> None:
        holder = self._holder(key)
        if holder is None:
            raise KeyError(key)
        del holder.state[key]

    def __iter__(self) -> Iterator:
        for optimizer in self._chain.optimizers:
            yield from list(optimizer.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._chain.optimizers)


class ChainedOptimizer(torch.optim.Optimizer):
    """Steps each of ``optimizers`` (over disjoint params) in turn; see the module docstring.

    Args:
        *optimizers: The optimizers, in the order they step; each param in exactly one of them.

    Raises:
        TypeError: No optimizer was given, or one is not a ``torch.optim.Optimizer``.
        ValueError: Two of the optimizers share a param.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("ChainedOptimizer takes one or more torch.optim.Optimizer instances")
        seen: set[int] = set()
        for optimizer in optimizers:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if ids & seen:
                raise ValueError("the chained optimizers share a param; give each param to exactly one of them")
            seen |= ids
        # Not Optimizer.__init__: the groups and state are the chained optimizers' own.
        self.optimizers = list(optimizers)
        self.defaults = dict(optimizers[0].defaults)
        self._state = _ChainState(self)
        for name in HOOK_TABLES:
            setattr(self, name, OrderedDict())

    def __repr__(self) -> str:
        return f"ChainedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizers' own group dicts, in chain order.

        Setting it takes as many groups as the chain has and hands each optimizer its share, in order;
        another number raises ``ValueError``.
        """
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if len(groups) != len(self.param_groups):
            raise ValueError(f"{len(groups)} param groups for a chain of {len(self.param_groups)}")
        for optimizer in self.optimizers:
            n = len(optimizer.param_groups)
            optimizer.param_groups, groups = list(groups[:n]), groups[n:]

    @property
    def state(self) -> _ChainState:
        """The optimizers' state as one mapping by param, reading and writing through to the optimizer holding it."""
        return self._state

    def optimizer_of(self, param: torch.Tensor) -> torch.optim.Optimizer:
        """The chained optimizer whose groups hold ``param``.

        Args:
            param: A param of one of the chained optimizers.

        Returns:
            That optimizer.

        Raises:
            KeyError: No chained optimizer holds ``param``.
        """
        for optimizer in self.optimizers:
            if any(p is param for group in optimizer.param_groups for p in group["params"]):
                return optimizer
        raise KeyError("the param is in none of the chained optimizers")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the chain has no groups of its own; add the group to one of the chained optimizers.

        Args:
            param_group: The group that would be added.

        Raises:
            RuntimeError: Always.
        """
        raise RuntimeError("add a param group to one of the chained optimizers itself")

    @torch.no_grad()
    def step(self, closure=None):
        """Step each chained optimizer once, in order.

        Args:
            closure (Callable[[], float] | None): Must be None: closures are not supported.

        Raises:
            TypeError: A closure was given.
        """
        if closure is not None:
            raise TypeError("ChainedOptimizer.step() does not support a closure")
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of every chained optimizer's params.

        Args:
            set_to_none: Set the gradients to None instead of zeroing them, as torch's ``zero_grad`` does.
        """
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def _spans(self) -> list[tuple[int, int, int]]:
        """Per optimizer: (first group, number of groups, first param position) in the chain."""
        spans, group, position = [], 0, 0
        for optimizer in self.optimizers:
            n_groups = len(optimizer.param_groups)
            spans.append((group, n_groups, position))
            group += n_groups
            position += sum(len(g["params"]) for g in optimizer.param_groups)
        return spans

    def state_dict(self) -> dict[str, Any]:
        """The state dict in torch's format over the whole chain: params numbered across it, groups in order.

        Returns:
            ``{"state": ..., "param_groups": ...}``, as one optimizer over all the params would give it.
        """
        state, groups = {}, []
        for optimizer, (_, _, first) in zip(self.optimizers, self._spans()):
            own = optimizer.state_dict()
            state |= {first + pos: entry for pos, entry in own["state"].items()}
            groups += [dict(g, params=[first + p for p in g["params"]]) for g in own["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of :meth:`state_dict`'s format, each optimizer its own groups and state.

        Args:
            state_dict: The state dict, of a chain of the same optimizers over the same params and groups.

        Raises:
            ValueError: The state dict has another number of param groups than the chain, or a chained
                optimizer's ``load_state_dict`` refuses its share.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(groups)} param groups, the chain {len(self.param_groups)}")
        for optimizer, (g0, n_groups, first) in zip(self.optimizers, self._spans()):
            own_groups = [dict(g, params=[p - first for p in g["params"]]) for g in groups[g0 : g0 + n_groups]]
            positions = {p for g in groups[g0 : g0 + n_groups] for p in g["params"]}
            own_state = {pos - first: entry for pos, entry in state_dict["state"].items() if pos in positions}
            optimizer.load_state_dict({"state": own_state, "param_groups": own_groups})
