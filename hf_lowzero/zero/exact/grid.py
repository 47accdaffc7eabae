"""The fixed-point grid of exact reduction ([Note: exact reduction] in ``__init__.py``): pure arithmetic
on host numbers, the same on every rank because its inputs are.

A parameter's contributions are rounded to multiples of ``2**-exponent``; the grid is described by a
bound per parameter (its contributions are expected below ``2**bound``) and the number of bits of the
largest count of contributions per step (``count_bits``).

Example::

    >>> grid = Grid.first(2)                      # before any step: 2**16 contributions below 2**16
    >>> grid.exponents()
    [30, 30]
    >>> grid.overflowed([1.0, 2.0**17], count=8)  # the second parameter's contribution is too large
    [1]
    >>> later = grid.advanced([0.25, 2.0**17], count=8)
    >>> later.count_bits, later.bounds             # 8 contributions; bounds follow the maxima, with headroom
    (3, [12, 30])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SUM_BITS = 62  # every partial sum of one parameter's contributions stays below 2**62 in magnitude
HEADROOM_BITS = 12  # a parameter's maximum may grow 4096-fold over the last step's before a step overflows
SHRINK_BITS = 4  # a bound falls by at most this many bits per step (a maximum that dips does not overflow later)
FIRST_BOUND_BITS = 16  # first step: contributions below 2**16 (fp16's whole range)
FIRST_COUNT_BITS = 16  # first step: at most 2**16 contributions
EXPONENT_LIMIT = 120  # |exponent| at most this: 2**exponent is a normal fp32 number
SQUARE_BITS = 53  # a parameter's rounded squares sum below 2**53: exact in float64, in any order


def ceil_log2(n: int) -> int:
    """The smallest ``k >= 0`` with ``n <= 2**k``."""
    return max(0, (int(n) - 1).bit_length())


def bound_bits(value: float) -> int:
    """The smallest ``e`` with ``|value| < 2**e`` (``value`` finite and not 0): exact, from its exponent."""
    return math.frexp(abs(value))[1]


@dataclass(frozen=True)
class Grid:
    """Per parameter (in slot order) the bound of its contributions; the count's bits; the largest
    count seen (0: none yet). See the module docstring."""

    bounds: list[int]
    count_bits: int
    seen: int = 0

    @staticmethod
    def first(params: int) -> Grid:
        """The grid of a run's first step: nothing observed yet."""
        return Grid([FIRST_BOUND_BITS] * params, FIRST_COUNT_BITS)

    @property
    def limit(self) -> float:
        """The largest magnitude a rounded contribution may have: ``2**(SUM_BITS - count_bits)``."""
        return 2.0 ** (SUM_BITS - self.count_bits)

    def exponents(self) -> list[int]:
        """Per parameter ``s``: contributions are rounded to multiples of ``2**-s``, so that a
        contribution below ``2**bound`` is below ``limit`` once scaled."""
        return [_clamp(SUM_BITS - self.count_bits - bound) for bound in self.bounds]

    def overflowed(self, maxima: list[float], count: int) -> list[int]:
        """The parameters whose step cannot be summed exactly on this grid: every one when ``count``
        (contributions over all ranks) exceeds ``2**count_bits``; otherwise those whose largest
        contribution, scaled, exceeds ``limit`` (an inf maximum, from a non-finite gradient, does)."""
        if count > 2**self.count_bits:
            return list(range(len(self.bounds)))
        limit = self.limit
        return [i for i, (m, s) in enumerate(zip(maxima, self.exponents())) if not m * 2.0**s <= limit]

    def advanced(self, maxima: list[float], count: int) -> Grid:
        """The next step's grid, from this step's global maxima of |contribution| per parameter and
        its count: each bound ``HEADROOM_BITS`` above its maximum, falling at most ``SHRINK_BITS`` per
        step; a parameter with no finite nonzero maximum keeps its bound. The count's bits follow the
        largest count seen."""
        seen = max(self.seen, int(count))
        bounds = [
            max(bound_bits(m) + HEADROOM_BITS, b - SHRINK_BITS) if m > 0 and math.isfinite(m) else b
            for m, b in zip(maxima, self.bounds)
        ]
        return Grid(bounds, ceil_log2(seen) if seen else self.count_bits, seen)

    def state_dict(self) -> dict:
        return {"bounds": list(self.bounds), "count_bits": self.count_bits, "seen": self.seen}

    @staticmethod
    def from_state_dict(state: dict) -> Grid:
        return Grid(list(state["bounds"]), int(state["count_bits"]), int(state["seen"]))


def square_exponents(maxima: list[float], numels: list[int]) -> list[int]:
    """Per parameter ``t``: its squares are rounded to multiples of ``2**-t`` so that the sum of its
    ``numel`` rounded squares stays below ``2**SQUARE_BITS``; ``maxima`` are its largest |value|
    (the squares are float64 products like ``m * m``, so none exceeds it)."""
    return [SQUARE_BITS - bound_bits(m * m) - ceil_log2(n) if m > 0 else 0 for m, n in zip(maxima, numels, strict=True)]


def _clamp(exponent: int) -> int:
    return max(-EXPONENT_LIMIT, min(EXPONENT_LIMIT, exponent))
