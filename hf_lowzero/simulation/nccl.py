"""A process group that moves no data and enforces NCCL's rules, for one simulated rank.

``SimulatedGroup`` is registered as the torch.distributed backend ``"hf_lowzero_sim"``;
``hf_lowzero.zero.runtime.comm`` takes the code paths of the backend it ``stands_for`` (``"nccl"``). Every
collective is checked as NCCL would check it or fail at it, recorded in the rank's ``sequence``,
and reported to the ``AccessChecker`` as work on NCCL's stream ([Note: ordering model] in
``streams.py``):

- CUDA tensors only, dense and contiguous, on this rank's device (NCCL's communicator is bound to
  one GPU: a tensor elsewhere is an error or a silent hang);
- sizes that NCCL requires to match: a reduce-scatter's input is W times its output, an
  all-gather's output W times its input, all-to-all splits add up to the tensors;
- barriers and object collectives on this rank's device (they otherwise run on the current
  device, GPU 0 for every rank that never called ``torch.cuda.set_device``).

Across ranks, ``compare_sequences`` checks that every rank issued the same collectives in the same
order with the same dtypes and sizes, and that all-to-all splits agree pairwise. Data never moves:
outputs keep whatever the fake tensors hold (nothing).

Example::

    with simulated_world(world_size=2, rank=1, device=torch.device("cuda", 1), checker=checker, ops=ops) as world:
        ...                                   # the real step, on fake tensors
    compare_sequences([world0.sequence, world1.sequence])
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_lowzero.simulation.streams import AccessChecker, FakeCudaOps

BACKEND = "hf_lowzero_sim"


class NcclRuleError(RuntimeError):
    """What NCCL would refuse, or where it would hang or cross GPUs."""


@dataclass(frozen=True)
class Collective:
    """One collective as a rank issued it: what must agree across ranks, and its all-to-all splits."""

    op: str
    dtype: str | None
    sizes: tuple[int, ...]  # numel of the input and the output (each rank's, equal on every rank)
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # all-to-all: (input, output) per peer
    reduction: str | None = None  # the reduction of a reduce-scatter or all-reduce: "SUM", "PREMUL_SUM", ...

    def shape(self) -> tuple:
        """What must be equal on every rank (splits are checked pairwise instead)."""
        kind = (self.op, self.dtype, self.reduction)
        return kind if self.splits is not None else (*kind, self.sizes)


@dataclass
class SimulatedWorld:
    """One simulated rank: its device, what it checks against, and the collectives it issued."""

    world_size: int
    rank: int
    device: torch.device  # the params' device: the GPU this rank's communicator is bound to
    checker: AccessChecker
    ops: FakeCudaOps
    stands_for: str = "nccl"
    sequence: list[Collective] = field(default_factory=list)


_WORLDS: list[SimulatedWorld] = []


class _Done(dist.distributed_c10d.Work):
    """A collective's work handle: ``wait()`` orders the current stream after it (NCCL semantics)."""

    def __init__(self, on_wait) -> None:
        super().__init__()
        self._on_wait = on_wait

    def wait(self, timeout=None) -> bool:
        if self._on_wait is not None:
            self._on_wait()
            self._on_wait = None
        return True


