"""What checkpoint code reads of a ``LowLevelZeroOptimizer``, through its public surface only
(``state_dict()``, ``param_groups``, ``model``, ``world_size``/``rank``/``process_group``), and the
small helpers shared by saving, loading and export.

Example::

    view = ShardView.of(opt)
    view.names[0], view.shards[0].owned_range(view.rank)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hf_lowzero.checkpoint.layout import packed_class_error
from hf_lowzero.zero.inner.chain import ChainedOptimizer
from hf_lowzero.zero.inner.shard_state import SECTION, is_row_state, is_whole_state
from hf_lowzero.zero.layout.params import canonical_name
from hf_lowzero.zero.layout.partition import ParamShard
from hf_lowzero.zero.runtime.memory import is_packed

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, or saved: the message names the file (or the failed ranks)
    and the problem.

    A ``ValueError``, so code that catches those catches it too.
    """


@dataclass
class ShardView:
    """This rank's shard, by position (torch's numbering: groups in order, params in order).

    Build it with :meth:`of`.

    Args:
        state_dict: The optimizer's ``state_dict()`` (this rank's shard in torch's format).
        names: Each param's name, by position.
        params: The model's params, by position.
        shards: How each param is split over the ranks (rows, or whole to one owner), by position.
        world_size: The number of ranks in the optimizer's process group.
        rank: This rank's index in that group.
        process_group: The optimizer's process group (None: the default group).
        device: The params' device, where collectives run.
        inner_optimizer: The inner optimizer's class, or each chained optimizer's, as ``module.qualname``.
    """

    state_dict: dict[str, Any]
    names: list[str]
    params: list[torch.nn.Parameter]
    shards: list[ParamShard]
    world_size: int
    rank: int
    process_group: Any
    device: torch.device  # the params' device: where collectives run ([Note: the params' device])
    inner_optimizer: list[str] = field(default_factory=list)
    _kind_cache: dict[int, dict[str, str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, opt: LowLevelZeroOptimizer) -> ShardView:
        """The view of ``opt``'s shard on this rank.

        Args:
            opt: The optimizer to read; only its public surface is used.

        Returns:
            The view, over one ``opt.state_dict()`` taken now (live tensors, not copies).
        """
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        owners = sd[SECTION].get("owners") or [None] * len(params)
        return cls(
            state_dict=sd,
            names=[n for g in sd["param_groups"] for n in g["param_names"]],
            params=params,
            shards=[ParamShard(p.numel(), world_size=opt.world_size, owner=owner) for p, owner in zip(params, owners)],
            world_size=opt.world_size,
            rank=opt.rank,
            process_group=opt.process_group,
            device=opt.device,
            inner_optimizer=optimizer_classes(opt.optim),
        )

    @property
    def zero(self) -> dict[str, Any]:
        """The ZeRO section of the state dict: master rows, owners, loss scaler, counters, stage."""
        return self.state_dict[SECTION]

    def _kinds(self, pos: int) -> dict[str, str]:
        """Each state entry of ``pos``: "packed" (a tensor subclass such as torchao's quantized
        states), "row" (element-wise: one value per element of this rank's piece), "whole" (any
        other tensor of a whole-owned param) or "scalar".
        """
        if pos in self._kind_cache:  # one view reads each param's kinds several times (a snapshot: 5)
            return self._kind_cache[pos]
        shard, kinds = self.shards[pos], self._kind_cache.setdefault(pos, {})
        for key, value in self.state_dict["state"].get(pos, {}).items():
            if is_packed(value):
                kinds[key] = "packed"
            elif is_row_state(value, shard, rank=self.rank):
                kinds[key] = "row"
            elif is_whole_state(value, shard, rank=self.rank):
                kinds[key] = "whole"
            else:
                kinds[key] = "scalar"
        return kinds

    def _of_kind(self, pos: int, kind: str) -> dict[str, Any]:
        state = self.state_dict["state"].get(pos, {})
        return {k: state[k] for k, found in self._kinds(pos).items() if found == kind}

    def row_state(self, pos: int) -> dict[str, torch.Tensor]:
        """Element-wise state tensors, flattened (1D, this rank's piece).

        Args:
            pos: The param's position.

        Returns:
            The state entries by name.
        """
        return {k: v.reshape(-1) for k, v in self._of_kind(pos, "row").items()}

    def whole_state(self, pos: int) -> dict[str, torch.Tensor]:
        """State tensors of a whole-owned param that are not element-wise (factored moments,
        block scales, quantization maps), in their own shapes.

        Args:
            pos: The param's position.

        Returns:
            The state entries by name.
        """
        return self._of_kind(pos, "whole")

    def packed_state(self, pos: int) -> dict[str, torch.Tensor]:
        """Packed state tensors (tensor subclasses such as torchao's 8-bit and 4-bit states), as they are.

        Args:
            pos: The param's position.

        Returns:
            The state entries by name.
        """
        return self._of_kind(pos, "packed")

    def scalar_state(self, pos: int) -> dict[str, Any]:
        """Every other state entry: numbers, single-value tensors (``step``), tuples.

        Args:
            pos: The param's position.

        Returns:
            The state entries by name.
        """
        return self._of_kind(pos, "scalar")


def optimizer_classes(optimizer: torch.optim.Optimizer) -> list[str]:
    """The class of ``optimizer`` as ``module.qualname``, or of each optimizer of a ``ChainedOptimizer``.

    Example::

        >>> optimizer_classes(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        ['torch.optim.sgd.SGD']
    """
    optimizers = optimizer.optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers]


