"""A plan's check: the same step on real tensors, in ``world_size`` real processes (gloo on CPU).

Each rank runs ``simulate_step(..., fake=False)``: the model, optimizer, DDP or ZeRO and the
tracker of the plan, on real tensors and a real process group. The busiest rank's figures come
back. Tests and ``benchmarks/memory_plan.py`` compare them with the plan's.

Example::

    measured = measure_step(spec, training, Setup(stage=2), world_size=2, batch_size=4, seq_len=64)
    measured.peak, measured.model_states
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.simulate import Setup, StepMemory, TrainingSpec, simulate_step
from hf_lowzero.testing import run_distributed


def measure_step(
    spec: ModelSpec,
    training: TrainingSpec,
    setup: Setup,
    world_size: int,
    batch_size: int,
    seq_len: int,
    ref_model: bool = False,
) -> StepMemory:
    """One real step of ``setup`` on ``world_size`` local ranks; the rank with the highest peak."""
    with tempfile.TemporaryDirectory() as out:
        run_distributed(
            _measure_rank,
            world_size,
            spec=spec,
            training=training,
            setup=setup,
            batch_size=batch_size,
            seq_len=seq_len,
            ref_model=ref_model,
            out=out,
        )
        steps = []
        for rank in range(world_size):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                steps.append(StepMemory(**json.load(f)))
    return max(steps, key=lambda s: s.peak)


def _measure_rank(rank: int, world_size: int, spec, training, setup, batch_size, seq_len, ref_model, out) -> None:
    torch.manual_seed(0)
    step = simulate_step(spec, training, setup, world_size, batch_size, seq_len, fake=False, ref_model=ref_model)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dataclasses.asdict(step), f)
