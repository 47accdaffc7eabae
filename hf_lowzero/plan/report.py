"""A memory plan as data (``MemoryPlan``, a ``PlanRow`` per setup) and as text (``render``).

Example::

    plan = plan_memory("path/to/model", args, world_size=8, device_memory="80GiB")
    print(plan.to_text())                     # render(plan): the table and the recommendation
    plan.row(2, offload=True).headroom_bytes, format_bytes(plan.usable_memory)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hf_lowzero.plan.cost import format_cost, format_tokens
from hf_lowzero.plan.step_records import PARTS


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


SIMULATED_ON = {"cuda": "fake CUDA devices (the GPU code paths)", "cpu": "fake CPU tensors"}  # MemoryPlan.simulated_on


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
        breakdown: The peak split into model states and residual states, by part (``step_records.PARTS``).
        model_state_bytes: The ZeRO paper's model states at the peak.
        sent_bytes_per_step: The bytes one rank sends in one optimizer step.
        fits: Whether the peak fits the usable device memory (and, if checked, the host memory).
        headroom_bytes: Usable device memory minus the peak (negative: the shortfall).
        max_batch_size: The largest per-device batch whose peak fits; 0: not even one sample.
        step_time_s: The predicted time of one optimizer step ([Note: the plan's time] in ``timed.py``).
        tokens_per_s: Tokens one device trains per second.
        mfu: Matmul FLOPs per second over the device's peak for the training dtype.
        comm_hidden: The share of the collectives' time overlapped with other work; None: none sent.
        host_s: The host's own work in one step (offload's optimizer step).
        cost: What training the plan's ``price`` asks for costs with this setup ([Note: the cost of tokens]
            in ``cost.py``); None without a price.
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
    step_time_s: float | None = None  # the time columns: None where the step was not timed (a real one)
    tokens_per_s: float | None = None
    mfu: float | None = None
    comm_hidden: float | None = None
    host_s: float | None = None
    cost: float | None = None  # with a price (cost.py's Price.apply)


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
        timed_for: The target the time columns are for (``Target.describe``).
        price: The price the rows' ``cost`` is for: ``per_device_hour`` and ``tokens``; None: no cost.
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
    timed_for: dict[str, Any] = field(default_factory=dict)  # the Target the times are for (Target.describe)
    price: dict[str, float] | None = None  # cost.py's Price.describe, set by Price.apply

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
        plain = asdict(self)
        if self.price is None:  # no price, no cost: the JSON of a plan without one is as it always was
            del plain["price"]
        for row in [*plain["rows"], plain["recommended"]]:
            if row is not None:
                row["setup"] = row["label"]
                if self.price is None:
                    del row["cost"]
        return plain

    def to_text(self) -> str:
        """The plan as a table and the recommendation, for a console (see :func:`render`).

        Returns:
            The text, lines separated by newlines.
        """
        return render(self)


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
    lines += time_table(plan)
    lines.append("")
    choice = plan.recommended
    lines.append(
        f"Recommended: {choice.label} ({plan.reason})" if choice is not None else f"Nothing fits: {plan.reason}"
    )
    return "\n".join(lines)


def time_table(plan: MemoryPlan) -> list[str]:
    """The rows' time columns as lines (a blank line, a title, the table); none when untimed."""
    if not plan.timed_for or all(r.step_time_s is None for r in plan.rows):
        return []
    t = plan.timed_for
    links = f"{t['intra_node_bytes_per_s'] / 1e9:.4g} GB/s in a node"
    if plan.world_size > t["gpus_per_node"]:
        links += f", {t['inter_node_bytes_per_s'] / 1e9:.4g} GB/s between nodes"
    title = (
        f"Time on {plan.world_size} x {t['device']} ({min(plan.world_size, t['gpus_per_node'])} per node, {links}; "
        f"{t['host_threads']} host thread(s) per rank): the simulated step, priced and scheduled (docs/plan.md)"
    )
    table = [["setup", "step time", "tokens/s/device", "MFU", "comm hidden", "host part"]]
    if plan.price is not None:
        table[0].append(cost_title(plan.price))
    for r in plan.rows:
        table.append(
            [
                r.label + (f" [{r.partition}]" if r.partition == "params" else ""),
                seconds_text(r.step_time_s),
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else "-",
                f"{r.mfu:.1%}" if r.mfu is not None else "-",
                f"{r.comm_hidden:.0%}" if r.comm_hidden is not None else "-",
                seconds_text(r.host_s) if r.offload and r.host_s is not None else "-",
                *([format_cost(r.cost)] if plan.price is not None else []),
            ]
        )
    return ["", title, "", *format_table(table)]


def cost_title(price: dict[str, float]) -> str:
    """The cost column's title: ``cost of 1B tokens at 2.5/device-hour``."""
    return f"cost of {format_tokens(price['tokens'])} tokens at {price['per_device_hour']:g}/device-hour"


def seconds_text(value: float | None) -> str:
    """A time for a table: ``50.3 ms``, ``1.2 s``; ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


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