def attributes_to_json(value: Any) -> Any:
    """The non-tensor attributes of a packed tensor (``__tensor_flatten__``'s context) as JSON.

    Args:
        value: The context, or a part of it.

    Returns:
        The same value made of JSON types: dtypes and sizes become small tagged dicts.

    Raises:
        ValueError: ``value`` holds something other than dtypes, sizes, lists, tuples, None, bools,
            numbers and strings.
    """
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, (list, tuple)):
        return [attributes_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"cannot save a packed optimizer state attribute of type {type(value).__name__}")


def attributes_from_json(value: Any) -> Any:
    """The inverse of :func:`attributes_to_json`: a packed tensor's context as a checkpoint recorded it.

    Args:
        value: The JSON value, or a part of it.

    Returns:
        The same value with dtypes and sizes restored (tuples come back as lists).
    """
    if isinstance(value, dict) and set(value) == {"dtype"}:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and set(value) == {"size"}:
        return torch.Size(value["size"])
    if isinstance(value, list):
        return [attributes_from_json(v) for v in value]
    return value


def packed_class(path: str) -> type:
    """The tensor subclass named ``module:qualname`` in a checkpoint's metadata, imported (never
    unpickled) only when the name is one of ``layout.PACKED_STATE_CLASSES``, checked first ([Note:
    loading runs no code] in ``meta_check.py``): a ``torch.Tensor`` subclass that can be rebuilt from
    inner tensors.

    Args:
        path: The class as ``module:qualname``.

    Returns:
        The class.

    Raises:
        ImportError: The module does not import (its package is not installed).
        AttributeError: The module has no such class.
        ValueError: The name is not in the allowlist, or not a ``torch.Tensor`` subclass with
            ``__tensor_unflatten__``.
    """
    error = packed_class_error(path)
    if error is not None:  # before any import: importing runs the module's code
        raise ValueError(error)
    module, _, qualname = path.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor) and hasattr(cls, "__tensor_unflatten__")):
        raise ValueError(f"{path} is not a torch.Tensor subclass with __tensor_unflatten__")
    return cls


def unsharded_state(model: torch.nn.Module, managed: list[torch.nn.Parameter], managed_names: list[str]):
    """Model state that is not sharded: frozen params and persistent buffers (rank 0 saves them),
    so a consolidated checkpoint is a complete model. Tied duplicates of managed params are skipped.

    Args:
        model: The model.
        managed: The params the optimizer shards.
        managed_names: Their names.

    Returns:
        (dict[str, torch.Tensor]): The model's other state dict entries, by their canonical (uncompiled)
            names.
    """
    managed_ptrs = {p.data_ptr() for p in managed}
    names = set(managed_names)
    return {
        canonical_name(name): t
        for name, t in model.state_dict(keep_vars=False).items()
        if t.data_ptr() not in managed_ptrs and canonical_name(name) not in names
    }


def scalar_to_json(value: Any) -> Any:
    """A scalar state entry or hyperparameter as JSON.

    Args:
        value: A number, string, tuple, None, or a single-value tensor.

    Returns:
        The value made of JSON types: a tensor becomes ``{"tensor": value, "dtype": name}``, a tuple a list.

    Raises:
        ValueError: ``value`` is a tensor of more than one element.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"unsupported optimizer state tensor of shape {tuple(value.shape)}")
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return list(value)
    return value


def scalar_from_json(value: Any) -> Any:
    """The inverse of :func:`scalar_to_json` (a tuple comes back as a list).

    Args:
        value: The JSON value.

    Returns:
        The value, with a recorded tensor rebuilt in its dtype.
    """
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value
