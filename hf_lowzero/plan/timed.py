"""Each setup's simulated step, timed: the time columns of the plan's rows.

[Note: the plan's time] The step a setup's memory comes from is also what its time comes from: the
simulation records its own sequence (``hf_lowzero.timing.record``) and ``hf_lowzero.timing`` prices
and schedules it for the plan's ``Target``. A row gets:

- ``step_time_s``: one optimizer step (every micro-batch's forward and backward, the update);
- ``tokens_per_s``: tokens one device trains per second (batch x sequence x micro-batches per step);
- ``mfu``: the step's matmul FLOPs (recomputation included) over the device's peak for the
  training dtype, per second;
- ``comm_hidden``: the share of the collectives' time overlapped with other work (None: none sent);
- ``host_s``: with offload, the host's own work in the step (its optimizer step, mostly).

Example::

    timing = StepTiming(Target.of("H100"), training, tokens=batch * seq_len)
    timing.columns(step, setup)   # {"step_time_s": ..., "tokens_per_s": ..., "mfu": ..., ...}
"""

from __future__ import annotations

from typing import Any

import torch

from hf_lowzero.plan.step_records import Setup, StepMemory, TrainingSpec
from hf_lowzero.timing.costs import Costs
from hf_lowzero.timing.devices import Target
from hf_lowzero.timing.schedule import schedule

TIME_COLUMNS = ("step_time_s", "tokens_per_s", "mfu", "comm_hidden", "host_s")


class StepTiming:
    """The time columns for ``target`` of steps of ``training`` with ``tokens`` per micro-batch."""

    def __init__(self, target: Target, training: TrainingSpec, tokens: int) -> None:
        self.target = target
        self.tokens = tokens * training.gradient_accumulation_steps
        sixteen = training.dtype in (torch.float16, torch.bfloat16)
        self.costs = Costs(target)
        self.autocast_costs = Costs(target, autocast=sixteen)  # [Note: autocast on fake GPUs] in timing/costs.py
        self.peak_flops = target.device.matmul_flops["bf16" if sixteen else "fp32"]

    def columns(self, step: StepMemory, setup: Setup) -> dict[str, Any]:
        """The row's time columns ([Note: the plan's time]); all None for a step not recorded (a real one)."""
        if step.program is None:
            return dict.fromkeys(TIME_COLUMNS)
        on_fake_gpu = step.device == "cuda" and setup.stage == 0
        time = schedule(step.program, self.autocast_costs if on_fake_gpu else self.costs).step_time()
        return {
            "step_time_s": time.seconds,
            "tokens_per_s": self.tokens / time.seconds,
            "mfu": time.flops / time.seconds / self.peak_flops,
            "comm_hidden": time.comm_hidden,
            "host_s": time.host_seconds,
        }
