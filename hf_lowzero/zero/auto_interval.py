"""The "auto" interval of work that runs every few steps (memory snapshots, integrity checks): the
number of steps between two runs that keeps the work's cost within a share of training time.

One code path serves every kind of such work; a ``Budget`` says what differs: the share, the cap,
how the costs are summarised, and how the setting is written. This module imports nothing of
``hf_lowzero``, so that any layer can use it.

Example::

    >>> checks = Budget(setting="verify_every", work="the checks", overhead=0.01, max_interval=1000,
    ...                 off=("off",), off_text="'off'", step_time=Median, cost=Median)
    >>> schedule = AutoInterval("auto", checks)
    >>> schedule.add_step(0.100)    # a step took 100 ms, the work excluded
    >>> schedule.add_cost(0.0042)   # one run of the work cost 4.2 ms
    >>> schedule.proposed_interval()            # ceil(0.0042 / (1% of 0.100))
    5
    >>> schedule.taken(10, schedule.agreed([5, 7]))   # every rank takes the largest proposal
    >>> [step for step in range(11, 19) if schedule.due(step)]
    [17, 18]

# [Note: the auto interval's budget]
# Work that costs c seconds each time it runs, every n steps of s seconds each, takes c / (n s) of
# training time. Within a share f of it: n = ceil(c / (f s)), at least 1 and at most the budget's
# cap (work that must not wait longer, however much it costs). c and s are the caller's
# measurements, summarised as its budget says: the median of the last few (one slow snapshot does
# not stretch the interval) or a moving average of the step time. Before both are known the
# interval stays what it was. Ranks measure different costs; they take the largest proposal
# (``agreed``), so that every rank runs the work at the same steps, and since the clamp to [1, cap]
# is monotone it does not matter whether a rank clamps before or after that maximum.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

AUTO = "auto"


class Estimate(Protocol):
    """A running summary of measured seconds: ``add`` one, read ``value`` (None before any)."""

    @property
    def value(self) -> float | None:
        """The summary so far; None before any measurement."""

    def add(self, seconds: float) -> None:
        """One more measurement."""


class Median:
    """The median of the last ``window`` measurements (``window=1``: the latest alone); None before any."""

    def __init__(self, window: int = 1) -> None:
        self._kept: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        """One more measurement; the oldest leaves the window."""
        self._kept.append(seconds)

    @property
    def value(self) -> float | None:
        """The median of the window; None before any measurement."""
        return statistics.median(self._kept) if self._kept else None


class Smoothed:
    """An exponential moving average: each measurement weighs ``weight``, the first counts whole."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        """One more measurement, weighing ``weight`` against the average so far."""
        self.value = seconds if self.value is None else (1 - self.weight) * self.value + self.weight * seconds


@dataclass(frozen=True, kw_only=True)
class Budget:
    """One kind of periodic work: what its "auto" interval may spend, and how its setting is written.

    Example::

        Budget(setting="snapshot_every", work="snapshots", overhead=0.02, max_interval=10_000,
               off=(None, "off", "none"), off_text="None (no memory snapshots)",
               step_time=lambda: Median(50), cost=lambda: Median(20))
    """

    setting: str
    """The setting's name, as its errors say it: ``"snapshot_every"``."""
    work: str
    """What runs, as its errors say it: ``"snapshots"``."""
    overhead: float
    """The share of training time "auto" keeps the work within, in (0, 1]."""
    max_interval: int
    """"auto" runs the work at least every this many steps, whatever it costs (>= 1)."""
    off: tuple[str | None, ...]
    """The values that turn the work off: words (any case, blanks ignored), and None where it is accepted."""
    off_text: str
    """How the errors name those: ``"'off'"``."""
    step_time: Callable[[], Estimate]
    """Makes the summary of the step times (the work excluded): ``lambda: Median(50)``."""
    cost: Callable[[], Estimate]
    """Makes the summary of the work's costs: ``lambda: Median(20)``."""

    def __post_init__(self) -> None:
        if not 0 < self.overhead <= 1:
            raise ValueError(f"Budget.overhead={self.overhead!r} is invalid; expected a share of time in (0, 1]")
        if isinstance(self.max_interval, bool) or not isinstance(self.max_interval, int) or self.max_interval < 1:
            raise ValueError(f"Budget.max_interval={self.max_interval!r} is invalid; expected a number of steps >= 1")

    def check(self, every: object) -> int | str | None:
        """``every`` as given (an int, its digits, ``"auto"`` or a word of ``off``; strings in any case).

        Returns:
            The interval as an int, ``"auto"``, or None: the work is off.

        Raises:
            ValueError: ``every`` is none of those (naming ``setting`` and what it accepts).
        """
        word = every.strip().lower() if isinstance(every, str) else every
        if word in self.off:
            return None
        if word == AUTO:
            return AUTO
        if isinstance(word, str) and word.isdigit():
            every = int(word)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"{self.setting}={every!r} is invalid; expected a number of steps >= 1, 'auto' (the interval that "
                f"keeps {self.work} within {self.overhead:.0%} of training time) or {self.off_text}"
            )
        return every


class AutoInterval:
    """When periodic work is due: every ``every`` steps, or at the interval that keeps its measured
    cost within ``budget`` ([Note: the auto interval's budget]). See the module docstring.

    ``every`` is checked by ``budget.check``; off (None) leaves an interval of 1 that its caller
    does not run. ``interval`` is the steps between runs (the ranks' latest agreement, for
    "auto"); ``next_step`` the first step at which the work is due; ``cap`` the longest interval.
    """

    def __init__(self, every: object, budget: Budget) -> None:
        self.budget = budget
        self.every = budget.check(every)
        self.auto = self.every == AUTO
        self.interval = self.every if isinstance(self.every, int) else 1
        self.next_step = 1
        self.cap = budget.max_interval
        self._steps = budget.step_time()
        self._costs = budget.cost()

    def due(self, step: int) -> bool:
        """Whether the work runs at ``step``."""
        return step >= self.next_step

    def add_step(self, seconds: float) -> None:
        """A step's wall time, the work excluded."""
        self._steps.add(seconds)

    def add_cost(self, seconds: float) -> None:
        """What one run of the work cost."""
        self._costs.add(seconds)

    @property
    def step_s(self) -> float | None:
        """The step time, as the budget summarises it; None before any."""
        return self._steps.value

    @property
    def cost_s(self) -> float | None:
        """The work's cost, as the budget summarises it; None before any."""
        return self._costs.value

    def proposed_interval(self) -> int:
        """This rank's interval: the fixed one, or for "auto" ceil(cost / (overhead * step time)),
        within [1, cap] ([Note: the auto interval's budget]); the current one until both are known.
        """
        if not self.auto or self.cost_s is None or not self.step_s:
            return self.interval
        return max(1, min(self.cap, math.ceil(self.cost_s / (self.budget.overhead * self.step_s))))

    def agreed(self, proposals: Iterable[float]) -> int:
        """The interval every rank takes: the largest of the ranks' proposals, within [1, cap]."""
        return int(min(self.cap, max(1, max(proposals))))

    def taken(self, step: int, interval: int) -> None:
        """The work ran at ``step``; the next runs ``interval`` steps later."""
        self.interval = interval
        self.next_step = step + interval

    def overhead(self) -> float | None:
        """The share of training time the work is expected to take at the current interval."""
        if self.cost_s is None or not self.step_s:
            return None
        return self.cost_s / (self.interval * self.step_s)
