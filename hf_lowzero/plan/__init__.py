"""Know before you launch: a memory plan for any Trainer run (see ``planner.py``).

Example::

    from hf_lowzero import plan_memory
    plan = plan_memory("path/to/model", args, world_size=8, device_memory="80GiB", seq_len=2048)
    print(plan.to_text())

or ``python -m hf_lowzero.trainer.plan_cli --model path/to/model --world-size 8 --device-memory 80GiB --bf16``.
Without a device size: ``plan_devices`` (every setup's peak and the smallest common device it fits).
Several world sizes: ``plan_scaling`` (each size's plan and the scaling table); a cost: ``Price``.
"""

from hf_lowzero.plan.cost import Price
from hf_lowzero.plan.devices import COMMON_DEVICES, DeviceFits, plan_devices, smallest_device
from hf_lowzero.plan.planner import plan_memory
from hf_lowzero.plan.report import MemoryPlan, PlanRow, format_bytes
from hf_lowzero.plan.request import parse_bytes
from hf_lowzero.plan.scaling import ScalingPlan, ScalingRow, plan_scaling
from hf_lowzero.plan.simulate import simulate_step
from hf_lowzero.plan.step_records import PARTS, Setup, StepMemory, TrainingSpec

__all__ = [
    "COMMON_DEVICES",
    "PARTS",
    "DeviceFits",
    "MemoryPlan",
    "PlanRow",
    "Price",
    "ScalingPlan",
    "ScalingRow",
    "Setup",
    "StepMemory",
    "TrainingSpec",
    "format_bytes",
    "parse_bytes",
    "plan_devices",
    "plan_memory",
    "plan_scaling",
    "simulate_step",
    "smallest_device",
]
