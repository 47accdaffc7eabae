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
# by simulating the recommended setup at that batch.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.request import RESERVE, PlanRequest
from hf_lowzero.plan.request import parse_bytes as parse_bytes  # re-exported: callers import it from here
from hf_lowzero.plan.simulate import PARTS, Setup, StepMemory, TrainingSpec, simulate_step
from hf_lowzero.simulation.launch import FakeCudaUnavailable, call_on_fake_gpus, fake_cuda_here

logger = logging.getLogger(__name__)

SETUPS = (Setup(0), Setup(1), Setup(1, True), Setup(2), Setup(2, True))
SIMULATED_ON = {"cuda": "fake CUDA devices (the GPU code paths)", "cpu": "fake CPU tensors"}  # MemoryPlan.simulated_on


def format_bytes(nbytes: float) -> str:
    """A byte count for people: in the largest binary unit it reaches, with two decimals.

    Example::

        >>> format_bytes(85899345920), format_bytes(512)
        ('80.00 GiB', '512 B')

    Args:
        nbytes: The number of bytes (may be negative: a shortfall).

    Returns:
        The size in TiB, GiB, MiB or KiB, or in whole bytes below 1 KiB.
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass
class PlanRow:
    """One setup's memory on the busiest rank (see the module docstring). Bytes throughout.

    Args:
        stage: The ZeRO stage (0: DDP).
        offload: Whether the optimizer is offloaded to host memory.
        label: The setup's name in the table, such as ``"stage 2 + offload"``.
        partition: How ZeRO owns optimizer state for this optimizer: ``"rows"``, ``"params"``, ``"-"`` for DDP.
        peak_bytes: The simulated peak of device memory in one step.
        host_bytes: The host memory one rank holds (with offload).
        breakdown: The peak split into model states and residual states, by part (``simulate.PARTS``).
        model_state_bytes: The ZeRO paper's model states at the peak.
        sent_bytes_per_step: The bytes one rank sends in one optimizer step.
        fits: Whether the peak fits the usable device memory (and, if checked, the host memory).
        headroom_bytes: Usable device memory minus the peak (negative: the shortfall).
        max_batch_size: The largest per-device batch whose peak fits; 0: not even one sample.
    """

    stage: int
    offload: bool
    label: str
    partition: str  # how ZeRO owns optimizer state for this optimizer: "rows", "params", "-" for DDP
    peak_bytes: int
    host_bytes: int
    breakdown: dict[str, int]
    model_state_bytes: int
    sent_bytes_per_step: int
    fits: bool
    headroom_bytes: int
    max_batch_size: int  # largest per-device batch whose peak fits; 0: not even one sample


@dataclass
class MemoryPlan:
    """A plan: ``rows`` (one ``PlanRow`` per setup), ``recommended`` (one of them, or None when
    nothing fits) and ``reason`` (why, or what would fit).

    Args:
        model: The model's name.
        total_params: The model's number of params.
        trainable_params: The number of them that are trained.
        world_size: The planned number of data-parallel ranks.
        device_memory: Bytes of memory per device.
        usable_memory: The part of ``device_memory`` a step's peak may take (less the reserve).
        host_memory: Host memory per node in bytes, or None (offload unchecked).
        ranks_per_node: The ranks that share a node's host memory.
        batch_size: The planned per-device batch.
        seq_len: Tokens per sample.
        training: What was planned for: optimizer, dtype, accumulation, gradient checkpointing, master dtype.
        rows: One row per setup.
        recommended: The recommended row, or None when nothing fits.
        reason: Why that row, or what would fit.
        checked_batch: The setup and batch the largest batch was checked at by a simulation of its own.
        simulated_on: ``"cuda"`` (fake GPUs, the GPU code paths) or ``"cpu"`` (fake CPU tensors).
    """

    model: str
    total_params: int
    trainable_params: int
    world_size: int
    device_memory: int
    usable_memory: int
    host_memory: int | None
    ranks_per_node: int
    batch_size: int
    seq_len: int
    training: dict[str, Any]
    rows: list[PlanRow]
    recommended: PlanRow | None
    reason: str
    checked_batch: dict[str, int] = field(default_factory=dict)
    simulated_on: str = "cpu"  # "cuda": fake GPUs, the GPU code paths ([Note: planning on fake GPUs])

    def row(self, stage: int, offload: bool = False) -> PlanRow:
        """The row of one setup.

        Args:
            stage: The ZeRO stage (0: DDP).
            offload: Whether with optimizer offload (stages 1 and 2 only).

        Returns:
            The setup's row.

        Raises:
            StopIteration: The plan has no such setup (stage 0 with offload).
        """
        return next(r for r in self.rows if r.stage == stage and r.offload == offload)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain dicts and lists (rows included), for JSON.

        Returns:
            The plan's fields by name.
        """
        return asdict(self)

    def to_text(self) -> str:
        """The plan as a table and the recommendation, for a console (see :func:`render`).

        Returns:
            The text, lines separated by newlines.
        """
        return render(self)


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

    def simulate(setup: Setup, batch_size: int, rank: int = 0) -> StepMemory:
        options = dict(rank=rank, ref_model=request.ref_model, backend=request.backend)
        return simulate_step(spec, training, setup, request.world_size, batch_size, seq_len, **options)

    steps: dict[Setup, StepMemory] = {}
    for setup in sorted(SETUPS, key=lambda s: -s.stage):  # stage 2 first: stage 1 may take its figures
        if setup.stage == 1 and training.gradient_accumulation_steps == 1:
            # Stage 1 differs from stage 2 only between micro-batches (full gradients under no_sync):
            # with one micro-batch per step they run the same code, so the same memory.
            steps[setup] = steps.get(Setup(2, setup.offload)) or _busiest_rank(simulate, setup, batch)
        else:
            steps[setup] = _busiest_rank(simulate, setup, batch)
    slopes = {
        zero: max(1, simulate(Setup(2 if zero else 0), batch + 1).peak - steps[Setup(2 if zero else 0)].peak)
        for zero in (False, True)
    }
    host_per_rank = request.host_memory // request.ranks_per_node if request.host_memory is not None else None
    rows = [_row(setup, steps[setup], usable, host_per_rank, batch, slopes[setup.stage > 0]) for setup in SETUPS]
    counts = _param_counts(spec)
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
    )
    _recommend(plan)
    if plan.recommended is not None and plan.recommended.max_batch_size != batch:
        # [Note: largest batch]: check the extrapolated batch with a simulation of its own
        best = plan.recommended
        setup = Setup(best.stage, best.offload)
        while best.max_batch_size > 0 and simulate(setup, best.max_batch_size).peak > usable:
            best.max_batch_size -= 1
        plan.checked_batch = {"setup": best.label, "batch_size": best.max_batch_size}
        _recommend(plan)  # the reason names the checked batch
    return plan


