"""The decisions a step makes before the update: the global norm and which params were used,
the one unscale-and-clip factor, masking params used on no rank, and skipping a step.

Example::

    stats = StepStats(len(slots), shard=shard)
    verdict = stats.decide(reduced_chunks, sync.used, stale_reads=0)   # collective, one host sync
    coef = unscale_clip_coef(verdict.scaled_norm / loss_scale, clip=1.0, loss_scale=loss_scale)
    scale_rows(reduced_chunks, coef)          # [Note: one multiply]
    mask = UnusedMask(inner_params, inner_grads)
    mask.apply(used)                          # inner params of params used on no rank get grad=None
    count_skipped_step(counts, scaler, config)  # a step not taken: counted, loss scale backed off

# [Note: one multiply]
# Loss-scale unscaling and clipping are one factor, ``clip_coef / loss_scale``, applied once to
# each reduced gradient row, never twice and never to the params' own ``.grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_lowzero.zero.grads.norm import blocked_squared_norm, float64_squared_norm
from hf_lowzero.zero.grads.replicated import ReplicatedTotals
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.loss_scaler import ConstantScale, DynamicLossScaler
from hf_lowzero.zero.zero_config import ZeroConfig


@dataclass
class SkipCounts:
    """Steps skipped because gradients were not finite: in all, and in a row up to now."""

    skipped: int = 0
    consecutive: int = 0


# [Note: one host sync per step]
# The step must know three things before it updates: the global norm (clip factor, and whether any
# gradient is inf/nan: skip), which params got a gradient on any rank (masking), and whether any
# rank read a param before its all-gather landed ([Note: overlapped all-gather] in
# ``allgather.py``). They travel in one float64 vector: its host part (the flags, known on the
# host) goes to the device through a page-locked buffer without waiting, the squared norm is
# written on the device, one all-reduce sums it, and one copy brings it back: the step's only host
# sync (on a verify step the integrity table comes back in the same copy). Only when the total is
# not finite does the float64 norm decide ([Note: blocked norm] in ``grads/norm.py``): every rank sees the
# same total, so all take that rare second round together. Where the gradients' one all-reduce
# brought the vector back already ([Note: replicated reduction] in ``grads/replicated.py``), the
# copy is the step's only synchronization.


@dataclass(frozen=True)
class StepVerdict:
    """What the ranks decided together: the (scaled) global norm, the params used on any rank, the
    number of params some rank read before their gather landed, and whatever rode along."""

    scaled_norm: float
    used: torch.Tensor  # bool per slot, on the host
    stale_reads: int
    extra: torch.Tensor | None  # the ``extra`` tensor given to ``decide``, on the host


class StepStats:
    """The buffers of [Note: one host sync per step] for ``slots`` params on ``device``."""

    def __init__(self, slots: int, *, shard: ShardGroup) -> None:
        self.shard, self.slots = shard, slots
        # [squared norm, stale reads, used flags...]; written by the host, read by a non-blocking copy
        self.host = dev.host_buffer(2 + slots, torch.float64, shard.device)

    def decide(
        self,
        reduced: list[torch.Tensor | None],
        used: torch.Tensor,
        stale_reads: int,
        extra=None,
        squares=None,
        summed: ReplicatedTotals | None = None,
    ) -> StepVerdict:
        """Collective: one all-reduce and one host sync. ``reduced``: this rank's gradient chunks
        (on the device, or in host memory with offload); ``used``: this rank's flags (bool per
        slot, host); ``stale_reads``: this rank's count; ``extra``: a float64 device tensor to bring
        back in the same copy (the integrity table), or None; ``squares``: per chunk, its squared
        norm when already taken (``taken_square``: [Note: the norm before the copy]), or None;
        ``summed``: the totals of a replicated reduction (then no all-reduce: ``extra`` rides the copy alone)."""
        if summed is not None:
            back, extra_back = self._back(summed.stats(), extra)
            return self._verdict(back, extra_back, summed.rows, reduce=False)
        rows = [chunk for chunk in reduced if chunk is not None]
        squares = squares or [None] * len(reduced)
        held = [(chunk, square) for chunk, square in zip(reduced, squares) if chunk is not None]
        untaken = [chunk for chunk, square in held if square is None]
        parts = [blocked_squared_norm(untaken).reshape(1)]  # a host zero when ``untaken`` is empty
        parts += [square.reshape(1) for _, square in held if square is not None]
        zero = torch.zeros(1, dtype=torch.float64)  # 0 + x is x: the sums below are exactly those of the parts
        on_host = [zero] + [part for part in parts if not dev.is_cuda(part.device)]  # the CPU, or offloaded rows
        on_device = [part for part in parts if dev.is_cuda(part.device)]
        self.host[1] = stale_reads
        self.host[2:].copy_(used)
        self.host[:1].copy_(torch.cat(on_host).sum())  # a host value like the flags
        stats = self.host.to(self.shard.device, non_blocking=True)  # the same tensor on the CPU
        if on_device:
            stats[:1].add_(torch.cat(on_device).sum())
        comm.all_reduce(stats, self.shard.group)
        back, extra_back = self._back(stats, extra)
        return self._verdict(back, extra_back, lambda: rows, reduce=True)

    @staticmethod
    def _back(stats: torch.Tensor, extra) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``stats`` and ``extra`` (or None) on the host, in one copy."""
        if extra is None:
            return stats.cpu(), None
        both = torch.cat([stats, extra.reshape(-1)]).cpu()
        return both[: stats.numel()], both[stats.numel() :]

    def _verdict(self, back: torch.Tensor, extra_back, rows, reduce: bool) -> StepVerdict:
        """The verdict from the summed vector on the host; ``rows()``: the gradient rows whose float64
        norm decides when the blocked one is not finite (this rank's, summed over ranks where
        ``reduce``, or every rank's)."""
        total = back[0].item()
        if not math.isfinite(total):  # every rank sees the same total: all recompute together
            exact = float64_squared_norm(rows()).reshape(1).to(self.shard.device)
            if reduce:
                comm.all_reduce(exact, self.shard.group)
            total = exact.item()
        stale_reads = 0 if is_fake(back) else int(back[1].item())  # a simulation: no values (it checks reads itself)
        return StepVerdict(math.sqrt(total), back[2:] > 0, stale_reads, extra_back)


