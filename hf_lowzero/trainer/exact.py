"""The Trainer's side of ``zero_reduction="exact"``: everything a step depends on, made independent of
the world size ([Note: exact reduction] in ``zero/exact/__init__.py`` makes the sums so).

# [Note: an exact Trainer step]
# With a fixed global batch (per-device batch x accumulation x world size), three things besides the sums
# would still change with the world size W; in exact mode each is made invariant:
# - Which samples make each micro-batch. accelerate deals the sampler's batches round-robin: batch g of
#   the epoch goes to rank g % W as its (g // W)-th, and each rank takes K = global / (per-device x W)
#   of its own per step, so step s holds exactly batches [s N, (s + 1) N) (N = K W, the global number
#   of micro-batches) at any W, given one sampler order for all W: "random" (seeded by data_seed or
#   seed) or "sequential". The samplers that group by length plan per rank and accumulation step, so
#   exact mode refuses them; so does an epoch that is not a whole number of global batches, whose last
#   step would hold other micro-batches at another W.
# - The loss normalization. Trainer divides each micro-batch's mean loss by K (or, where the model
#   normalizes by the step's token count, multiplies by W for DDP to divide again). Rounding by 1/K or
#   by W differs with W. Exact mode passes each micro-batch's own loss, and the optimizer divides the
#   exact sum by the number of micro-batches of the step (``ExactReducer.average``); with token-count
#   normalization, the loss over the global token count (gathered across ranks, an integer: the same
#   at any W), with no multiply, and the optimizer's sum is not divided. The loss the Trainer logs is
#   what it would have been.
# - The RNG (dropout). Before each micro-batch's forward the RNG is seeded from (seed, step, global
#   micro-batch index); this rank's j-th micro-batch of the step is global micro-batch j W + rank.
# Resuming with another per-device batch is refused (``check_resume``): other micro-batches, other sums.
# The kernels must sum alike too: the same per-device batch and, on CPU, the same number of threads per
# rank (accelerate sets cores / W unless OMP_NUM_THREADS is set: a warning says so); on GPUs,
# deterministic algorithms (``torch.use_deterministic_algorithms``).
# Randomness outside the step (a data collator's masking, augmentation in the dataset) is not covered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EXACT_SAMPLERS = ("random", "sequential")


def check_exact_arguments(args) -> None:
    """Refuse Trainer settings that ``zero_reduction="exact"`` cannot make world-size invariant.

    Args:
        args: The ``LowZeroTrainingArguments`` (or a ``with_zero`` twin's arguments).

    Raises:
        ValueError: ZeRO is off, the sampler groups by length, or token counts are not gathered across devices.
    """
    if args.zero_stage == 0:
        raise ValueError("zero_reduction='exact' needs zero_stage 1 or 2 (it is the ZeRO optimizer's reduction)")
    if args.train_sampling_strategy not in EXACT_SAMPLERS:
        raise ValueError(
            f"zero_reduction='exact' does not work with train_sampling_strategy={args.train_sampling_strategy!r}: "
            "it forms batches per rank and accumulation step, so other samples meet in a micro-batch at another "
            f"world size. Use one of {EXACT_SAMPLERS}."
        )
    if not args.average_tokens_across_devices:
        raise ValueError(
            "zero_reduction='exact' needs average_tokens_across_devices=True (the default): a loss normalized by "
            "this rank's own token count differs with the world size"
        )


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The RNG seed of global micro-batch ``index`` of optimizer step ``step``: a hash, so that nearby
    (step, index) pairs get unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ExactSteps:
    """Per micro-batch of a ``LowZeroTrainer`` with ``zero_reduction="exact"``: the RNG seeded, the
    loss normalization invariant ([Note: an exact Trainer step])."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self._step = None  # the optimizer step of the last micro-batch
        self._index = 0  # this rank's micro-batches so far in that step
        if trainer.args.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            logger.warning(
                "[hf_lowzero] zero_reduction='exact' on CPU without OMP_NUM_THREADS: accelerate gives each rank "
                "cores / world size threads, and kernels on another number of threads sum in another order, so "
                "runs at other world sizes will differ. Set OMP_NUM_THREADS to the same number in every run."
            )

    def training_step(self, run, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """``run`` (``Trainer.training_step``) on one micro-batch, made invariant; returns the loss the
        Trainer would have logged."""
        trainer, args = self.trainer, self.trainer.args
        step = trainer.state.global_step
        self._index = self._index + 1 if step == self._step else 0
        self._step = step
        self._check_epoch()
        torch.manual_seed(micro_batch_seed(args.seed, step, self._index * args.world_size + args.process_index))
        summed = _normalized_globally(trainer, num_items_in_batch)
        trainer.zero_optimizer.reducer.average = not summed
        if summed:  # the loss over the step's global token count: no multiply by W
            previous, args.average_tokens_across_devices = args.average_tokens_across_devices, False
            try:
                loss = run(model, inputs, num_items_in_batch)
            finally:
                args.average_tokens_across_devices = previous
            return loss * args.world_size
        previous, trainer.loss_is_scaled_for_ga = trainer.loss_is_scaled_for_ga, True  # no division by K
        try:
            loss = run(model, inputs, num_items_in_batch)
        finally:
            trainer.loss_is_scaled_for_ga = previous
        return loss / trainer.current_gradient_accumulation_steps

    def check_resume(self, checkpoint: str) -> None:
        """Refuse to resume ``checkpoint`` (a ``checkpoint-N`` directory) with another per-device batch.

        Raises:
            ValueError: The checkpoint's per-device batch differs from this run's (both named).
        """
        from transformers.trainer import TRAINER_STATE_NAME  # the Trainer's module: imported where it runs

        state_file = Path(checkpoint) / TRAINER_STATE_NAME
        saved = json.loads(state_file.read_text()).get("train_batch_size") if state_file.is_file() else None
        now = self.trainer.args.per_device_train_batch_size
        if saved is not None and saved != now:
            raise ValueError(
                f"zero_reduction='exact': {checkpoint} was trained with per_device_train_batch_size={saved}, this run "
                f"has {now}. A micro-batch of another shape sums in other kernels, so the resumed run would not "
                f"continue the saved one bit for bit. Resume with per_device_train_batch_size={saved} (and the "
                "gradient_accumulation_steps that keeps the global batch), or train with zero_reduction='ddp'."
            )

    def _check_epoch(self) -> None:
        trainer, args = self.trainer, self.trainer.args
        if self._index == 0 and trainer.current_gradient_accumulation_steps != args.gradient_accumulation_steps:
            raise ValueError(
                f"zero_reduction='exact': this step has {trainer.current_gradient_accumulation_steps} micro-batches "
                f"per rank, not gradient_accumulation_steps={args.gradient_accumulation_steps}: the epoch is not a "
                f"whole number of global batches of {args.per_device_train_batch_size} x "
                f"{args.gradient_accumulation_steps} x {args.world_size} samples, so its last step would hold other "
                "micro-batches at another world size. Trim the dataset to a multiple of the global batch."
            )


def _normalized_globally(trainer, num_items_in_batch) -> bool:
    """Whether this loss is normalized over the whole step already: by the step's token count (the
    model or ``compute_loss_func`` takes ``num_items_in_batch``), or as a subclass says
    (``loss_is_scaled_for_ga``). Otherwise it is the micro-batch's own mean, and the step averages.
    (Trainer also skips its division for a ``compute_loss_func`` without a token count; DDP then
    divides a sum over K micro-batches by W, which changes with W: exact mode takes the mean.)"""
    if trainer.loss_is_scaled_for_ga is not None:
        return trainer.loss_is_scaled_for_ga
    takes_count = trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None
    return num_items_in_batch is not None and takes_count
