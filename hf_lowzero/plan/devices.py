"""The plan without a device size: this machine's GPU, or the smallest common device each setup fits.

``python -m hf_lowzero.trainer.plan_cli`` without ``--device-memory`` plans for GPU 0 of this machine when it
has one (``this_gpu``); elsewhere it plans every setup's peak and names the smallest of the common
device sizes (``COMMON_DEVICES``) that each fits (``plan_devices``, ``smallest_device``).

Example::

    fits = plan_devices("path/to/model", args, world_size=4, seq_len=1024)
    print(fits.to_text())
    fits.smallest["stage 2"]          # 17179869184: a 16 GiB device, or None: none of the list

# [Note: peaks without a device]
# A setup's peak does not depend on the device: each setup's step is simulated at the planned batch,
# and only fits, headroom and the largest batch are measured against a size. ``plan_devices`` plans
# against a device of one byte, which nothing fits: the planner then skips its check of the largest
# batch (a simulation at that batch, which needs a size) and the peaks come at the cost of a plan.
# A setup fits a device of ``size`` bytes when its peak is at most ``size * (1 - reserve)``, as in a
# plan with ``--device-memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_lowzero.plan.planner import plan_memory
from hf_lowzero.plan.report import SIMULATED_ON, MemoryPlan, PlanRow, format_bytes, format_table, headline, time_table
from hf_lowzero.plan.request import RESERVE
from hf_lowzero.plan.simulate import PARTS
from hf_lowzero.plan.timed import TIME_COLUMNS

GIB = 2**30
COMMON_DEVICES = tuple(n * GIB for n in (16, 24, 40, 48, 80, 141))  # T4/V100, L4/A10, A100 40G, L40S, A100/H100, H200


def this_gpu() -> tuple[str, int] | None:
    """The name and total memory in bytes of this machine's GPU 0, or None without a GPU.

    Example::

        this_gpu()        # ("NVIDIA H100 80GB HBM3", 85029158912) on an H100, None on a laptop
    """
    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return properties.name, properties.total_memory


def smallest_device(peak_bytes: int, reserve: float = RESERVE, sizes: tuple[int, ...] = COMMON_DEVICES) -> int | None:
    """The smallest of ``sizes`` whose usable part (``1 - reserve`` of it) holds ``peak_bytes``, or None.

    Example::

        >>> smallest_device(15 * GIB) // GIB, smallest_device(200 * GIB)
        (24, None)

    Args:
        peak_bytes: A setup's peak of device memory in one step.
        reserve: The fraction of a device kept for the CUDA context and fragmentation.
        sizes: The device sizes to choose from, in bytes.

    Returns:
        The size in bytes, or None when the peak exceeds every size's usable part.
    """
    return min((size for size in sizes if peak_bytes <= size * (1 - reserve)), default=None)


@dataclass
class DeviceFits:
    """Every setup's peak and the smallest of ``sizes`` it fits ([Note: peaks without a device]).

    Args:
        plan: The plan the peaks come from; its fits, headroom and largest batch are against no device.
        sizes: The device sizes chosen from, in bytes.
        reserve: The fraction of a device kept free.
        host_per_rank: The host memory one rank may use (offload), or None: unchecked.
        smallest: The smallest size each setup fits, by the setup's label; None: none of ``sizes``.
    """

    plan: MemoryPlan
    sizes: tuple[int, ...]
    reserve: float
    host_per_rank: int | None
    smallest: dict[str, int | None]

    def fits_host(self, row: PlanRow) -> bool:
        """Whether ``row``'s host memory fits the rank's share of the node's (always, when unchecked)."""
        return self.host_per_rank is None or row.host_bytes <= self.host_per_rank

    def to_dict(self) -> dict[str, Any]:
        """The peaks and smallest devices as plain data, for JSON."""
        keep = ("model", "total_params", "trainable_params", "world_size", "host_memory", "ranks_per_node")
        keep += ("batch_size", "seq_len", "training", "simulated_on", "timed_for")
        rows = [
            {
                "setup": r.label,
                "label": r.label,
                "stage": r.stage,
                "offload": r.offload,
                "partition": r.partition,
                "peak_bytes": r.peak_bytes,
                "breakdown": r.breakdown,
                "host_bytes": r.host_bytes,
                "sent_bytes_per_step": r.sent_bytes_per_step,
                "fits_host": self.fits_host(r),
                "smallest_device_bytes": self.smallest[r.label],
                **{name: getattr(r, name) for name in TIME_COLUMNS},
                **({"cost": r.cost} if self.plan.price is not None else {}),
            }
            for r in self.plan.rows
        ]
        keep += ("price",) if self.plan.price is not None else ()
        plan = {k: getattr(self.plan, k) for k in keep}
        return plan | {"reserve": self.reserve, "device_sizes": list(self.sizes), "rows": rows}

    def to_text(self) -> str:
        """Every setup's peak, its parts and the smallest device it fits, for a console."""
        plan = self.plan
        sizes = ", ".join(str(size // GIB) for size in self.sizes)
        lines = [
            headline(plan),
            f"World size {plan.world_size}, no device size given: each setup's peak and the smallest of {sizes} GiB "
            f"it fits (peak <= {1 - self.reserve:.0%} of the device: {self.reserve:.0%} kept for the CUDA context "
            f"and fragmentation); simulated on {SIMULATED_ON[plan.simulated_on]}",
            "",
        ]
        table = [["setup", "peak/device", *PARTS, "host/rank", "sent/step", "smallest device"]]
        for r in plan.rows:
            size = self.smallest[r.label]
            if not self.fits_host(r):
                device = "host too small"
            else:
                device = f"{size // GIB} GiB" if size is not None else "none of these"
            table.append(
                [
                    r.label + (f" [{r.partition}]" if r.partition == "params" else ""),
                    format_bytes(r.peak_bytes),
                    *(format_bytes(r.breakdown[p]) for p in PARTS),
                    format_bytes(r.host_bytes) if r.offload else "-",
                    format_bytes(r.sent_bytes_per_step),
                    device,
                ]
            )
        lines += format_table(table)
        lines += time_table(plan)
        lines += ["", "--device-memory SIZE plans one size: which setup fits it, with what headroom and largest batch."]
        return "\n".join(lines)

    @property
    def fits_any(self) -> bool:
        """Whether some setup fits one of the sizes (and the host memory, if checked)."""
        return any(self.smallest[r.label] is not None and self.fits_host(r) for r in self.plan.rows)


def plan_devices(
    model_or_config: Any,
    args: Any = None,
    *,
    sizes: tuple[int, ...] = COMMON_DEVICES,
    reserve: float = RESERVE,
    **plan_kwargs: Any,
) -> DeviceFits:
    """Plan every setup's peak without a device size and the smallest of ``sizes`` each fits.

    Example::

        fits = plan_devices("path/to/model", args, world_size=4, seq_len=1024)
        fits.smallest["stage 0 (DDP)"] // 2**30          # 24

    Args:
        model_or_config: What to train, as for :func:`plan_memory`.
        args: The run's ``TrainingArguments``, or None for the defaults.
        sizes: The device sizes to choose from, in bytes (default: 16, 24, 40, 48, 80 and 141 GiB).
        reserve: The fraction of each device kept for the CUDA context and fragmentation.
        **plan_kwargs (Any): :func:`plan_memory`'s other keyword arguments (``world_size``, ``seq_len``,
            ``host_memory``, ``ranks_per_node``, ``lora_r``, ``lora_targets``, ``ref_model``, ``backend``).

    Returns:
        The peaks and the smallest device of each setup.

    Raises:
        ValueError: As :func:`plan_memory`, or ``device_memory`` was given (use :func:`plan_memory`).
    """
    if "device_memory" in plan_kwargs:
        raise ValueError("device_memory is given: plan that size with plan_memory; plan_devices plans without one")
    # [Note: peaks without a device]: a device of one byte, which nothing fits
    plan = plan_memory(model_or_config, args, device_memory=1, reserve=reserve, **plan_kwargs)
    host = plan.host_memory // plan.ranks_per_node if plan.host_memory is not None else None
    smallest = {r.label: smallest_device(r.peak_bytes, reserve, sizes) for r in plan.rows}
    return DeviceFits(plan=plan, sizes=tuple(sizes), reserve=reserve, host_per_rank=host, smallest=smallest)
