"""A second rank, emulated: a process group that acts on the streams as NCCL does, on one device.

NCCL refuses two ranks on one GPU, so ``benchmarks/gpu_overlap.py`` runs rank 0 of a world of 2
on ``EmulatedGroup``, registered as the torch.distributed backend ``"hf_lowzero_emulated"``.
``hf_lowzero.zero.runtime.comm`` takes NCCL's code paths for it (its ``stands_for`` is ``"nccl"``), so the
optimizer issues what it would issue under NCCL: ``_reduce_scatter_base``/``reduce_scatter_single``,
``_allgather_base``/``all_gather_single``, ``allreduce``, ``alltoall_base`` and ``barrier``.

# [Note: emulated collectives]
# Each collective does, on the streams, what ProcessGroupNCCL does:
# 1. Issue: the group's side stream (one per device, as NCCL has one per communicator) waits for
#    the work queued so far on the current stream.
# 2. The kernel, on the real bytes, on the side stream. The peers' contributions are this rank's
#    own data: a reduce-scatter writes W times this rank's chunk (``chunk + (W-1) * chunk``; the
#    optimizer divided the gradients by W first, so the sum is the gradient itself), an all-gather
#    writes this rank's input into every rank's chunk, an all-reduce sums W copies.
# 3. The wire: a sleep on the side stream for what one rank sends in a ring, (W-1)/W of the payload
#    (twice that for an all-reduce), over ``Wire.gb_per_s``; only for the kinds in
#    ``Wire.sleeping``. On CUDA ``torch.cuda._sleep`` spins for cycles: ``calibrate_sleep`` measures
#    its cycles per second.
# 4. An event after them. ``work.wait()`` makes the stream that is current at the wait wait for it,
#    with no host sync (WorkNCCL::wait), and drops the tensors the work held until then (NCCL keeps
#    them stashed until the wait, so the caching allocator cannot hand their memory out early).
#    A barrier's wait also blocks the host, as NCCL's does.
# On CPU the side stream is one worker thread (first in, first out, as a stream is) that runs the
# kernel and a ``time.sleep``; ``wait()`` joins that job.
# Left out: NCCL's kernels hold SMs for the whole transfer (the sleep spins one thread), NCCL's
# fixed latency per call, and the bandwidth a real transfer takes from HBM or PCIe.

Example::

    wire = Wire(gb_per_s=100.0, cycles_per_s=calibrate_sleep(device))
    with emulated_world(2, wire):                          # this process is rank 0 of 2
        opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2)
        wire.sleeping = frozenset({"reduce_scatter"})      # only reduce-scatters cross the wire
        ...
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BACKEND = "hf_lowzero_emulated"
KINDS = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")
CALIBRATION_CYCLES = (1_000_000, 20_000_000)  # about 0.5 and 10 ms at 2 GHz: the slope cancels the launch


@dataclass
class Wire:
    """The link every emulated collective crosses, shared by the groups of one ``emulated_world``."""

    gb_per_s: float = 100.0  # the link's bandwidth per rank (NCCL's "bus bandwidth"), 1e9 bytes/s
    sleeping: frozenset[str] = frozenset()  # the kinds (of KINDS) that sleep for their wire time
    cycles_per_s: float | None = None  # CUDA: torch.cuda._sleep's rate (calibrate_sleep)
    payload_bytes: Counter = field(default_factory=Counter)  # per kind, every call since the last reset
    slept: list[tuple[str, Callable[[], float]]] | None = None  # when a list: (kind, seconds once synced)

    def wire_seconds(self, kind: str, payload: int, world_size: int) -> float:
        return wire_seconds(kind, payload, world_size, self.gb_per_s)

    def slept_seconds(self) -> Counter:
        """Seconds slept per kind since ``slept`` was set to a list (call after a synchronize)."""
        total: Counter = Counter()
        for kind, seconds in self.slept or []:
            total[kind] += seconds()
        return total


def wire_seconds(kind: str, payload: int, world_size: int, gb_per_s: float) -> float:
    """Seconds one rank's share of a collective of ``payload`` bytes (the whole tensor) takes on a
    link of ``gb_per_s``: what it sends in a ring, (W-1)/W of the payload, twice for an all-reduce."""
    factor = 2 if kind == "all_reduce" else 1
    return factor * payload * (world_size - 1) / world_size / (gb_per_s * 1e9)


def calibrate_sleep(device: torch.device) -> float:
    """``torch.cuda._sleep``'s cycles per second on ``device`` (median of three slopes)."""
    stream = torch.cuda.Stream(device=device)
    rates = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1000)  # the first launch loads the kernel
        for _ in range(3):
            seconds = []
            for cycles in CALIBRATION_CYCLES:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                torch.cuda._sleep(cycles)
                end.record(stream)
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1000)
            rates.append((CALIBRATION_CYCLES[1] - CALIBRATION_CYCLES[0]) / (seconds[1] - seconds[0]))
    return statistics.median(rates)


