"""``plan_memory``: which ZeRO setup fits these GPUs, with what batch, and why.

For each candidate setup (stage 0 = DDP, 1 and 2, the ZeRO stages with and without optimizer
offload) the plan simulates one step of the real code at the planned world size under fake
tensors (``simulate.py``) and reports the per-device peak, split into the ZeRO paper's model
states (params, gradients, fp32 masters, optimizer state, frozen params) and residual states
(activations and temporaries, communication buffers); host memory with offload; the bytes a rank
sends per step; whether it fits, with what headroom, and the largest per-device batch that fits
([Note: largest batch]). It recommends the cheapest setup that fits: no offload when avoidable,
then the least communication, then the lowest peak.

Example::

    plan = plan_memory("path/to/model", args, world_size=8, device_memory="80GiB", seq_len=2048)
    print(plan.to_text())
    plan.recommended.stage, plan.recommended.max_batch_size

# [Note: largest batch]
# A transformer's activations grow linearly with the batch (every op is per sample), so each row's
# peak is a + b * batch: a is simulated at the planned batch, the slope b from a second simulation
# at one sample more (once for the ZeRO stages, once for stage 0, whose fp32 params under autocast
# keep different activations). The largest batch is the largest whose peak fits. It is then checked
# by simulating the recommended setup at that batch. Where the line is wrong, the check searches:
# with gradient checkpointing a small batch's peak can be the update's, which no sample changes
# (Llama-3-8B at W=16: 49 KiB more for a second sample), so the line put the largest batch at
# 735,558, and stepping down one sample at a time took a simulation per sample. The search keeps a
# batch that fits and one that does not, and simulates where the line between their peaks crosses
# the usable memory. The peak is the largest of the step's moments, each linear in the batch: a
# convex function, which lies below that line, so the batch found fits and becomes the new lower
# end; once both ends lie on the last piece the line is exact. Its answer is stepping down's (the
# largest batch below the first guess that fits), in a few simulations (4 for Llama-3-8B); after
# 8 it halves the interval instead.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.recommend import plan_row, recommend

# PlanRow, format_bytes, render and parse_bytes are re-exported: callers import them from here.
from hf_lowzero.plan.report import MemoryPlan
from hf_lowzero.plan.report import PlanRow as PlanRow
from hf_lowzero.plan.report import format_bytes as format_bytes
from hf_lowzero.plan.report import render as render
from hf_lowzero.plan.request import RESERVE, PlanRequest
from hf_lowzero.plan.request import parse_bytes as parse_bytes
from hf_lowzero.plan.simulations import Simulations, plan_processes
from hf_lowzero.plan.step_records import Setup, StepMemory, TrainingSpec
from hf_lowzero.plan.timed import StepTiming
from hf_lowzero.simulation.launch import FakeCudaUnavailable, call_on_fake_gpus, fake_cuda_here
from hf_lowzero.timing.devices import Target

logger = logging.getLogger(__name__)

SETUPS = (Setup(0), Setup(1), Setup(1, True), Setup(2), Setup(2, True))


def plan_memory(
    model_or_config: Any,
    args: Any = None,
    *,
    world_size: int = 1,
    device_memory: int | str,
    seq_len: int | None = None,
    host_memory: int | str | None = None,
    ranks_per_node: int | None = None,
    lora_r: int | None = None,
    lora_targets: list[str] | None = None,
    ref_model: bool = False,
    reserve: float = RESERVE,
    backend: str | None = None,
    target: str | dict[str, Any] | None = None,
) -> MemoryPlan:
    """Plan the memory of training ``model_or_config`` with ``args`` on ``world_size`` devices of
    ``device_memory`` each (see the module docstring).

    ``args``: ``TrainingArguments`` (``LowZeroTrainingArguments`` for ZeRO knobs; None for the
    defaults); ``seq_len``: tokens per sample (default: the model's maximum positions, capped at
    2048); ``host_memory``: available per node, to check offload against, shared by
    ``ranks_per_node`` ranks (default: ``min(world_size, 8)``, an 8-GPU node); ``lora_r``: plan a LoRA adapter of
    this rank on the model (a PEFT model brings its own); ``ref_model``: a frozen reference copy
    (DPO, GRPO); ``reserve``: the fraction of device memory kept for the CUDA context and
    fragmentation; ``backend``: the collectives' backend of the planned run (``"nccl"`` on GPUs,
    ``"gloo"`` on CPU), whose code paths the simulation takes (default: ``"gloo"`` when ``args``
    say ``use_cpu``, else ``"nccl"``).

    ``zero_stage="auto"`` plans with this function and these defaults: the Trainer passes its world
    size, device memory, node RAM (``host_memory``, ``ranks_per_node``: ``LOCAL_WORLD_SIZE``) and
    the data's longest sequence, so this call with those inputs gives the Trainer's plan ([Note: one
    plan for the Trainer and the user] in ``request.py``).

    Args:
        model_or_config: What to train: a model directory or ``config.json`` path, a transformers
            ``PretrainedConfig`` or ``PreTrainedModel``, or a PEFT model. Only its config is used.
        args: The run's ``TrainingArguments`` (batch, accumulation, optimizer, dtype, ZeRO knobs); None
            for the defaults.
        world_size: The number of data-parallel ranks to plan for (>= 1).
        device_memory: Memory per device: bytes or a size such as ``"80GiB"``.
        seq_len: Tokens per sample; None: the model's maximum positions, capped at 2048.
        host_memory: Host memory available per node (bytes or a size), to check offload against; None
            leaves it unchecked.
        ranks_per_node: The ranks sharing a node's host memory; None: ``min(world_size, 8)``.
        lora_r: Plan a LoRA adapter of this rank on the model; None: none (a PEFT model brings its own).
        lora_targets: The module names the adapter targets; None: PEFT's defaults for the model.
        ref_model: Whether the run also holds a frozen reference copy of the model (DPO, GRPO).
        reserve: The fraction of device memory kept for the CUDA context and fragmentation, in [0, 1).
        backend: The planned run's collectives backend: ``"nccl"`` (GPUs) or ``"gloo"`` (CPU); None:
            ``"gloo"`` when ``args.use_cpu``, else ``"nccl"``.
        target: What each setup's step is timed for ([Note: the plan's time] in ``recommend.py``): a
            device's name (``"H100"``, ``"A100-80GB"``, ``"cpu"``, ... ``hf_lowzero.timing.DEVICES``) or
            a dict of ``hf_lowzero.timing.Target.of``'s keywords (``device``, ``gpus_per_node``,
            ``intra_node``, ``inter_node``, ``host_threads``); None: this machine's GPU when the table
            knows it, else H100, for GPUs, and ``"cpu"`` (this machine, measured) for gloo.

    Returns:
        The plan: a row per setup, the recommended one (or None) and the reason.

    Raises:
        ValueError: An argument is invalid (``world_size``, ``reserve``, a memory size,
            ``ranks_per_node``, ``seq_len``, ``backend``, ``lora_r``), or a config file is not a
            transformers config, or transformers has no model class for it.
        TypeError: ``model_or_config`` is of a kind that cannot be planned for.
        FileNotFoundError: A path given as ``model_or_config`` is neither a directory nor a file.
    """
    request = PlanRequest.of(
        args,
        world_size=world_size,
        device_memory=device_memory,
        seq_len=seq_len,
        host_memory=host_memory,
        ranks_per_node=ranks_per_node,
        ref_model=ref_model,
        reserve=reserve,
        backend=backend,
        target=target,
    )
    spec = ModelSpec.from_source(model_or_config, lora_r=lora_r, lora_targets=lora_targets)
    if request.backend == "nccl" and not fake_cuda_here():
        # [Note: planning on fake GPUs] in simulate.py: a fresh process with fake CUDA devices,
        # planned from the spec (a config, not the weights).
        try:
            return call_on_fake_gpus(plan_memory, spec, args, **asdict(request))
        except FakeCudaUnavailable as e:
            logger.warning("planning GPU setups on fake CPU tensors (the CPU's code paths): %s", e)
    if dist.is_available() and dist.is_initialized():
        # The simulation needs a process without a process group (it makes a fake one): plan in a
        # fresh one, from the spec.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(plan_memory, (spec, args), asdict(request))
    training = TrainingSpec.from_args(args if args is not None else _default_args())
    seq_len = request.seq_len or min(spec.max_seq_len() or 2048, 2048)
    usable = int(request.device_memory * (1 - request.reserve))
    batch = training.batch_size
    counts = _param_counts(spec)
    options = dict(ref_model=request.ref_model, backend=request.backend, processes=plan_processes(counts[0]))
    simulate = Simulations(spec, training, request.world_size, seq_len, **options)

    # Stage 1 differs from stage 2 only between micro-batches (full gradients under no_sync): with
    # one micro-batch per step they run the same code, so the same memory.
    same_as_stage_2 = training.gradient_accumulation_steps == 1
    simulated = [s for s in SETUPS if not (s.stage == 1 and same_as_stage_2)]
    jobs = [(s, batch) for s in simulated] + [(Setup(0), batch + 1), (Setup(2), batch + 1)]
    found = dict(zip(jobs, simulate.many(jobs)))  # [Note: two processes for a large model] in simulations.py
    steps = {s: _busiest_rank(simulate, s, batch, found[s, batch]) for s in simulated}
    steps |= {s: steps[Setup(2, s.offload)] for s in SETUPS if s not in steps}
    slopes = {}
    for zero, setup in ((False, Setup(0)), (True, Setup(2))):
        slopes[zero] = max(1, found[setup, batch + 1].peak - steps[setup].peak)
    host_per_rank = request.host_memory // request.ranks_per_node if request.host_memory is not None else None
    timing = StepTiming(Target.of(**request.target), training, batch * seq_len)
    rows = [
        plan_row(setup, steps[setup], usable, host_per_rank, batch, slopes[setup.stage > 0], timing) for setup in SETUPS
    ]
    plan = MemoryPlan(
        model=spec.name,
        total_params=counts[0],
        trainable_params=counts[1],
        world_size=request.world_size,
        device_memory=request.device_memory,
        usable_memory=usable,
        host_memory=request.host_memory,
        ranks_per_node=request.ranks_per_node,
        batch_size=batch,
        seq_len=seq_len,
        training=_describe(training),
        rows=rows,
        recommended=None,
        reason="",
        simulated_on=steps[Setup(2)].device,
        timed_for=timing.target.describe(),
    )
    recommend(plan)
    if plan.recommended is not None and plan.recommended.max_batch_size != batch:
        # [Note: largest batch]: check the extrapolated batch with a simulation of its own
        best = plan.recommended
        peak = simulate(Setup(best.stage, best.offload), best.max_batch_size).peak
        if peak > usable:
            fits, over = (batch, best.peak_bytes), (best.max_batch_size, peak)
            best.max_batch_size = _largest_batch(simulate, Setup(best.stage, best.offload), fits, over, usable)
        plan.checked_batch = {"setup": best.label, "batch_size": best.max_batch_size}
        recommend(plan)  # the reason names the checked batch
    return plan


def _largest_batch(simulate, setup: Setup, fits: tuple[int, int], over: tuple[int, int], usable: int) -> int:
    """The largest batch between ``fits`` and ``over`` ((batch, peak) each, the first within ``usable``,
    the second not) whose peak is within ``usable`` ([Note: largest batch]).

    Example::

        _largest_batch(simulate, Setup(2), (4, 70 * GIB), (40, 90 * GIB), 72 * GIB)   # 7, say
    """
    (low, low_peak), (high, high_peak) = fits, over
    for tried in itertools.count():
        if high - low <= 1:
            return low
        crossing = low + (usable - low_peak) * (high - low) // (high_peak - low_peak)
        guess = min(max(crossing, low + 1), high - 1) if tried < 8 else (low + high) // 2
        peak = simulate(setup, guess).peak
        if peak <= usable:
            low, low_peak = guess, peak
        else:
            high, high_peak = guess, peak


def _busiest_rank(simulate, setup: Setup, batch: int, step: StepMemory) -> StepMemory:
    """The rank holding the most, from rank 0's ``step``: rank 0 with row shards (every rank holds the
    same, up to padding); with whole-param ownership the rank that owns the most elements (its state
    and masters).
    """
    if not step.owned_numel:
        return step
    busiest = max(range(len(step.owned_numel)), key=lambda r: step.owned_numel[r])
    return step if busiest == step.rank else simulate(setup, batch, busiest)


def _param_counts(spec: ModelSpec) -> tuple[int, int]:
    import torch

    with torch.device("meta"):  # shapes alone: no storage, fake or real, is given to a model only counted
        model = spec.build(torch.float32)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _describe(training: TrainingSpec) -> dict[str, Any]:
    return {
        "optim": training.optim_name,
        "optimizer": training.optimizer_cls.__name__,
        "dtype": str(training.dtype).removeprefix("torch."),
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "gradient_checkpointing": training.gradient_checkpointing,
        "master_dtype": str(training.zero.get("master_dtype", "fp32")).removeprefix("torch."),
    }


def _default_args():
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=os.devnull, report_to=[], use_cpu=True)
