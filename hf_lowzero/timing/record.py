"""The step's own sequence, recorded for timing: ``StepRecorder``.

[Note: the step's own sequence] The plan's simulated step runs every kernel, copy, event, stream
wait and collective of the real code, in order. ``StepRecorder`` writes them down as they are
issued, as a ``Program``: each op with the stream it runs on and its work (``counting.py``), each
host-device copy, each collective (kind, bytes, group size), each event recorded and waited on. No
formula stands beside the code: ``schedule.py`` prices this sequence, so the all-gathers left in
flight, the bucket sizes, offload's copies and host step and exact mode's int64 traffic are timed
as the code issues them.

- On fake GPUs it is a dispatch mode (every op, on its device's current stream) and the
  ``StepObserver`` (``hf_lowzero.simulation.observer``) of the fake streams and the NCCL stand-in.
- On fake CPU tensors (ranks on CPUs, gloo) every op is the host's, and a ``c10d`` collective runs
  at once: the host waits for it.

Example::

    recorder = StepRecorder(ops)              # ops: the step's FakeCudaOps, or None on CPU ranks
    with recorder:
        recorder.start()
        warm_up_update()                      # the previous step's update: its all-gathers in flight
        recorder.boundary()
        forward_backward(); update()
        recorder.boundary()
    timeline = schedule(recorder.program, Costs(target))
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowzero.timing.counting import (
    CPU_ATTENTION,
    OpWork,
    is_collective_op,
    is_query,
    op_work,
    with_cpu_attention,
)

HOST = "host"
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb
DDP_FIRST_BUCKET_BYTES = 2**20  # and its first bucket's (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)

# [Note: DDP's reducer] The ops DDP's C++ reducer issues for each gradient, seen by a dispatch mode
# over the Trainer's DDP step (gloo; ``test_the_ddp_stand_in_issues_the_ops_of_the_trainers_ddp``):
# as it is ready, a view of its bucket and the gradient written there divided by the world size
# (``mul``); where DDP finds unused parameters (the Trainer's default without gradient
# checkpointing), its "used" flag set (two ``select``, a ``fill_``) and read
# (``_local_scalar_dense``); after the all-reduce, the bucket's values copied back into ``.grad``.
# As (name, bytes moved in gradients' sizes or 0: a flag's 4 bytes, launches a kernel). A step of
# many small gradients pays their dispatch: 1-3 ms of a 30 ms step of a small model on a CPU.
DDP_PER_GRADIENT = (("aten.as_strided", 0, False), ("aten.mul", 2, True))
DDP_MARK_USED = (  # with find_unused_parameters, the Trainer's default without gradient checkpointing
    ("aten.select", 0, False),
    ("aten.select", 0, False),
    ("aten.fill_", 0, True),
    ("aten._local_scalar_dense", 0, False),
)
DDP_AFTER_ALL_REDUCE = (("aten.copy_", 2, True),)
aten = torch.ops.aten


@dataclass
class Program:
    """The recorded sequence: ``steps`` in issue order, each a tuple whose first item says what it is.

    - ``("run", context, kind, work)``: ``kind`` "kernel" or "host" (``work`` an ``OpWork``), "copy"
      (``work`` the bytes moved), "collective" (``work`` ``(op, nbytes, group_size)``);
    - ``("record", context, mark)``: ``mark`` names the work queued on ``context`` so far;
    - ``("wait", context, mark)``: ``context`` runs nothing more until ``mark``'s work is done;
    - ``("boundary",)``: the end of an update; the step is the time between two (``schedule.py``).

    Contexts are ``"host"`` and the streams by name (``"compute"``, ``"nccl"``, ``"side 1"``, ...).
    """

    steps: list[tuple] = field(default_factory=list)
    marks: int = 0

    def mark(self, context: str) -> int:
        self.marks += 1
        self.steps.append(("record", context, self.marks))
        return self.marks


class StepRecorder(TorchDispatchMode):
    """See the module docstring. Enter it inside ``FakeTensorMode``; it records between ``start()``
    and the end of the ``with`` block."""

    def __init__(self, ops=None) -> None:
        super().__init__()
        self.ops = ops  # FakeCudaOps of a step on fake GPUs, None for CPU ranks
        self.program = Program()
        self.recording = False
        self._events: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def start(self) -> None:
        """Record from here on."""
        self.recording = True

    def boundary(self) -> None:
        """Mark the end of an update ([Note: the step's own sequence])."""
        if self.recording:
            self.program.steps.append(("boundary",))

    # ------------------------------------------------------------ the dispatch mode: every op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recording:
            self._op(func, args, kwargs, out)
        return out

    def _op(self, func, args, kwargs, out) -> None:
        if is_collective_op(func):
            if self.ops is None:  # CPU ranks: the host issues it and waits (gloo, [Note: the step's own sequence])
                self._collective_on_host(func, args, out)
            return  # on fake GPUs the NCCL stand-in reports it (collective below)
        if is_query(func):  # a real tensor answers it without the dispatcher
            return
        work = op_work(func, args, kwargs, out)
        if work.name in CPU_ATTENTION:
            work = with_cpu_attention(args, work)
        steps = self.program.steps
        tensors = _tensors(args, kwargs, out) if self.ops is not None else []
        cuda = [t for t in tensors if t.device.type == "cuda"]
        if not cuda:
            steps.append(("run", HOST, "host", work))
            return
        stream = self.ops.current_stream(cuda[0].device).name
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if not host:
            steps.append(("run", stream, "kernel", work))
            return
        steps.append(("run", stream, "copy", work.nbytes // 2))  # read on one side, written on the other
        non_blocking = bool(kwargs.get("non_blocking", False)) or (
            func is aten.copy_.default and len(args) > 2 and bool(args[2])
        )
        if not (non_blocking and all(self.ops.pinned_footprint(t) > 0 for t in host)):
            steps.append(("wait", HOST, self.program.mark(stream)))  # a blocking copy: the host waits

    def _collective_on_host(self, func, args, out) -> None:
        tensors = _tensors(args, {}, None)
        group = next((a for a in args if isinstance(a, torch.distributed.ProcessGroup)), None)
        size = group.size() if group is not None else torch.distributed.get_world_size()
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        name = func.overloadpacket.__name__.strip("_")
        op = _C10D_NAMES.get(name, name)
        self.program.steps.append(("run", "gloo", "collective", (op, nbytes, size)))
        self.program.steps.append(("wait", HOST, self.program.mark("gloo")))

    @contextlib.contextmanager
    def ddp_all_reduces(self, params: list[torch.Tensor], world_size: int, find_unused: bool = True) -> Iterator[None]:
        """Within: DDP's all-reduces of ``params``' gradients, which a fake step cannot run (stage 0
        builds no DDP on fake tensors, [Note: what the simulation leaves out] in plan/simulate.py):
        the first bucket of ``DDP_FIRST_BUCKET_BYTES`` and each next of ``DDP_BUCKET_BYTES`` queued
        as backward fills it, and the rest with the last gradient; the step waits for them all at the
        end of the block, as DDP's backward does. Each gradient costs the reducer's own ops ([Note:
        DDP's reducer])."""
        compute, comm = ("compute", "nccl") if self.ops is not None else (HOST, "gloo")
        kind = "kernel" if self.ops is not None else "host"
        pending, caps = [0], [DDP_FIRST_BUCKET_BYTES]
        ready: list[int] = []

        def reducer(ops, nbytes: int) -> None:  # [Note: DDP's reducer]
            if self.recording:
                for name, moved, launches in ops:
                    work = OpWork(0.0, moved * nbytes if moved else 4, "fp32", launches, name)
                    self.program.steps.append(("run", compute, kind, work))

        def queue() -> None:
            if self.recording and pending[0]:
                self.program.steps.append(("wait", comm, self.program.mark(compute)))
                self.program.steps.append(("run", comm, "collective", ("all_reduce", pending[0], world_size)))
            pending[0] = 0
            caps[0] = DDP_BUCKET_BYTES

        def filled(p: torch.Tensor) -> None:
            nbytes = p.numel() * p.element_size()
            reducer(DDP_PER_GRADIENT + (DDP_MARK_USED if find_unused else ()), nbytes)
            ready.append(nbytes)
            pending[0] += nbytes
            if pending[0] >= caps[0]:
                queue()

        handles = [p.register_post_accumulate_grad_hook(filled) for p in params]
        try:
            yield
            queue()
            if self.recording:
                self.program.steps.append(("wait", compute, self.program.mark(comm)))
            for nbytes in ready:
                reducer(DDP_AFTER_ALL_REDUCE, nbytes)
        finally:
            for handle in handles:
                handle.remove()

    # --------------------------------------------------- StepObserver: events, waits, collectives

    def event_recorded(self, stream, event) -> None:
        if self.recording:
            self._events[event] = self.program.mark(stream.name)

    def stream_waits(self, stream, event) -> None:
        if self.recording and event in self._events:  # an event of before the recording: long done
            self.program.steps.append(("wait", stream.name, self._events[event]))

    def stream_waits_stream(self, stream, other) -> None:
        if self.recording:
            self.program.steps.append(("wait", stream.name, self.program.mark(other.name)))

    def host_waits(self, event) -> None:
        if self.recording and event in self._events:
            self.program.steps.append(("wait", HOST, self._events[event]))

    def collective(self, stream, after, op: str, nbytes: int, group_size: int) -> object:
        if not self.recording:
            return None
        steps = self.program.steps
        steps.append(("wait", stream.name, self.program.mark(after.name)))  # NCCL's stream waits first
        steps.append(("run", stream.name, "collective", (op, nbytes, group_size)))
        return self.program.mark(stream.name)

    def collective_waited(self, stream, handle) -> None:
        if self.recording and handle is not None:
            self.program.steps.append(("wait", stream.name, handle))


_C10D_NAMES = {
    "allreduce": "all_reduce",
    "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "alltoall_base": "all_to_all",
}


def _tensors(args, kwargs, out) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = [*args, *kwargs.values(), out]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return found
