"""``plan_scaling``: the same training on several world sizes, one plan each, and how it scales.

[Note: the scaling table] Each world size gets the plan ``plan_memory`` makes for it (its steps
simulated at that size, timed for the same target), and the table takes each plan's recommended
setup. The per-device batch stays the one asked for, so the global batch grows with the world size
(weak scaling). A row's columns:

- ``nodes``: ``ceil(world_size / gpus_per_node)``; a collective whose group spans nodes runs over
  the network (``Target.bus_bandwidth``), so ``--inter-node`` shows in the larger sizes' times;
- ``step_time_s``, ``tokens_per_s`` (all devices) and ``tokens_per_s_per_device``: the plan's row;
- ``efficiency``: the tokens per second of all devices over the base size's, divided by the ratio
  of the world sizes: 1.0 is linear scaling. The base is the smallest size at which something fits
  (the smallest size given, unless nothing fits there). At a fixed per-device batch this equals the
  per-device tokens per second over the base's;
- ``cost``: with a price, training its tokens at that size ([Note: the cost of tokens] in ``cost.py``).

The command prints the table only, and says how to see one size's plan in full (each size's every
setup would bury the comparison asked for under a table per size); ``--json`` holds the largest
size's plan in full beside the table's rows.

What does not depend on the world size is done once: the model's config is read once and every
plan runs in one fake-GPU process ([Note: planning on fake GPUs] in ``simulate.py``).

Example::

    scaling = plan_scaling("path/to/model", args, world_sizes=[8, 16, 32], device_memory="80GiB",
                           target={"device": "H100", "gpus_per_node": 8}, price=Price.of(2.5))
    print(scaling.to_text())                  # the scaling table
    [(r.world_size, r.setup, r.efficiency) for r in scaling.rows]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hf_lowzero.plan.cost import Price, format_cost
from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.planner import plan_memory
from hf_lowzero.plan.report import MemoryPlan, cost_title, format_table, seconds_text
from hf_lowzero.plan.request import planned_backend

logger = logging.getLogger(__name__)


def parse_world_sizes(value: int | str | Sequence[int]) -> list[int]:
    """World sizes from ``8``, ``"8,16,32"`` or ``[8, 16, 32]``: each a whole number >= 1, none twice.

    Example::

        >>> parse_world_sizes("8, 16,32")
        [8, 16, 32]

    Args:
        value: One world size, a comma-separated list of them, or a sequence of them.

    Returns:
        The world sizes, in the order given.

    Raises:
        ValueError: A size is not a whole number of at least 1, or a size is given twice.
    """
    items = value.split(",") if isinstance(value, str) else [value] if isinstance(value, int) else list(value)
    sizes = []
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not text.isdigit() or int(text) < 1:
            raise ValueError(
                f"world_size={value!r} is invalid: {text!r} is not a world size; expected a whole number of ranks "
                "(>= 1), or several separated by commas such as 8,16,32"
            )
        sizes.append(int(text))
    repeated = sorted({s for s in sizes if sizes.count(s) > 1})
    if repeated:
        raise ValueError(f"world_size={value!r} is invalid: {repeated[0]} is given twice; give each world size once")
    return sizes


@dataclass
class ScalingRow:
    """One world size's line of the scaling table ([Note: the scaling table]); the time columns are
    None where nothing fits at that size.

    Args:
        world_size: The number of devices.
        nodes: The nodes they span (``gpus_per_node`` to a node).
        setup: The recommended setup's label, or None when nothing fits.
        stage: Its ZeRO stage (None: nothing fits).
        offload: Whether with optimizer offload (None: nothing fits).
        step_time_s: Its predicted step time.
        tokens_per_s: Tokens all devices train per second.
        tokens_per_s_per_device: Tokens one device trains per second.
        efficiency: Tokens per second over the base size's, divided by the ratio of the world sizes.
        cost: What training the price's tokens costs at this size; None without a price.
    """

    world_size: int
    nodes: int
    setup: str | None
    stage: int | None = None
    offload: bool | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float | None = None
    efficiency: float | None = None
    cost: float | None = None


@dataclass
class ScalingPlan:
    """The plans of several world sizes and their scaling table (``plan_scaling``).

    Args:
        plans: One plan per world size, in the order given.
        rows: The scaling table, one row per plan, in the same order.
        base_world_size: The size efficiency is measured against; None when nothing fits anywhere.
        price: The price the costs are for (``Price.describe``); None: no cost.
    """

    plans: list[MemoryPlan]
    rows: list[ScalingRow]
    base_world_size: int | None
    price: dict[str, float] | None = None

    @property
    def main(self) -> MemoryPlan:
        """The plan ``--json`` holds in full: the largest world size's."""
        return max(self.plans, key=lambda p: p.world_size)

    @property
    def fits_everywhere(self) -> bool:
        """Whether some setup fits at every world size."""
        return all(p.recommended is not None for p in self.plans)

    def to_dict(self) -> dict[str, Any]:
        """The largest world size's plan as ``MemoryPlan.to_dict`` gives it, with ``scaling``: the rows as dicts."""
        return self.main.to_dict() | {"scaling": [self._row_dict(r) for r in self.rows]}

    def _row_dict(self, row: ScalingRow) -> dict[str, Any]:
        plain = asdict(row)
        if self.price is None:
            del plain["cost"]
        return plain

    def to_text(self) -> str:
        """The scaling table, and where each size's plan is in full ([Note: the scaling table])."""
        sizes = ", ".join(str(p.world_size) for p in self.plans)
        full = (
            "Each size's plan in full (every setup's memory and time, the reason for its pick): the same command "
            f"with one --world-size ({sizes}); --json holds the largest size's plan in full."
        )
        return "\n".join([*self.table_lines(), "", full])

    def table_lines(self) -> list[str]:
        """The scaling table as lines: a title, a blank line, the table."""
        plan = self.main
        device = plan.timed_for.get("device", "the devices")
        t = plan.timed_for
        spread = f"{t['intra_node_bytes_per_s'] / 1e9:.4g} GB/s in a node"
        if any(r.nodes > 1 for r in self.rows):
            spread = (
                f"{t['gpus_per_node']} per node, {spread}, {t['inter_node_bytes_per_s'] / 1e9:.4g} GB/s between nodes"
            )
        else:
            spread = f"one node, {spread}"
        base = (
            f"efficiency: tokens/s against linear scaling from {self.base_world_size} device(s)"
            if self.base_world_size is not None
            else "nothing fits at any of these sizes"
        )
        title = (
            f"Scaling on {device} ({spread}): the recommended setup at each world size, per-device batch "
            f"{plan.batch_size} x {plan.seq_len} tokens; {base}"
        )
        header = ["world size", "nodes", "setup", "step time", "tokens/s", "tokens/s/device", "efficiency"]
        table = [header + ([cost_title(self.price)] if self.price is not None else [])]
        for r in self.rows:
            cells = [str(r.world_size), str(r.nodes), r.setup or "nothing fits", seconds_text(r.step_time_s)]
            cells += [_rate(r.tokens_per_s), _rate(r.tokens_per_s_per_device)]
            cells.append(f"{r.efficiency:.1%}" if r.efficiency is not None else "-")
            table.append(cells + ([format_cost(r.cost)] if self.price is not None else []))
        return [title, "", *format_table(table)]


