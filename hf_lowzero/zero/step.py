"""The decisions a step makes before the update: the global norm and which params were used,
the one unscale-and-clip factor, masking params used on no rank, and skipping a step.

Example::

    scaled_norm, used = global_norm_and_usage(reduced_chunks, sync.used, device, group)  # collective
    coef = unscale_clip_coef(scaled_norm / loss_scale, clip=1.0, loss_scale=loss_scale)
    scale_rows(reduced_chunks, coef)          # [Note: one multiply]
    mask = UnusedMask(inner_params, inner_grads)
    mask.apply(used)                          # masters of params used on no rank get grad=None
    count_skipped_step(counts, scaler, config)  # a step not taken: counted, loss scale backed off

# [Note: one multiply]
# Loss-scale unscaling and clipping are one factor, ``clip_coef / loss_scale``, applied once to
# each reduced gradient row, never twice and never to the params' own ``.grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hf_lowzero.zero import comm
from hf_lowzero.zero.config import ZeroConfig
from hf_lowzero.zero.loss_scaler import ConstantScale, DynamicLossScaler
from hf_lowzero.zero.norm import squared_norm


@dataclass
class SkipCounts:
    """Steps skipped because gradients were not finite: in all, and in a row up to now."""

    skipped: int = 0
    consecutive: int = 0


def global_norm_and_usage(
    reduced: list[torch.Tensor | None], used: torch.Tensor, device: torch.device, group
) -> tuple[float, torch.Tensor]:
    """One all-reduce: the global L2 norm of the (scaled) averaged gradients, and which params got
    a gradient on any rank (bool per slot; DDP's unused-parameter detection). ``used`` is this
    rank's flags. Padding rows are zero, so the norm equals ``clip_grad_norm_`` over the full
    gradients; any inf/nan makes it non-finite. Collective."""
    # Computed where the rows live (host memory with offload), reduced on the params' device;
    # fp32 block norms summed in float64 ([Note: blocked norm]).
    square_sum = squared_norm([chunk for chunk in reduced if chunk is not None]).reshape(1)
    stats = torch.cat([square_sum.to(device), used.to(torch.float64).to(device)])
    comm.all_reduce(stats, group)
    stats = stats.cpu()
    return math.sqrt(stats[0].item()), stats[1:] > 0


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

    The masters' ``.grad`` are fixed views of the gradient store, set once; ``apply`` writes only
    the changes since the previous step, so a step whose params were all used costs one scan.
    """

    def __init__(self, held: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
        self.held, self.grads = held, grads  # per slot: the inner optimizer's tensor and its gradient
        self.masked: set[int] = set()  # slots whose master.grad is None for the coming step

    def apply(self, used: torch.Tensor) -> None:
        """``used``: one bool per slot (``global_norm_and_usage``)."""
        unused = {i for i in (~used).nonzero().flatten().tolist() if self.held[i] is not None}
        for index in self.masked - unused:
            self.held[index].grad = self.grads[index]
        for index in unused - self.masked:
            self.held[index].grad = None
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
