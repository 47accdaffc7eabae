"""Elastic Ray runs: the worker range, the batch math of one attempt, the world size in the loss log.

With ``num_workers=(min, max)`` Ray Train starts the worker group at the size the cluster can hold
(at least ``min``), restarts it smaller when a worker's node goes away and larger when capacity
returns. Every restart is a new *attempt* of the training function: it resumes the latest
registered checkpoint, resharded to the new world size (``hf_lowzero.checkpoint``).

Example::

    >>> parse_num_workers("1-4")
    (1, 4)
    >>> parse_num_workers("2")
    2
    >>> accumulation_for_global_batch(16, per_device=4, world_size=2)
    2

# [Note: global batch across resizes]
The Trainer's global batch is per_device_train_batch_size * gradient_accumulation_steps *
world_size, so a resize changes it, and the same ``max_steps`` then covers a different amount of
data (fewer workers: smaller steps, fewer samples in all). With ``global_batch_size`` set, every
attempt derives gradient_accumulation_steps = global / (per_device * world) instead, so every
optimizer step sees the same samples at any world size: the sampler shuffles once (seeded, the
same order at any world size), then rank ``r`` takes micro-batches ``r, r + world, ...`` of that
order, so step ``s`` consumes micro-batches ``s * n`` to ``(s + 1) * n - 1`` with ``n = global /
per_device`` whatever the world size, and resuming at step ``s`` skips exactly those before it.
``tests/test_ray_elastic.py`` checks a 2 -> 1 -> 2 run's losses against a fixed 2-worker run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch.distributed as dist
from transformers import TrainerCallback

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


def parse_num_workers(value: int | str | Sequence[int]) -> int | tuple[int, int]:
    """``4``/``"4"`` -> 4 (a fixed size); ``(1, 4)``/``"1-4"`` -> (1, 4) (elastic, min to max).

    Args:
        value: A worker count (an int or its digits), or a range as ``(MIN, MAX)`` or ``"MIN-MAX"``.

    Returns:
        The count, or ``(MIN, MAX)``; a range with MIN equal to MAX becomes that count.

    Raises:
        ValueError: ``value`` is not a count >= 1 or a range with ``1 <= MIN <= MAX``.
    """
    if isinstance(value, str):
        match = _RANGE.match(value)
        if match:
            value = (int(match.group(1)), int(match.group(2)))
        elif value.strip().isdigit():
            value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"num_workers={value} is invalid; expected at least 1")
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is int for v in value):
        low, high = value
        if not 1 <= low <= high:
            raise ValueError(f"num_workers={low}-{high} is invalid; expected MIN-MAX with 1 <= MIN <= MAX, e.g. 1-4")
        return (low, high) if low < high else low
    raise ValueError(
        f"num_workers={value!r} is invalid; expected a worker count (e.g. 4) or an elastic range "
        "MIN-MAX (e.g. '1-4' on the command line, (1, 4) in Python)"
    )


def worker_range(num_workers: int | tuple[int, int]) -> range:
    """Every world size a run with ``num_workers`` (as returned by :func:`parse_num_workers`) may have.

    >>> list(worker_range((1, 3))), list(worker_range(2))
    ([1, 2, 3], [2])

    Args:
        num_workers: A worker count, or ``(MIN, MAX)``.

    Returns:
        The world sizes from MIN to MAX, both included.
    """
    low, high = (num_workers, num_workers) if isinstance(num_workers, int) else num_workers
    return range(low, high + 1)


def accumulation_for_global_batch(global_batch_size: int, per_device: int, world_size: int) -> int:
    """Micro-batches per optimizer step that keep ``global_batch_size`` sequences per step at
    ``world_size`` (see [Note: global batch across resizes]).

    Args:
        global_batch_size: Sequences per optimizer step on all workers together.
        per_device: Sequences per worker per micro-batch (``per_device_train_batch_size``).
        world_size: The number of workers.

    Returns:
        ``global_batch_size // (per_device * world_size)``, the ``gradient_accumulation_steps`` to train with.

    Raises:
        ValueError: ``global_batch_size`` is not a positive multiple of ``per_device * world_size``.
    """
    per_micro_step = per_device * world_size
    if global_batch_size < 1 or global_batch_size % per_micro_step:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not a positive multiple of per_device_train_batch_size "
            f"* world size = {per_device} * {world_size} = {per_micro_step}; pick a global batch divisible by "
            "per_device_train_batch_size times every worker count the run may have, or a smaller "
            "per_device_train_batch_size"
        )
    return global_batch_size // per_micro_step


class RecordWorldSize(TrainerCallback):
    """Adds ``world_size`` to every entry of the Trainer's ``log_history``, which checkpoints carry
    across attempts: the loss curve of an elastic run says at which size each step ran.

    Example::

        trainer = LowZeroTrainer(model=model, args=args, train_dataset=data, callbacks=[RecordWorldSize()])
        trainer.train()
        trainer.state.log_history[0]   # {"loss": 5.56, ..., "step": 1, "world_size": 2}
    """

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add this attempt's world size to the log entry the Trainer just appended."""
        state.log_history[-1]["world_size"] = dist.get_world_size()  # the entry Trainer.log just appended