def plan_scaling(
    model_or_config: Any,
    args: Any = None,
    *,
    world_sizes: int | str | Sequence[int],
    price: Price | None = None,
    **options: Any,
) -> ScalingPlan:
    """Plan the training of ``model_or_config`` with ``args`` at each of ``world_sizes``
    ([Note: the scaling table]).

    Example::

        scaling = plan_scaling(config, args, world_sizes=[8, 16], device_memory="80GiB", target="H100")
        scaling.rows[1].efficiency            # tokens/s at 16 over twice those at 8

    Args:
        model_or_config: What to train, as for ``plan_memory``.
        args: The run's ``TrainingArguments``, as for ``plan_memory``.
        world_sizes: The world sizes: a list, or their text such as ``"8,16,32"``.
        price: A price per device-hour and the tokens to price (``cost.Price``); None: no cost.
        **options: ``plan_memory``'s other keywords (``device_memory`` among them), the same for every size.

    Returns:
        The plans and their scaling table.

    Raises:
        ValueError: A world size is invalid, ``world_size`` is among ``options``, or ``plan_memory`` refuses
            an option.
    """
    sizes = parse_world_sizes(world_sizes)
    if "world_size" in options:
        raise ValueError("plan_scaling takes its world sizes as world_sizes=[...]; drop world_size")
    spec = ModelSpec.from_source(model_or_config, lora_r=options.pop("lora_r", None),
                                 lora_targets=options.pop("lora_targets", None))  # fmt: skip
    backend = options.get("backend") or planned_backend(args)
    if backend == "nccl":
        from hf_lowzero.simulation.launch import FakeCudaUnavailable, call_on_fake_gpus, fake_cuda_here

        if not fake_cuda_here():
            try:  # one fake-GPU process for every size, not one each
                return call_on_fake_gpus(plan_scaling, spec, args, world_sizes=sizes, price=price, **options)
            except FakeCudaUnavailable:
                pass  # plan_memory says why, and plans on fake CPU tensors
    plans = [plan_memory(spec, args, world_size=size, **options) for size in sizes]
    if price is not None:
        for plan in plans:
            price.apply(plan)
    return ScalingPlan(plans=plans, rows=scaling_rows(plans, price), base_world_size=_base(plans),
                       price=price.describe() if price is not None else None)  # fmt: skip


def scaling_rows(plans: list[MemoryPlan], price: Price | None = None) -> list[ScalingRow]:
    """The scaling table of ``plans`` (one per world size; [Note: the scaling table])."""
    base_size = _base(plans)
    base = next((p.recommended for p in plans if p.world_size == base_size), None)
    rows = []
    for plan in plans:
        per_node = plan.timed_for.get("gpus_per_node") or plan.world_size
        row = ScalingRow(world_size=plan.world_size, nodes=math.ceil(plan.world_size / per_node), setup=None)
        best = plan.recommended
        if best is not None:
            row.setup, row.stage, row.offload = best.label, best.stage, best.offload
            row.step_time_s, row.tokens_per_s_per_device = best.step_time_s, best.tokens_per_s
        if row.tokens_per_s_per_device is not None:
            row.tokens_per_s = row.tokens_per_s_per_device * plan.world_size
            if base is not None:  # the base's tokens/s over all its devices, times the ratio of world sizes
                linear = (base.tokens_per_s * base_size) * (plan.world_size / base_size)
                row.efficiency = row.tokens_per_s / linear
            if price is not None:
                row.cost = price.cost(plan.world_size, row.tokens_per_s)
        rows.append(row)
    return rows


def _base(plans: list[MemoryPlan]) -> int | None:
    """The smallest world size at which something fits and is timed."""
    timed = [p.world_size for p in plans if p.recommended is not None and p.recommended.tokens_per_s]
    return min(timed) if timed else None


def _rate(value: float | None) -> str:
    return f"{value:,.0f}" if value is not None else "-"
