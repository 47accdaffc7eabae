"""``ExactStepStats``: the step's decision with exact reduction ([Note: exact reduction] in ``__init__.py``).

``StepStats.decide``'s contract (the norm, the used flags, the stale reads, whatever rides along),
reached in two all-reduces instead of one:

1. MAX of: per parameter the largest |contribution| this step (the overflow test, the next grid) and
   the largest |exact sum| (the norm's grid), and each rank's number of contributions (their sum is
   the divisor of the mean). One host sync; every rank now decides alike whether the step overflowed.
2. Unless it did: the int64 sums become fp32 gradient rows, once; per parameter the sum of the rounded
   squares of their float64 values (exact, ``grid.square_exponents``) goes into a SUM with the stale
   reads and the used flags.
   The second host sync brings that back; the norm is their exactly rounded sum, in parameter order.

Example::

    stats = ExactStepStats(reducer, slots, shard=shard)
    verdict = stats.decide(reduced_chunks, sync.used, stale_reads=0)   # rows converted in place
"""

from __future__ import annotations

import logging
import math

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_lowzero.zero.exact.fixed_point import convert, int_max_abs
from hf_lowzero.zero.exact.grid import square_exponents
from hf_lowzero.zero.exact.reducer import ExactReducer
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.ranges import profiler_range
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.step import StepVerdict

logger = logging.getLogger(__name__)


class ExactStepStats:
    """The step's decision for ``reducer``'s exact sums; a drop-in for ``StepStats``."""

    def __init__(self, reducer: ExactReducer, slots: list[ParamSlot], *, shard: ShardGroup) -> None:
        self.reducer, self.device, self.group = reducer, shard.device, shard.group
        self.names = [slot.name for slot in slots]
        self.numels = [slot.shard.numel for slot in slots]
        self.world_size, self.rank = shard.world_size, shard.rank
        # the step's flags (stale reads, used), page-locked on a GPU: sent without a host sync
        self.host = dev.host_buffer(1 + len(slots), torch.float64, shard.device)
        self.last_skip: str | None = None  # why the newest decision skipped the step

    def decide(
        self,
        reduced: list[torch.Tensor | None],
        used: torch.Tensor,
        stale_reads: int,
        extra=None,
        squares=None,
        summed=None,
    ) -> StepVerdict:
        """Collective: two all-reduces and two host syncs. ``reduced``: this rank's gradient chunks
        (the store's, written here); ``squares`` (the float norms offload takes before its copies) is
        not read, the exact norm comes from the integer sums; ``summed`` is always None (an exact
        reduction is never replicated); the rest as ``StepStats.decide``.
        """
        reducer, n = self.reducer, len(self.numels)
        held = [bucket for bucket in reducer.buckets if reducer.holds[bucket.index]]
        with profiler_range("hf_lowzero::exact_maxima"):
            maxima = torch.zeros(2 * n + self.world_size, dtype=torch.float64, device=self.device)
            maxima[:n] = reducer.max_abs
            for bucket in held:  # int64 maxima: float64 rounds them as it rounds each sum, monotonically
                int_max_abs(reducer.owned[bucket.index], reducer.accumulator(bucket), maxima[n : 2 * n])
            maxima[2 * n + self.rank] = reducer.contributions
            comm.all_reduce(maxima, self.group, op="max")
            top = maxima.cpu().tolist()
        contribution_max, sum_max = top[:n], top[n : 2 * n]
        count = int(sum(top[2 * n :]))
        grid = reducer.grid
        overflowed = grid.overflowed(contribution_max, count)
        reducer.next_grid = grid.advanced(contribution_max, count)  # taken on when the step is over
        squares = torch.zeros(n, dtype=torch.float64, device=self.device)
        square_exps = [0] * n
        if not overflowed:
            divisor = float(max(count, 1)) if reducer.average else 1.0
            factors = [2.0**-s / divisor for s in grid.exponents()]  # one multiply: deterministic, W-free
            with profiler_range("hf_lowzero::exact_convert"):
                square_exps = square_exponents(_converted(sum_max, factors), self.numels)
                for bucket in held:
                    self._convert(bucket, factors, square_exps, squares)
        self.host[0] = float(stale_reads)  # the last step's copy of it is done: its results were read
        self.host[1:].copy_(used)
        stats = torch.cat([squares, self.host.to(self.device, non_blocking=True)])
        comm.all_reduce(stats, self.group)
        back = (stats if extra is None else torch.cat([stats, extra.reshape(-1)])).cpu()
        self.last_skip = self._skip_text(overflowed, contribution_max) if overflowed else None
        if overflowed:
            norm = math.inf
        else:
            norm = math.sqrt(math.fsum(math.ldexp(s, -t) for s, t in zip(back[:n].tolist(), square_exps)))
        extra_back = None if extra is None else back[2 * n + 1 :]
        stale_reads = 0 if is_fake(back) else int(back[n].item())  # a simulation checks reads itself
        return StepVerdict(norm, back[n + 1 : 2 * n + 1] > 0, stale_reads, extra_back)

    def _convert(self, bucket: Bucket, factors: list[float], square_exps: list[int], squares: torch.Tensor) -> None:
        """``bucket``'s int64 sums -> its fp32 gradient rows, once; its params' rounded squares into ``squares``."""
        owned = self.reducer.owned[bucket.index]
        convert(
            owned,
            self.reducer.accumulator(bucket),
            [factors[i] for i in owned.slots],
            [2.0 ** square_exps[i] for i in owned.slots],  # powers of two: exact
            self.reducer.store.chunk(bucket),
            squares,
        )

    def _skip_text(self, overflowed: list[int], maxima: list[float]) -> str:
        nonfinite = [self.names[i] for i in overflowed if not math.isfinite(maxima[i])]
        if nonfinite:
            return f"non-finite gradients in {nonfinite[:3]} ({len(nonfinite)} parameters)"
        grid = self.reducer.grid
        names = [self.names[i] for i in overflowed]
        text = (
            f"exact reduction: gradients of {names[:3]} ({len(names)} parameters) exceed the fixed-point grid "
            f"(up to 2**{grid.count_bits} contributions of at most 2**{grid.bounds[overflowed[0]]} each); the step "
            "is skipped on every rank and the grid widened for the next"
        )
        if self.rank == 0:
            logger.warning("[hf_lowzero] %s", text)
        return text


def _converted(sum_max: list[float], factors: list[float]) -> list[float]:
    """The conversion of ``_convert`` (in float64) applied to each param's largest |sum|: its largest
    |value| (the conversion is monotone), with the same rounding."""
    return [m * f for m, f in zip(sum_max, factors)]