def _busiest_rank(simulate, setup: Setup, batch: int) -> StepMemory:
    """The rank holding the most: rank 0 with row shards (every rank holds the same, up to padding);
    with whole-param ownership the rank that owns the most elements (its state and masters).
    """
    step = simulate(setup, batch)
    if not step.owned_numel:
        return step
    busiest = max(range(len(step.owned_numel)), key=lambda r: step.owned_numel[r])
    return step if busiest == step.rank else simulate(setup, batch, busiest)


def _row(setup: Setup, step: StepMemory, usable: int, host: int | None, batch: int, slope: int) -> PlanRow:
    """``host``: the host memory one rank may use (its share of the node's), or None (unchecked)."""
    fits_host = host is None or step.host <= host
    room = usable - step.peak
    max_batch = max(0, batch + math.floor(room / slope)) if fits_host else 0
    return PlanRow(
        stage=setup.stage,
        offload=setup.offload,
        label=setup.label,
        partition=step.partition,
        peak_bytes=step.peak,
        host_bytes=step.host,
        breakdown=dict(step.breakdown),
        model_state_bytes=step.model_states,
        sent_bytes_per_step=step.sent_bytes,
        fits=room >= 0 and fits_host,
        headroom_bytes=room,
        max_batch_size=max_batch,
    )


