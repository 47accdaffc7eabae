"""Per-rank memory accounting, measured from live tensors (bytes are deterministic)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds.

    ``grads`` are full-size ``p.grad`` tensors still alive; ``grad_buffers`` the optimizer's own
    gradient storage (stage 1: full bucket buffers; stage 2: fp32 gradient rows plus buckets in
    flight). ``model_state_bytes`` is the ZeRO paper's "model states": params + gradients +
    optimizer states (master rows included).

    Example::

        >>> print(opt.memory_report().as_mib())
    """

    params: int
    grads: int
    grad_buffers: int
    master_rows: int
    optimizer_state: int
    buffers: int

    @property
    def model_state_bytes(self) -> int:
        return self.params + self.grads + self.grad_buffers + self.master_rows + self.optimizer_state

    def as_mib(self) -> dict[str, float]:
        fields = asdict(self) | {"model_state_bytes": self.model_state_bytes}
        return {k: round(v / 2**20, 3) for k, v in fields.items()}
