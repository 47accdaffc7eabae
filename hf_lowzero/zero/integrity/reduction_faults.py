"""Test-only fault injection into the step: corruption that real hardware causes, at the two points
where it would enter. Nothing here runs unless a test activates a fault.

- ``TRANSPORT``: between a bucket's packing (and its integrity checksums) and its collective, as a
  link or a NIC would corrupt it: drop one rank's contribution (zeros), or double it.
- ``REDUCED``: after the collective, before the rows are used, as a bad GPU or memory would: flip a
  bit of one rank's reduced rows.

Example (a test)::

    with inject(Fault("drop", rank=1, step=3, bucket=0)):
        train()      # the integrity check of step 3 names rank 1's contribution to bucket 0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

KINDS = ("drop", "double", "flip")


@dataclass
class Fault:
    """One fault: ``kind`` ("drop", "double" or "flip"), on ``rank``, at optimizer step ``step``
    (the checker's numbering, from 1), in bucket ``bucket``; ``element`` is the flipped element of
    the reduced rows (``bit`` its bit). ``times``: how many steps from ``step`` on it recurs."""

    kind: str
    rank: int
    step: int
    bucket: int = 0
    element: int = 0
    bit: int = 20
    times: int = 1
    fired: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"fault kind {self.kind!r} is invalid; expected one of {KINDS}")

    def due(self, *, rank: int, step: int, bucket: int) -> bool:
        return rank == self.rank and bucket == self.bucket and self.step <= step < self.step + self.times


_ACTIVE: list[Fault] = []


@contextlib.contextmanager
def inject(*faults: Fault) -> Iterator[None]:
    """Within: the faults fire when due (tests only)."""
    _ACTIVE.extend(faults)
    try:
        yield
    finally:
        for fault in faults:
            _ACTIVE.remove(fault)


def transport(flat: torch.Tensor, *, rank: int, step: int, bucket: int) -> None:
    """A bucket's packed gradients on their way to the collective."""
    for fault in _ACTIVE:
        if fault.kind in ("drop", "double") and fault.due(rank=rank, step=step, bucket=bucket):
            flat.zero_() if fault.kind == "drop" else flat.mul_(2)
            fault.fired += 1


def reduced(rows: torch.Tensor, *, rank: int, step: int, bucket: int) -> None:
    """A bucket's reduced rows on this rank, right after the collective."""
    for fault in _ACTIVE:
        if fault.kind == "flip" and fault.due(rank=rank, step=step, bucket=bucket):
            flip_bit(rows, fault.element, fault.bit)
            fault.fired += 1


def flip_bit(t: torch.Tensor, element: int, bit: int) -> None:
    """Flip bit ``bit`` of element ``element`` of the 1D tensor ``t`` in place."""
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    raw = t.view(words)
    raw[element] ^= 1 << min(bit, 8 * t.element_size() - 2)


def active() -> bool:
    return bool(_ACTIVE)