class SimulatedGroup(dist.ProcessGroup):
    """See the module docstring."""

    def __init__(self, rank: int, size: int, world: SimulatedWorld) -> None:
        super().__init__(rank, size)
        self.world = world
        self.stands_for = world.stands_for

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    # ----------------------------------------------------------------------- collectives

    def allreduce(self, tensors, opts=None):
        (t,) = tensors
        reduction = _reduction(opts)
        return self._collective("all_reduce", reads=[t], writes=[t], sizes=(t.numel(), t.numel()), reduction=reduction)

    def reduce_scatter_single(self, output, input, opts=None):
        if input.numel() != self.size() * output.numel() or input.dtype != output.dtype:
            raise NcclRuleError(
                f"reduce_scatter: input of {input.numel()} {input.dtype} elements for an output of {output.numel()} "
                f"{output.dtype} at world size {self.size()}; NCCL needs input = W x output, one dtype"
            )
        sizes, reduction = (input.numel(), output.numel()), _reduction(opts)
        return self._collective("reduce_scatter", reads=[input], writes=[output], sizes=sizes, reduction=reduction)

    _reduce_scatter_base = reduce_scatter_single  # torch 2.11's name

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != self.size() * input.numel() or input.dtype != output.dtype:
            raise NcclRuleError(
                f"all_gather: output of {output.numel()} {output.dtype} elements for an input of {input.numel()} "
                f"{input.dtype} at world size {self.size()}; NCCL needs output = W x input, one dtype"
            )
        return self._collective("all_gather", reads=[input], writes=[output], sizes=(input.numel(), output.numel()))

    _allgather_base = all_gather_single  # torch 2.11's name

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        outs = list(output_split_sizes) or [output.numel() // self.size()] * self.size()
        ins = list(input_split_sizes) or [input.numel() // self.size()] * self.size()
        if sum(outs) != output.numel() or sum(ins) != input.numel() or input.dtype != output.dtype:
            raise NcclRuleError(
                f"all_to_all: splits {ins} -> {outs} do not add up to the tensors ({input.numel()} -> {output.numel()} "
                f"elements, {input.dtype} -> {output.dtype})"
            )
        return self._collective(
            "all_to_all", reads=[input], writes=[output], sizes=(input.numel(), output.numel()), splits=(ins, outs)
        )

    def barrier(self, opts=None):
        device = getattr(opts, "device", None)
        if device is None or torch.device(device).index is None or torch.device(device).type != "cuda":
            # no device_ids: NCCL's barrier takes the current device
            device = torch.device("cuda", self.world.ops.current_device)
        if self.stands_for == "nccl" and (device is None or torch.device(device) != self.world.device):
            raise NcclRuleError(
                f"rank {self.world.rank}: barrier on {device}, but this rank's GPU is {self.world.device}: NCCL's "
                "barrier runs where it is told, or on the current device (GPU 0 unless torch.cuda.set_device was "
                "called), and hangs or crosses GPUs there; pass device_ids=[the params' device index]"
            )
        return self._collective("barrier", reads=[], writes=[], sizes=(0, 0))

    def send(self, tensors, dst, tag=0):
        return self._collective("send", reads=list(tensors), writes=[], sizes=(tensors[0].numel(), 0))

    def recv(self, tensors, src, tag=0):
        return self._collective("recv", reads=[], writes=list(tensors), sizes=(0, tensors[0].numel()))

    def object_collective(self, op: str, obj, device: torch.device | None) -> list:
        """``comm.all_gather_object``/``gather_object`` on a simulated group: checked and recorded;
        every rank's object is taken to be this rank's (no data moves)."""
        if self.stands_for == "nccl":
            current = torch.device("cuda", self.world.ops.current_device)
            if device is None or torch.device(device) != self.world.device or current != self.world.device:
                raise NcclRuleError(
                    f"rank {self.world.rank}: {op} through {device} with {current} current, but this rank's GPU is "
                    f"{self.world.device}: NCCL's object collectives use the current CUDA device; run them under "
                    "the params' device (hf_lowzero.zero.runtime.device.on_device)"
                )
        self.world.sequence.append(Collective(op, None, (0, 0)))
        return [obj] * self.size()

    # -------------------------------------------------------------------------- checks

    def _collective(self, op: str, reads, writes, sizes, splits=None, reduction=None):
        tensors = [*reads, *writes]
        for t in tensors:
            self._check_tensor(op, t)
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else None
        pairs = None if splits is None else tuple(map(tuple, splits))
        self.world.sequence.append(Collective(op, dtype, tuple(sizes), pairs, reduction))
        if not tensors or tensors[0].device.type != "cuda":
            return _Done(None)
        checker, device = self.world.checker, tensors[0].device
        nccl = self._nccl_stream(device)
        checker.merge(nccl, checker.snapshot(checker.current_stream(device)))  # NCCL's stream waits first
        checker.access(nccl, list(reads), list(writes), f"NCCL {op}")
        done = checker.snapshot(nccl)
        observer = self.world.ops.observer  # the time model ([Note: the step's own sequence] in hf_lowzero/timing)
        if observer is None:
            return _Done(lambda: checker.merge(checker.current_stream(device), done))
        nbytes = max(t.numel() * t.element_size() for t in tensors)
        handle = observer.collective(nccl, checker.current_stream(device), op, nbytes, self.size())

        def waited() -> None:
            checker.merge(checker.current_stream(device), done)
            observer.collective_waited(checker.current_stream(device), handle)

        return _Done(waited)

    def _nccl_stream(self, device: torch.device):
        streams = self.world.__dict__.setdefault("_nccl_streams", {})
        if device not in streams:
            streams[device] = self.world.checker.stream(device, "nccl")
        return streams[device]

    def _check_tensor(self, op: str, t: torch.Tensor) -> None:
        if self.stands_for != "nccl":
            return
        if t.device.type != "cuda":
            raise NcclRuleError(
                f"rank {self.world.rank}: a {t.device.type} tensor ({tuple(t.shape)}, {t.dtype}) reached NCCL's {op}; "
                "NCCL sends CUDA tensors only (move it to the params' device first)"
            )
        if t.device != self.world.device:
            raise NcclRuleError(
                f"rank {self.world.rank}: NCCL's {op} got a tensor on {t.device}, but this rank's GPU is "
                f"{self.world.device}"
            )
        if not t.is_contiguous():
            raise NcclRuleError(f"rank {self.world.rank}: NCCL's {op} got a non-contiguous tensor {tuple(t.shape)}")


def _reduction(opts) -> str | None:
    """The reduction an options object carries (``"SUM"``, ``"MAX"``, ``"PREMUL_SUM"``), or None."""
    op = getattr(opts, "reduceOp", None)
    return None if op is None else str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def _create(store, rank: int, size: int, timeout) -> SimulatedGroup:
    return SimulatedGroup(rank, size, _WORLDS[-1])


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, devices=["cuda"])  # as NCCL: no CPU tensors
        _registered = True


@contextlib.contextmanager
def simulated_world(
    world_size: int, rank: int, device: torch.device, checker: AccessChecker, ops: FakeCudaOps, stands_for="nccl"
) -> Iterator[SimulatedWorld]:
    """Within: the default process group is a ``SimulatedGroup`` of ``world_size`` with this
    process as ``rank``, bound to ``device``."""
    if dist.is_initialized():
        raise RuntimeError("a simulated rank needs a process without a process group; simulate in a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    _register()
    world = SimulatedWorld(world_size, rank, torch.device(device), checker, ops, stands_for)
    _WORLDS.append(world)
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=FakeStore())
        try:
            yield world
        finally:
            dist.destroy_process_group()
    finally:
        _WORLDS.remove(world)


def compare_sequences(sequences: list[list[Collective]]) -> None:
    """Raise ``NcclRuleError`` unless every rank issued the same collectives (``sequences[r]``: rank
    r's) in the same order, with the same dtypes and sizes, and all-to-all splits agree pairwise
    (what rank r sends to s is what s receives from r)."""
    first = sequences[0]
    for rank, sequence in enumerate(sequences):
        for i, (mine, theirs) in enumerate(zip(sequence, first)):
            if mine.shape() != theirs.shape():
                raise NcclRuleError(
                    f"collective {i}: rank {rank} issued {mine.shape()}, rank 0 {theirs.shape()}; NCCL would hang or "
                    "mix the two"
                )
        if len(sequence) != len(first):
            raise NcclRuleError(
                f"rank {rank} issued {len(sequence)} collectives, rank 0 {len(first)}: the rank with more waits forever"
            )
    for i, entries in enumerate(zip(*sequences)):
        if entries[0].splits is None:
            continue
        for r, mine in enumerate(entries):
            for s, theirs in enumerate(entries):
                if mine.splits[0][s] != theirs.splits[1][r]:
                    raise NcclRuleError(
                        f"all_to_all {i}: rank {r} sends {mine.splits[0][s]} elements to rank {s}, which expects "
                        f"{theirs.splits[1][r]}"
                    )
