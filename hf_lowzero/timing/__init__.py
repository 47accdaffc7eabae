"""The plan's time model: a step's own sequence, priced and scheduled.

- ``devices.py``: the devices a plan times for, with sources, and the ``Target`` (device, node, links);
- ``calibrate.py``: ``cpu``, this machine, measured once and cached;
- ``step_rates.py``: the rates a CPU's ops reach inside a step ([Note: rates in a step]);
- ``counting.py``: an op's FLOPs and bytes;
- ``costs.py``: the cost model, seconds per op, copy and collective ([Note: the cost model]);
- ``record.py``: ``StepRecorder``, the simulated step's sequence as it is issued ([Note: the step's own sequence]);
- ``schedule.py``: that sequence on streams and the host, and a step's time ([Note: the schedule]).

``hf_lowzero.plan`` records each setup's simulated step and times it here. This room needs torch only.
"""

from hf_lowzero.timing.costs import Costs
from hf_lowzero.timing.devices import DEVICES, Device, Target, find_device, parse_bandwidth
from hf_lowzero.timing.record import Program, StepRecorder
from hf_lowzero.timing.schedule import StepTime, Timeline, schedule

__all__ = [
    "DEVICES",
    "Costs",
    "Device",
    "Program",
    "StepRecorder",
    "StepTime",
    "Target",
    "Timeline",
    "find_device",
    "parse_bandwidth",
    "schedule",
]
