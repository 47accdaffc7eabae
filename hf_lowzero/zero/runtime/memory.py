"""Per-rank memory accounting, measured from live tensors (bytes are deterministic).

Example::

    >>> report = opt.memory_report()
    >>> report.model_state_bytes, report.by_device     # e.g. {"cuda:0": ..., "cpu": ...} with offload
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch


def is_packed(value: object) -> bool:
    """A tensor subclass that stores its data in inner tensors (``__tensor_flatten__``), such as
    torchao's 8-bit and 4-bit optimizer states.

    Args:
        value: Anything.

    Returns:
        Whether ``value`` is such a tensor.
    """
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__")


def plain_tensors(tensors: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]:
    """``tensors`` with every packed tensor replaced by the plain tensors it stores its data in.

    Args:
        tensors: The tensors.

    Yields:
        Each plain tensor, and the inner tensors of each packed one (recursively).
    """
    for t in tensors:
        if is_packed(t):
            names, _ = t.__tensor_flatten__()
            yield from plain_tensors(getattr(t, name) for name in names)
        else:
            yield t


def bytes_by_device(tensors: Iterable[torch.Tensor]) -> Counter:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once; packed
    tensors count what they store), per device.

    Args:
        tensors: The tensors.

    Returns:
        Bytes by device name (``"cuda:0"``, ``"cpu"``, ...).
    """
    seen: dict[tuple[str, int], int] = {}
    for t in plain_tensors(tensors):
        storage = t.untyped_storage()
        seen[(str(t.device), storage._cdata)] = storage.nbytes()  # the storage itself: fake tensors too
    placed: Counter = Counter()
    for (device, _), nbytes in seen.items():
        placed[device] += nbytes
    return placed


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` begin at the same element of the same storage. Unlike comparing data
    pointers, it also tells fake tensors apart (a memory plan runs this code on them; their data
    pointers are all 0).

    Args:
        a: A tensor.
        b: Another tensor.

    Returns:
        Whether both begin at the same element of the same storage.
    """
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, all devices together.

    Args:
        tensors: The tensors.

    Returns:
        The bytes.
    """
    return sum(bytes_by_device(tensors).values())


def gather_buffer_bytes(buckets: Sequence[Any], rows: torch.Tensor, *, world_size: int, at_once: int | None) -> int:
    """The most bytes the params' all-gathers hold at once on a device whose allocator recycles
    them (CUDA; on the CPU the communication pool keeps them, and ``comm_buffers`` counts them).

    Each bucket's gather holds its gathered buffer (``packed_numel`` elements in the bucket's dtype)
    and, where the rows it sends are a copy (master ``rows`` in another dtype than the params', or
    in host memory), this rank's ``row_numel`` elements in that dtype, until it is unpacked
    ([Note: overlapped all-gather] in ``update/allgather.py``).

    Args:
        buckets: The bucket plan (``Bucket``: ``dtype``, ``device``, ``packed_numel``, ``row_numel``).
        rows: The master rows the gathers send from (their dtype and device).
        world_size: Ranks in the group; at 1 nothing is gathered.
        at_once: Buckets in flight at once, consecutive in the order they are issued (the plan's
            reversed); None: every bucket's (deferred gathers, alive from the step to the forward).

    Returns:
        The bytes.
    """
    if world_size == 1:
        return 0
    held = []
    for bucket in reversed(buckets):  # the order the gathers are issued
        if bucket.device.type == "cpu":
            held.append(0)
            continue
        itemsize = bucket.dtype.itemsize
        copied = rows.dtype != bucket.dtype or rows.device != bucket.device
        held.append(itemsize * (bucket.packed_numel + (bucket.row_numel if copied else 0)))
    window = len(held) if at_once is None else max(1, at_once)
    return max((sum(held[i : i + window]) for i in range(max(1, len(held) - window + 1))), default=0)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds.

    ``grads`` are full-size ``p.grad`` tensors still alive; ``grad_buffers`` the optimizer's own
    gradient storage (fp32 gradient rows, host staging buffers with offload); ``comm_buffers`` the
    scratch of bucket collectives (on CPU pooled and kept, bounded by the buckets in flight).
    ``model_state_bytes`` is the ZeRO paper's "model states": params + gradients + optimizer
    states (master rows included), without scratch. ``by_device`` splits all of it by device: with
    ``offload_optimizer`` the master rows, optimizer state and gradient rows sit on ``"cpu"``.
    ``pinned`` is the part of the host bytes that is page-locked (offload with CUDA params: the
    master rows, gradient rows and staging buffers), in whole pages, as the OS counts it
    ([Note: exact pinned memory] in ``device.py``). ``gather_buffers`` is not held now but the
    most the params' all-gathers hold at once on CUDA (:func:`gather_buffer_bytes`): with
    ``overlap_allgather``, from ``step()`` until the next forward unpacks them.

    ``LowLevelZeroOptimizer.memory_report()`` builds one (through :meth:`measure`).

    Args:
        params: Bytes of the model's params.
        grads: Bytes of the full-size ``p.grad`` tensors of managed params still alive.
        grad_buffers: Bytes of the optimizer's own gradient storage (gradient rows, staging buffers).
        master_rows: Bytes of the master rows.
        optimizer_state: Bytes of the inner optimizer's state tensors.
        buffers: Bytes of the model's buffers.
        comm_buffers: Bytes of the bucket collectives' scratch.
        by_device: All of it by device name.
        pinned: Page-locked host bytes, in whole pages.
        gather_buffers: The most bytes the all-gathers into the params hold at once on CUDA.
    """

    params: int
    grads: int
    grad_buffers: int
    master_rows: int
    optimizer_state: int
    buffers: int
    comm_buffers: int = 0
    gather_buffers: int = 0
    by_device: dict[str, int] = field(default_factory=dict)
    pinned: int = 0

    @classmethod
    def measure(cls, pinned: int = 0, **parts: Counter) -> MemoryReport:
        """A report from per-device byte counts of each part (the field names) and the pinned bytes.

        Args:
            pinned: Page-locked host bytes.
            **parts: Per part, named as the fields (``params``, ``grads``, ...), its bytes by device.

        Returns:
            The report: each part's total, and all parts together by device.
        """
        total: Counter = Counter()
        for placed in parts.values():
            total.update(placed)
        sizes = {name: sum(placed.values()) for name, placed in parts.items()}
        return cls(**sizes, by_device=dict(total), pinned=pinned)

    @property
    def model_state_bytes(self) -> int:
        """The ZeRO paper's "model states": params, gradients, gradient buffers, master rows, optimizer state."""
        return self.params + self.grads + self.grad_buffers + self.master_rows + self.optimizer_state

    def as_mib(self) -> dict[str, float]:
        """The report in MiB, for logs and tables.

        Returns:
            Each field, ``model_state_bytes`` and each device's total (as ``"on <device>"``), in MiB
            rounded to three decimals.
        """
        sizes = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_device"}
        sizes["model_state_bytes"] = self.model_state_bytes
        sizes |= {f"on {device}": nbytes for device, nbytes in self.by_device.items()}
        return {k: round(v / 2**20, 3) for k, v in sizes.items()}
