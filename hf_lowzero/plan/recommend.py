"""Each setup against the device: its row (fits, headroom, the largest batch, its time) and the
plan's recommendation, the fastest setup that fits, with the reason.

Example::

    rows = [plan_row(setup, steps[setup], usable, host_per_rank, batch, slope, timing) for setup in SETUPS]
    recommend(plan)                           # plan.recommended, plan.reason
"""

from __future__ import annotations

import math

from hf_lowzero.plan.report import MemoryPlan, PlanRow, format_bytes
from hf_lowzero.plan.step_records import Setup, StepMemory
from hf_lowzero.plan.timed import StepTiming


def plan_row(
    setup: Setup, step: StepMemory, usable: int, host: int | None, batch: int, slope: int, timing: StepTiming
) -> PlanRow:
    """The row of ``setup`` from its simulated ``step``: whether it fits ``usable`` device memory and
    ``host`` (the host memory one rank may use, its share of the node's; None: unchecked), with what
    headroom, the largest batch ([Note: largest batch] in ``planner.py``: ``slope`` bytes per sample),
    and its time ([Note: the plan's time] in ``timed.py``).
    """
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
        **timing.columns(step, setup),
    )


def recommend(plan: MemoryPlan) -> None:
    """Set ``plan.recommended`` and ``plan.reason``: the fastest row that fits (then no offload
    when avoidable, the least communication, the lowest peak; without times, those alone) and why;
    when none fits, the largest batch that would, or why no batch can."""
    fitting = [r for r in plan.rows if r.fits]
    if fitting:
        best = min(fitting, key=_speed_then_cost)
        plan.recommended = best
        others = [r for r in fitting if r is not best]
        why = [f"{best.label} fits with {format_bytes(best.headroom_bytes)} to spare"]
        if best.step_time_s is not None:
            why.append(_fastest(best, others))
        if best.offload and not any(not r.offload for r in fitting):
            why.append("no setup fits without optimizer offload")
        if others and best.step_time_s is None:
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


def _speed_then_cost(row: PlanRow) -> tuple:
    # Steps within 1% of each other are as fast: the cheaper setup (no offload, fewer bytes) wins.
    bucket = round(math.log(row.step_time_s) / math.log(1.01)) if row.step_time_s else 0
    return (bucket, row.offload, row.sent_bytes_per_step, row.peak_bytes, row.stage)


def _fastest(best: PlanRow, others: list[PlanRow]) -> str:
    """Why ``best`` is the fastest of the setups that fit, in words."""
    own = f"{best.step_time_s * 1e3:.3g} ms per step, {best.tokens_per_s:,.0f} tokens/s per device"
    if not others:
        return f"the only setup that fits: {own}"
    runner_up = min(others, key=_speed_then_cost)
    if runner_up.step_time_s <= best.step_time_s * 1.01:
        return f"{own}, as fast as {runner_up.label} (within 1%), and first by offload, bytes sent, peak and stage"
    return f"the fastest that fits: {own}, against {runner_up.step_time_s * 1e3:.3g} ms for {runner_up.label}"
