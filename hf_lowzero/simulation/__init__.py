"""The GPU path on a machine without a GPU: the real step on fake CUDA tensors, checked.

- ``launch.py``: a fresh process whose torch has fake CUDA devices (``call_on_fake_gpus``);
- ``streams.py``: fake streams and events, and the checker of every access's ordering;
- ``nccl.py``: a process group that enforces NCCL's rules and records every collective;
- ``gpu_step.py``: the cases, one rank at a time, and the comparison across ranks.

``python -m hf_lowzero.simulation`` runs the default cases. The memory plan
(``hf_lowzero.plan``) simulates GPU setups through the same pieces.
"""

from hf_lowzero.simulation.gpu_step import CaseResult, GpuCase, check_cases, default_cases, read_cases
from hf_lowzero.simulation.launch import FakeCudaUnavailable, call_on_fake_gpus, fake_cuda_here
from hf_lowzero.simulation.nccl import NcclRuleError
from hf_lowzero.simulation.streams import RaceError, StaleReadError, WrongDeviceError

__all__ = [
    "CaseResult",
    "FakeCudaUnavailable",
    "GpuCase",
    "NcclRuleError",
    "RaceError",
    "StaleReadError",
    "WrongDeviceError",
    "call_on_fake_gpus",
    "check_cases",
    "default_cases",
    "read_cases",
    "fake_cuda_here",
]