def _recommend(plan: MemoryPlan) -> None:
    fitting = [r for r in plan.rows if r.fits]
    if fitting:
        best = min(fitting, key=lambda r: (r.offload, r.sent_bytes_per_step, r.peak_bytes, r.stage))
        plan.recommended = best
        others = [r for r in fitting if r is not best]
        why = [f"{best.label} fits with {format_bytes(best.headroom_bytes)} to spare"]
        if best.offload:
            why.append("no setup fits without optimizer offload")
        if others:
            cheaper = [
                r for r in others if (r.offload, r.sent_bytes_per_step) == (best.offload, best.sent_bytes_per_step)
            ]
            if cheaper:
                names = ", ".join(r.label for r in cheaper)
                why.append(f"it sends as few bytes per step as {names} and holds no more")
            else:
                why.append("it sends the fewest bytes per step of the setups that fit")
        why.append(f"per-device batch up to {best.max_batch_size}")
        plan.reason = "; ".join(why)
        return
    plan.recommended = None
    batches = [r for r in plan.rows if r.max_batch_size >= 1]
    if batches:
        best = max(batches, key=lambda r: (r.max_batch_size, not r.offload))
        plan.reason = (
            f"nothing fits at per_device_train_batch_size={plan.batch_size}: the largest batch that fits is "
            f"{best.max_batch_size} with {best.label} (use gradient_accumulation_steps to keep the global batch)"
        )
        return
    least = min(plan.rows, key=lambda r: r.peak_bytes)
    weights = min(r.breakdown["params"] + r.breakdown["frozen"] for r in plan.rows)
    if weights > plan.usable_memory:
        fix = (
            f"the model's weights alone take {format_bytes(weights)} per device, and ZeRO stages 1 and 2 keep every "
            "weight on every device: this needs the weights sharded too (ZeRO-3, FSDP), a quantized base with a "
            "LoRA adapter, or devices with more memory"
        )
    else:
        fix = (
            "use more devices (stages 1 and 2 shard masters and optimizer state over them), gradient checkpointing, "
            "a LoRA adapter, bf16 masters (zero_config master_dtype), or devices with more memory"
        )
    plan.reason = (
        f"nothing fits even at one sample per device: the smallest peak is {format_bytes(least.peak_bytes)} "
        f"({least.label}) against {format_bytes(plan.usable_memory)} usable; {fix}"
    )


def _param_counts(spec: ModelSpec) -> tuple[int, int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
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


def _count(n: int) -> str:
    for suffix, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:,.1f}{suffix}"
    return str(n)


def render(plan: MemoryPlan) -> str:
    """The plan as a table and the recommendation, for a console.

    Args:
        plan: The plan.

    Returns:
        The text, lines separated by newlines.
    """
    lines = [
        headline(plan),
        f"World size {plan.world_size}, {format_bytes(plan.device_memory)} per device; fits = peak <= "
        f"{format_bytes(plan.usable_memory)} ({1 - plan.usable_memory / plan.device_memory:.0%} kept for the CUDA "
        f"context and fragmentation); simulated on {SIMULATED_ON[plan.simulated_on]}",
        "",
    ]
    header = ["setup", "peak/device", *PARTS, "host/rank", "sent/step", "fits", "headroom", "max batch"]
    table = [header]
    for r in plan.rows:
        table.append(
            [
                r.label + (f" [{r.partition}]" if r.partition == "params" else ""),
                format_bytes(r.peak_bytes),
                *(format_bytes(r.breakdown[p]) for p in PARTS),
                format_bytes(r.host_bytes) if r.offload else "-",
                format_bytes(r.sent_bytes_per_step),
                "yes" if r.fits else "no",
                format_bytes(r.headroom_bytes),
                str(r.max_batch_size),
            ]
        )
    lines += format_table(table)
    lines.append("")
    choice = plan.recommended
    lines.append(
        f"Recommended: {choice.label} ({plan.reason})" if choice is not None else f"Nothing fits: {plan.reason}"
    )
    return "\n".join(lines)


def headline(plan: MemoryPlan) -> str:
    """The plan's first line: the model and the training it plans for."""
    t = plan.training
    return (
        f"Memory plan: {plan.model}, {_count(plan.total_params)} params ({_count(plan.trainable_params)} "
        f"trainable); {t['optimizer']} ({t['optim']}), {t['dtype']}, per-device batch {plan.batch_size} x "
        f"{plan.seq_len} tokens, gradient accumulation {t['gradient_accumulation_steps']}, gradient checkpointing "
        f"{'on' if t['gradient_checkpointing'] else 'off'}"
    )


def format_table(table: list[list[str]]) -> list[str]:
    """A header and rows of cells as aligned lines: the first column to the left, the others to the right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in table]
