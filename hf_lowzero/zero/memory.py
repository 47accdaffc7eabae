"""Per-rank memory accounting, measured from live tensors (bytes are deterministic).

Example::

    >>> report = opt.memory_report()
    >>> report.model_state_bytes, report.by_device     # e.g. {"cuda:0": ..., "cpu": ...} with offload
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer


def is_packed(value: object) -> bool:
    """A tensor subclass that stores its data in inner tensors (``__tensor_flatten__``), such as
    torchao's 8-bit and 4-bit optimizer states."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__")


def plain_tensors(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """``tensors`` with every packed tensor replaced by the plain tensors it stores its data in."""
    for t in tensors:
        if is_packed(t):
            names, _ = t.__tensor_flatten__()
            yield from plain_tensors(getattr(t, name) for name in names)
        else:
            yield t


def bytes_by_device(tensors: Iterable[torch.Tensor]) -> Counter:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once; packed
    tensors count what they store), per device."""
    seen: dict[tuple[str, int], int] = {}
    for t in plain_tensors(tensors):
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    placed: Counter = Counter()
    for (device, _), nbytes in seen.items():
        placed[device] += nbytes
    return placed


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` begin at the same element of the same storage. Unlike comparing data
    pointers, it also tells fake tensors apart (a memory plan runs this code on them; their data
    pointers are all 0)."""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, all devices together."""
    return sum(bytes_by_device(tensors).values())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds.

    ``grads`` are full-size ``p.grad`` tensors still alive; ``grad_buffers`` the optimizer's own
    gradient storage (fp32 gradient rows, host staging buffers with offload); ``comm_buffers`` the
    scratch of bucket collectives (on CPU pooled and kept, bounded by the buckets in flight).
    ``model_state_bytes`` is the ZeRO paper's "model states": params + gradients + optimizer
    states (master rows included), without scratch. ``by_device`` splits all of it by device: with
    ``offload_optimizer`` the master rows, optimizer state and gradient rows sit on ``"cpu"``.
    """

    params: int
    grads: int
    grad_buffers: int
    master_rows: int
    optimizer_state: int
    buffers: int
    comm_buffers: int = 0
    by_device: dict[str, int] = field(default_factory=dict)

    @classmethod
    def measure(cls, **parts: Counter) -> MemoryReport:
        """A report from per-device byte counts of each part (the field names)."""
        total: Counter = Counter()
        for placed in parts.values():
            total.update(placed)
        return cls(**{name: sum(placed.values()) for name, placed in parts.items()}, by_device=dict(total))

    @property
    def model_state_bytes(self) -> int:
        return self.params + self.grads + self.grad_buffers + self.master_rows + self.optimizer_state

    def as_mib(self) -> dict[str, float]:
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_device"}
        sizes["model_state_bytes"] = self.model_state_bytes
        sizes |= {f"on {device}": nbytes for device, nbytes in self.by_device.items()}
        return {k: round(v / 2**20, 3) for k, v in sizes.items()}


def optimizer_memory(opt: LowLevelZeroOptimizer) -> MemoryReport:
    """What ``opt.memory_report()`` returns: the bytes of each part ``opt`` and its model hold."""
    managed = {id(slot.param) for slot in opt.slots}
    state = (v for entry in opt.optim.state.values() for v in entry.values() if isinstance(v, torch.Tensor))
    return MemoryReport.measure(
        params=bytes_by_device(opt.model.parameters()),
        grads=bytes_by_device(p.grad for p in opt.model.parameters() if id(p) in managed and p.grad is not None),
        grad_buffers=opt.reducer.buffer_bytes(),
        master_rows=bytes_by_device([opt.master.flat]),
        optimizer_state=bytes_by_device(state),
        buffers=bytes_by_device(opt.model.buffers()),
        comm_buffers=bytes_by_device(opt.reducer.pool.tensors()),
    )
