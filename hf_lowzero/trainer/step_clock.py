"""The plan's step time against the run's: one line when training starts, one when it ends.

``PlannedStepTime`` is a ``TrainerCallback``. When training starts it logs, on the first rank, the
step time the plan predicted for the setup the run trains with. That plan is the one
``zero_stage="auto"`` made (``trainer.memory_plan``); without it the line says how to get one,
so the start costs nothing. Every step, on every rank, it times the optimizer step from
``on_step_begin`` to ``on_step_end``: every micro-batch's forward and backward, and the update.
``step_time_line`` is the end's line: the median of those times and its ratio to the prediction.

Example::

    clock = PlannedStepTime(getattr(trainer, "memory_plan", None))
    trainer.add_callback(clock)   # [hf_lowzero] plan: stage 2 on 2 x cpu predicts 41.2 ms per step ...
    trainer.train()
    print(step_time_line(clock.step_times_s, clock.predicted_s))
    # step time: measured median 45.3 ms over 40 steps; the plan predicted 41.2 ms: measured/predicted 1.10

# [Note: the device named]
# The start's line and the job's hint name the device the run trains on (``trained_on``): the plan
# may have timed another (``--device H100`` for a GPU its table lacks, or a plan made elsewhere), and
# then the line says both, so that the end's ratio is not read as the model's error on this device.

# [Note: the measured step]
# The time runs from the step's first micro-batch to the end of its update, as the plan's step
# does. The data loader's wait for the first batch, logging and checkpoints fall outside. Nothing
# is synchronized: on a GPU, work still queued when ``on_step_end`` runs (the all-gathers left in
# flight) is waited for in the next step, which is where the plan counts it too. The median keeps
# the first step's warm-up (the wait plan learned, the allocator growing) out of the figure.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence

import torch
from transformers import TrainerCallback

from hf_lowzero.plan.report import MemoryPlan, format_bytes, seconds_text
from hf_lowzero.timing.devices import table_name
from hf_lowzero.trainer.auto import host_share

logger = logging.getLogger(__name__)

HOW_TO_PLAN = (
    "zero_stage='auto' plans the run when it starts (about the time of a few steps of a small model), or "
    "`python -m hf_lowzero.plan --model MODEL --world-size N` with the run's flags predicts it beforehand"
)


class PlannedStepTime(TrainerCallback):
    """The plan's predicted step time at the start (one line, first rank) and each step's measured time.

    Args:
        plan: The run's plan (``trainer.memory_plan`` with ``zero_stage="auto"``), or None when none ran.
        how_to_plan: What the start's line says when no plan ran: how to get one.
    """

    def __init__(self, plan: MemoryPlan | None, how_to_plan: str = HOW_TO_PLAN) -> None:
        self.plan = plan
        self.how_to_plan = how_to_plan
        self.predicted_s: float | None = None
        self.step_times_s: list[float] = []
        self._started: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Find the plan's row for the run's setup and log the prediction (or how to get one)."""
        stage = args.zero_stage
        offload = bool(stage and getattr(args, "zero_offload_optimizer", False))
        label = "stage 0 (DDP)" if not stage else f"stage {stage}" + (" + offload" if offload else "")
        if self.plan is not None:
            row = self.plan.row(stage, offload)
            self.predicted_s = row.step_time_s
        if not state.is_world_process_zero:
            return
        if self.predicted_s is None:
            logger.info(f"[hf_lowzero] plan: no step time predicted for {label} (no plan ran): {self.how_to_plan}")
            return
        timed_for, used = self.plan.timed_for.get("device", "?"), trained_on(args)
        where = f"on {self.plan.world_size} x {used}"
        if timed_for != used:  # [Note: the device named]
            where = f"timed for {self.plan.world_size} x {timed_for}, though this run trains on {used},"
        logger.info(
            f"[hf_lowzero] plan: {label} {where} predicts {seconds_text(self.predicted_s)} per step "
            "(measured against it at the end)"
        )

    def on_step_begin(self, args, state, control, **kwargs):
        """Note when the step's first micro-batch starts ([Note: the measured step])."""
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        """Record the step's time, from its first micro-batch to the end of its update."""
        if self._started is not None:
            self.step_times_s.append(time.perf_counter() - self._started)
            self._started = None


def trained_on(args) -> str:
    """The device the run trains on, as the plan's ``--device`` names it ([Note: the device named]):
    ``cpu``, the device table's name of its GPU, or CUDA's name of a GPU the table lacks."""
    device = args.device
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return table_name(name) or name


def plan_device_flags(args) -> str:
    """The plan command's flags for the device the run trains on ([Note: the device named]).

    Example::

        plan_device_flags(trainer.args)   # "--device H200" on an H200; "--device cpu --device-memory 7.52 GiB"
    """
    used = trained_on(args)
    if used == "cpu":
        return f"--device cpu --device-memory {_size(host_share())}"
    if table_name(used) is None:  # the table lacks it: its memory, and the plan times for its default
        return f"--device-memory {_size(torch.cuda.get_device_properties(args.device).total_memory)}"
    return f"--device {used}"


def _size(nbytes: int) -> str:
    return format_bytes(nbytes).replace(" ", "")


def step_time_line(step_times_s: Sequence[float], predicted_s: float | None) -> str:
    """The run's measured median step time, and its ratio to the plan's prediction.

    Example::

        >>> step_time_line([0.05, 0.04, 0.06], 0.04)
        'measured median 50 ms over 3 steps; the plan predicted 40 ms: measured/predicted 1.25'

    Args:
        step_times_s: Each step's time, in seconds ([Note: the measured step]).
        predicted_s: The plan's step time for the run's setup; None when no plan ran.

    Returns:
        The line, without a newline.
    """
    if not step_times_s:
        return "no step was timed"
    median = statistics.median(step_times_s)
    measured = f"measured median {seconds_text(median)} over {len(step_times_s)} steps"
    if predicted_s is None:
        return f"{measured}; no plan predicted it (zero_stage='auto' plans the run)"
    return f"{measured}; the plan predicted {seconds_text(predicted_s)}: measured/predicted {median / predicted_s:.2f}"
