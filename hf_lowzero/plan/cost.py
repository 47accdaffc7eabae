"""What training costs: a price per device-hour times the hours a number of tokens takes.

[Note: the cost of tokens] Training ``tokens`` tokens on ``devices`` devices that together train
``tokens_per_s`` tokens per second takes ``tokens / tokens_per_s / 3600`` hours of each device, so
it costs ``devices * hours * per_device_hour`` in the currency the price is in. With the plan's
tokens per second per device that is ``tokens / per_device_tokens_per_s / 3600 * per_device_hour``:
at a fixed per-device batch, more devices cost more only where each device trains fewer tokens per
second (the scaling table's efficiency).

Example::

    price = Price.of(2.5, tokens=1e9)     # 2.5 per device-hour, a billion tokens
    price.cost(devices=8, tokens_per_s=1.2e6)                 # 578.7...
    price.apply(plan)                     # every timed row of the plan gets its ``cost``
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

DEFAULT_TOKENS = 10**9  # a fine-tune's order of magnitude; --tokens sets another
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Price:
    """A price per device-hour and the tokens it is asked for ([Note: the cost of tokens]).

    Args:
        per_device_hour: What one device costs per hour, in any currency (> 0).
        tokens: The tokens to train (> 0).
    """

    per_device_hour: float
    tokens: float = DEFAULT_TOKENS

    @classmethod
    def of(cls, per_device_hour: Any, tokens: Any = DEFAULT_TOKENS) -> Price:
        """The price, each value checked: a positive, finite number (``tokens`` also ``"2B"``, ``"500M"``).

        Example::

            Price.of("2.5", "2B").tokens          # 2e9

        Args:
            per_device_hour: What one device costs per hour: a number or its text.
            tokens: The tokens to train: a number, its text, or with a suffix K, M, B (or G) or T.

        Returns:
            The price.

        Raises:
            ValueError: Either value is not a positive, finite number.
        """
        price = _positive(per_device_hour, "price_per_device_hour", "a price per device and hour such as 2.5")
        count = _positive(tokens, "tokens", "a number of tokens such as 1e9, 500M or 2B", suffixes=True)
        return cls(per_device_hour=price, tokens=count)

    def cost(self, devices: int, tokens_per_s: float) -> float:
        """What training ``self.tokens`` costs on ``devices`` devices that train ``tokens_per_s`` in all."""
        hours = self.tokens / tokens_per_s / 3600
        return devices * hours * self.per_device_hour

    def describe(self) -> dict[str, float]:
        """The price as plain data, for the plan's JSON."""
        return {"per_device_hour": self.per_device_hour, "tokens": self.tokens}

    def apply(self, plan) -> None:
        """Give each timed row of ``plan`` (a ``MemoryPlan``) its ``cost``, and the plan its ``price``."""
        plan.price = self.describe()
        for row in plan.rows:
            if row.tokens_per_s:
                row.cost = self.cost(plan.world_size, row.tokens_per_s * plan.world_size)


def format_cost(value: float | None) -> str:
    """A cost for a table: two decimals with thousands separators, three digits below 1; ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:,.2f}" if value >= 1 else f"{value:.3g}"


def format_tokens(tokens: float) -> str:
    """``1e9`` -> ``"1B"``, ``2.5e6`` -> ``"2.5M"``: a token count for a column's title."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= size:
            return f"{tokens / size:g}{suffix}"
    return f"{tokens:g}"


def _positive(value: Any, name: str, expected: str, suffixes: bool = False) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([-+0-9.eE]+)\s*([A-Za-z]?)\s*", value)
        if match is not None and match[2].lower() in (_SUFFIXES if suffixes else ("",)):
            try:
                number = float(match[1]) * _SUFFIXES[match[2].lower()]
            except ValueError:
                number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name}={value!r} is invalid; expected {expected}: a positive, finite number")
    return number