def unscale_clip_coef(grad_norm: float, clip: float, loss_scale: float) -> float:
    """The factor of [Note: one multiply]: clip to ``clip`` (0 = off) and undo the loss scale."""
    clip_coef = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
    return clip_coef / loss_scale


def scale_rows(reduced: list[torch.Tensor | None], coef: float) -> None:
    """Multiply every reduced gradient chunk by ``coef`` in place ([Note: one multiply])."""
    if coef != 1.0:
        for chunk in reduced:
            if chunk is not None:
                chunk.mul_(coef)


class UnusedMask:
    """Params used on no rank get no gradient: no update, no weight decay, no state.

    The inner params' ``.grad`` are fixed views of the gradient store, set once ([Note: inner
    params] in ``inner/adopt.py``); ``apply`` writes only the changes since the previous step, so a
    step whose params were all used costs one scan.
    """

    def __init__(self, inner_params: list[torch.Tensor | None], inner_grads: list[torch.Tensor | None]) -> None:
        self.inner_params, self.inner_grads = inner_params, inner_grads  # per slot
        self.masked: set[int] = set()  # slots whose inner param's .grad is None for the coming step

    def apply(self, used: torch.Tensor) -> None:
        """``used``: one bool per slot (``StepVerdict.used``)."""
        unused = {i for i in (~used).nonzero().flatten().tolist() if self.inner_params[i] is not None}
        for index in self.masked - unused:
            self.inner_params[index].grad = self.inner_grads[index]
        for index in unused - self.masked:
            self.inner_params[index].grad = None
        self.masked = unused


def count_skipped_step(
    counts: SkipCounts, scaler: DynamicLossScaler | ConstantScale, config: ZeroConfig, why: str | None = None
) -> None:
    """Count a skipped step and back the loss scale off; raise when training can make no progress.
    ``why``: where the non-finite gradients came from, when an integrity check named it."""
    was_at_min_scale = scaler.at_min_scale
    counts.skipped += 1
    counts.consecutive += 1
    scaler.update(overflow=True)
    error = _skip_error(config, counts.skipped, counts.consecutive, was_at_min_scale, scaler.scale)
    if error is not None:
        raise RuntimeError(f"{error} {why}") if why else error


def _skip_error(config: ZeroConfig, skipped: int, consecutive: int, was_at_min_scale: bool, scale: float):
    if was_at_min_scale:
        return RuntimeError(
            f"gradients are not finite even at the minimum loss scale ({config.min_scale}); "
            f"{skipped} steps skipped so far. The model itself produces inf/nan: lower "
            "the learning rate, enable clip_grad_norm, check the data, or train in bf16/fp32."
        )
    if consecutive >= config.max_consecutive_skips:
        return RuntimeError(
            f"{consecutive} consecutive steps were skipped because gradients were not "
            f"finite (loss scale now {scale}); training is making no progress. Lower "
            "the learning rate, enable clip_grad_norm, check the data for inf/nan, or raise "
            "ZeroConfig.max_consecutive_skips if this is expected."
        )
    return None