class _StreamWork(dist.distributed_c10d.Work):
    """A CUDA collective: ``wait()`` orders the current stream after ``done`` (step 4 of the note)."""

    def __init__(self, done: torch.cuda.Event, device: torch.device, held: list, host_waits: bool) -> None:
        super().__init__()
        self._done, self._device, self._held, self._host_waits = done, device, held, host_waits

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream(self._device).wait_event(self._done)
        if self._host_waits:
            self._done.synchronize()
        self._held = []
        return True


class _ThreadWork(dist.distributed_c10d.Work):
    """A CPU collective: ``wait()`` joins its job on the group's worker thread."""

    def __init__(self, job: Future, held: list) -> None:
        super().__init__()
        self._job, self._held = job, held

    def wait(self, timeout=None) -> bool:
        self._job.result()  # raises what the kernel raised
        self._held = []
        return True


class EmulatedGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size``, alone in this process; see [Note: emulated collectives]."""

    def __init__(self, rank: int, size: int, wire: Wire) -> None:
        super().__init__(rank, size)
        self.wire = wire
        self.stands_for = "nccl"  # hf_lowzero.zero.runtime.comm.backend: take NCCL's code paths
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._last_device = torch.device("cpu")

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    # ----------------------------------------------------------------------- collectives

    def allreduce(self, tensors, opts=None):
        (t,) = tensors
        summed = opts is None or opts.reduceOp == dist.ReduceOp.SUM  # MAX, MIN of equal copies: unchanged
        copies = self.size() - 1

        def kernel() -> None:
            if summed and copies:
                t.add_(t, alpha=copies)

        return self._issue("all_reduce", _nbytes(t), [t], kernel)

    def reduce_scatter_single(self, output, input, opts=None):
        chunk = self._chunks(input, output.numel(), "reduce_scatter")[self.rank()]
        copies = self.size() - 1

        def kernel() -> None:
            torch.add(chunk, chunk, alpha=copies, out=output)

        return self._issue("reduce_scatter", _nbytes(input), [output, input], kernel)

    _reduce_scatter_base = reduce_scatter_single  # torch 2.11's name

    def all_gather_single(self, output, input, opts=None):
        chunks = self._chunks(output, input.numel(), "all_gather")

        def kernel() -> None:
            for chunk in chunks:
                if chunk.data_ptr() != input.data_ptr():  # an in-place gather's own chunk is there already
                    chunk.copy_(input)

        return self._issue("all_gather", _nbytes(output), [output, input], kernel)

    _allgather_base = all_gather_single  # torch 2.11's name

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.size()
        outs = list(output_split_sizes) or [output.numel() // size] * size
        ins = list(input_split_sizes) or [input.numel() // size] * size
        own = input.split(ins)[self.rank()]  # what this rank sends itself; every peer sends the same

        def kernel() -> None:
            for piece in output.split(outs):
                n = min(piece.numel(), own.numel())
                piece[:n].copy_(own[:n])

        return self._issue("all_to_all", _nbytes(input), [output, input], kernel)

    def barrier(self, opts=None):
        device = getattr(opts, "device", None)
        device = torch.device(device) if device is not None else self._last_device
        if device.type == "cuda":
            return self._on_side_stream(device, "barrier", 0.0, [], lambda: None, host_waits=True)
        return self._on_worker("barrier", 0.0, [], lambda: None)

    def object_collective(self, op: str, obj, device: torch.device | None) -> list:
        """``comm.all_gather_object``/``gather_object``: every peer's object is this rank's."""
        return [obj] * self.size()

    # ------------------------------------------------------------------------ the streams

    def _chunks(self, whole: torch.Tensor, numel: int, op: str) -> list[torch.Tensor]:
        if whole.numel() != self.size() * numel:
            raise ValueError(
                f"{op}: {whole.numel()} elements for chunks of {numel} at world size {self.size()}; NCCL needs "
                "the whole tensor to be W times the chunk"
            )
        return list(whole.view(self.size(), numel))

    def _issue(self, kind: str, payload: int, tensors: list[torch.Tensor], kernel: Callable[[], None]):
        self.wire.payload_bytes[kind] += payload
        sleeps = kind in self.wire.sleeping and self.size() > 1
        seconds = self.wire.wire_seconds(kind, payload, self.size()) if sleeps else 0.0
        if self.size() == 1:
            kernel = _nothing  # one rank: the data is the result
        device = tensors[0].device
        self._last_device = device
        if device.type == "cuda":
            return self._on_side_stream(device, kind, seconds, tensors, kernel, host_waits=False)
        return self._on_worker(kind, seconds, tensors, kernel)

    def _on_side_stream(self, device, kind, seconds, tensors, kernel, host_waits):
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # 1. after the work queued so far
        with torch.cuda.stream(side):
            kernel()  # 2.
            if seconds > 0:  # 3.
                self._sleep_on(side, kind, int(seconds * self._cycles_per_s()))
            done = torch.cuda.Event()
            done.record(side)
        return _StreamWork(done, device, tensors, host_waits)  # 4.

    def _cycles_per_s(self) -> float:
        if self.wire.cycles_per_s is None:
            raise RuntimeError("an emulated collective sleeps on CUDA, but the Wire has no cycles_per_s: set it to "
                               "calibrate_sleep(device) first")  # fmt: skip
        return self.wire.cycles_per_s

    def _sleep_on(self, stream: torch.cuda.Stream, kind: str, cycles: int) -> None:
        if self.wire.slept is None:
            torch.cuda._sleep(cycles)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        torch.cuda._sleep(cycles)
        end.record(stream)
        self.wire.slept.append((kind, lambda: start.elapsed_time(end) / 1000))

    def _on_worker(self, kind, seconds, tensors, kernel):
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-nccl")
        slept = self.wire.slept

        def job() -> None:
            kernel()
            if seconds > 0:
                start = time.perf_counter()
                time.sleep(seconds)
                took = time.perf_counter() - start
                if slept is not None:
                    slept.append((kind, lambda: took))

        return _ThreadWork(self._worker.submit(job), tensors)

    def shutdown(self) -> None:
        """Finish the CPU worker's jobs and stop it."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _nothing() -> None:
    pass


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_WIRES: list[Wire] = []
_GROUPS: list[EmulatedGroup] = []


def _create(store, rank: int, size: int, timeout) -> EmulatedGroup:
    group = EmulatedGroup(rank, size, _WIRES[-1])
    _GROUPS.append(group)
    return group


@contextlib.contextmanager
def emulated_world(world_size: int, wire: Wire) -> Iterator[None]:
    """Within: the default process group is an ``EmulatedGroup`` of ``world_size`` with this
    process as rank 0; ``dist.new_group([0], backend=BACKEND)`` makes a world of one beside it.
    Every group's collectives cross ``wire``."""
    if dist.is_initialized():
        raise RuntimeError("an emulated world needs a process without a process group")
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    _WIRES.append(wire)
    try:
        dist.init_process_group(BACKEND, rank=0, world_size=world_size, store=dist.HashStore())
        try:
            yield
        finally:
            dist.destroy_process_group()
            for group in _GROUPS:
                group.shutdown()
            _GROUPS.clear()
    finally:
        _WIRES.remove(wire)
