"""The world a simulated step runs in: fake GPUs, a fake process group, or the caller's own.

Example::

    with step_world(step) as recorder:   # step: a SimulatedStep
        ...                              # build the model and run the step, as rank step.rank of step.world_size
        recorder.start()                 # a StepRecorder on fake tensors (hf_lowzero.timing), None on real ones

[Note: planning on fake GPUs] is in ``simulate.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hf_lowzero.plan.step_records import SimulatedStep
from hf_lowzero.timing.record import StepRecorder
from hf_lowzero.zero.runtime import comm


@contextlib.contextmanager
def step_world(step: SimulatedStep) -> Iterator[StepRecorder | None]:
    """Where ``step`` runs: a real step in the caller's process group and tensors; a fake one on
    its fake GPU (``step.device``) or on fake CPU tensors, under ``FakeTensorMode``, on a fake
    process group that stands for ``step.backend``. A fake one yields the ``StepRecorder`` that
    times it ([Note: the step's own sequence] in hf_lowzero/timing/record.py), recording once started."""
    if not step.fake:
        yield None
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    if step.device is not None:
        from hf_lowzero.simulation.attention import gpu_attention

        with _fake_gpu_world(step.world_size, step.rank, step.device) as ops, FakeTensorMode(), gpu_attention():
            recorder = StepRecorder(ops)
            ops.observer = recorder
            with recorder:
                yield recorder
    else:
        stands_for = comm.fake_group_stands_for(step.backend)
        with _fake_world(step.world_size, step.rank), stands_for, FakeTensorMode(), StepRecorder() as recorder:
            yield recorder


@contextlib.contextmanager
def _fake_gpu_world(world_size: int, rank: int, device: torch.device):
    """A simulated NCCL group and fake streams for a step on the fake ``device``: streams and
    events order nothing here (the plan counts memory; ``hf_lowzero.simulation`` checks order)."""
    from hf_lowzero.simulation.nccl import simulated_world
    from hf_lowzero.simulation.streams import AccessChecker, FakeCudaOps
    from hf_lowzero.zero.runtime import device as dev

    checker = AccessChecker()
    ops = FakeCudaOps(checker, device)
    with simulated_world(world_size, rank, device, checker, ops), dev.use_ops(ops), ops.on_device(device):
        yield ops


@contextlib.contextmanager
def _fake_world(world_size: int, rank: int):
    if dist.is_initialized():
        raise RuntimeError(
            "a memory plan simulates its ranks on a fake process group and needs a process without one; "
            "plan before torch.distributed is initialized, or in a separate process"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
