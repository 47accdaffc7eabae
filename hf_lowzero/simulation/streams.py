"""Fake CUDA streams and events that check the order of every access, for a step on fake tensors.

``FakeCudaOps`` stands in for ``hf_lowzero.zero.runtime.device.CudaOps`` (``device.use_ops``): streams and
events are Python objects, pinned buffers fake host tensors. ``AccessChecker``, a dispatch mode
entered inside ``FakeTensorMode``, sees every tensor operation and tracks who may see whose writes,
as CUDA orders them ([Note: ordering model]); an access that CUDA would not order after a conflicting
one raises ``RaceError``, naming both. The NCCL stand-in (``nccl.py``) reports its collectives here.

Example::

    checker = AccessChecker()
    ops = FakeCudaOps(checker)
    with FakeTensorMode(), checker, device.use_ops(ops):
        ...   # the real step on fake cuda tensors

# [Note: ordering model]
# Contexts are the host and every stream (a device's default compute stream, side streams, NCCL's
# internal stream per device). Each holds a vector clock: how far it has seen every context.
# - An operation on CUDA tensors runs on the current stream of their device (``FakeCudaOps`` keeps
#   it per device: ``on_stream`` changes it); one on host tensors only runs on the host.
# - The host queues stream work, so a stream sees everything the host did before (it takes the
#   host's clock when work is queued on it).
# - A stream sees another's work only through events: ``record_event`` captures a stream's clock,
#   ``stream_waits`` (``cudaStreamWaitEvent``) and ``host_waits`` (``cudaEventSynchronize``)
#   merge it. A blocking copy to or from the host, or reading a CUDA scalar (``.item()``), makes
#   the host wait for the stream.
# - A non-blocking copy between the device and pinned host memory touches the host memory from the
#   stream, later; with pageable memory it is done when the call returns (CUDA stages it).
# - An NCCL collective runs on NCCL's stream, which first waits for the current stream; its work
#   handle's ``wait()`` makes the current stream wait for it.
# Each storage remembers, per byte range, who wrote it last and who read it since; a read must see
# the writes it overlaps, a write also the reads. A view's range is the span its elements cover.
# Not modelled: the caching allocator's reuse of freed memory (``record_stream``'s concern).
# Every point where the host waits for a stream (a scalar read, a blocking copy, an event
# synchronized) is a host sync, counted against the phase the host is in (``syncs``). A read of a
# param whose all-gather is in flight (``FakeCudaOps.mark_stale``) raises ``StaleReadError``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HOST = "host"


class RaceError(RuntimeError):
    """Two accesses of one storage that CUDA would not order: a real GPU could run them either way."""


class WrongDeviceError(RuntimeError):
    """A CUDA runtime call made with another device current than this rank's GPU: on a real GPU it
    makes a CUDA context there ([Note: the params' device] in ``zero/runtime/device.py``)."""


class StaleReadError(RuntimeError):
    """A param read while its all-gather is in flight: it holds the previous step's values
    ([Note: overlapped all-gather] in ``zero/update/allgather.py``)."""


@dataclass(eq=False)
class FakeStream:
    device: torch.device
    name: str  # "compute", "side 1", "nccl", ...

    @property
    def key(self) -> tuple[int, str]:
        return (self.device.index or 0, self.name)

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}>"


@dataclass(eq=False)
class FakeEvent:
    clock: dict
    where: str


@dataclass
class _Access:
    storage: weakref.ref  # the storage this history belongs to (an address can be reused once it is freed)
    records: list = field(default_factory=list)  # (start, end, context, time, what, write), byte ranges


class AccessChecker(TorchDispatchMode):
    """Checks that every access is ordered after the conflicting ones ([Note: ordering model]).

    ``current`` maps a device index to its current stream (set by ``FakeCudaOps``); ``pinned``
    holds the storages of pinned host buffers. Data-dependent reads that a fake tensor cannot
    answer get fixed stand-ins: a CUDA or host scalar reads as 1 (a finite gradient norm) and
    ``nonzero`` finds nothing (every parameter used).
    """

    def __init__(self) -> None:
        super().__init__()
        self.clocks: dict = {HOST: {HOST: 0}}
        self.storages: dict[int, _Access] = {}
        self.current: dict[int, FakeStream] = {}
        self.pinned: set[int] = set()
        self.caching_pinned: list[str] = []  # allocations through torch's caching host allocator
        self.accesses = 0
        self.stale: dict[int, str] = {}  # storage -> the param's name, while its all-gather is in flight
        self.phase = "setup"  # what the host is doing: forward, backward, step, gather (set by the driver)
        self.syncs: Counter = Counter()  # host syncs per phase: the host waited for a stream
        self.sync_sites: list[tuple[str, str]] = []  # (phase, the hf_lowzero line that made it), in order
        self._names = itertools.count(1)

    # ------------------------------------------------------------------ streams and events

    def stream(self, device: torch.device, name: str | None = None) -> FakeStream:
        stream = FakeStream(device, name or f"side {next(self._names)}")
        self.clocks.setdefault(stream.key, {stream.key: 0})
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        index = device.index or 0
        if index not in self.current:
            self.current[index] = self.stream(torch.device("cuda", index), "compute")
        return self.current[index]

    def snapshot(self, context) -> dict:
        return dict(self._clock(context))

    def host_sync(self, clock: dict) -> None:
        """The host waits until a stream reached ``clock`` (an event's, or a stream's now): counted
        against the current phase."""
        self.syncs[self.phase] += 1
        self.sync_sites.append((self.phase, _caller()))
        self.merge(HOST, clock)

    def merge(self, context, clock: dict) -> None:
        mine = self._clock(context)
        for other, time in clock.items():
            if time > mine.get(other, -1):
                mine[other] = time

    def _clock(self, context) -> dict:
        key = context.key if isinstance(context, FakeStream) else context
        return self.clocks.setdefault(key, {key: 0})

    def _tick(self, context) -> int:
        key = context.key if isinstance(context, FakeStream) else context
        clock = self._clock(key)
        if key != HOST:
            self.merge(key, self.clocks[HOST])  # the host queued this work: it sees the host's past
        clock[key] = clock.get(key, 0) + 1
        return clock[key]

    # -------------------------------------------------------------------------- accesses

    def access(self, context, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str) -> None:
        """``context`` (the host or a stream) reads ``reads`` and writes ``writes`` now."""
        key = context.key if isinstance(context, FakeStream) else context
        time = self._tick(key)
        clock = self._clock(key)
        self.accesses += 1
        for t in reads:
            if _tracked(t):
                self._touch(t, key, clock, time, what, write=False)
        for t in writes:
            if _tracked(t):
                self._touch(t, key, clock, time, what, write=True)

    def _touch(self, t: torch.Tensor, key, clock: dict, time: int, what: str, write: bool) -> None:
        if not write and self.stale and _storage(t) in self.stale:
            raise StaleReadError(
                f"{what} reads parameter {self.stale[_storage(t)]!r} while its all-gather is in flight: on a GPU it "
                "would see the previous step's values. A param must be read in the forward of a module that holds "
                "it, or after LowLevelZeroOptimizer.wait_for_params() ([Note: overlapped all-gather] in "
                "zero/update/allgather.py)."
            )
        state = self._history(t)
        start, end = _span(t)
        kept = []
        for record in state.records:
            r_start, r_end, ctx, r_time, r_what, r_write = record
            overlaps = r_start < end and start < r_end
            if overlaps and (write or r_write) and ctx != key and clock.get(ctx, 0) < r_time:
                action = "writes" if write else "reads"
                raise RaceError(
                    f"{_name(key)} {action} memory that {_name(ctx)} accessed ({r_what}) without waiting for it: "
                    f"{what} could run before that access completes on a real GPU. Order it with an event "
                    "(hf_lowzero.zero.runtime.device: record_event, stream_waits, host_waits)."
                )
            # A write supersedes what it covers (everything after it is checked against it); a read
            # supersedes this context's earlier reads of the range.
            covered = start <= r_start and r_end <= end
            if covered and (write or (ctx == key and not r_write)):
                continue
            kept.append(record)
        kept.append((start, end, key, time, what, write))
        state.records = kept

    def _history(self, t: torch.Tensor) -> _Access:
        storage = t.untyped_storage()
        state = self.storages.get(storage._cdata)
        if state is None or state.storage() is not storage:  # none yet, or a freed storage's address
            state = self.storages[storage._cdata] = _Access(weakref.ref(storage))
        return state

    # ------------------------------------------------------------------ the dispatch mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory") or func in (aten._pin_memory.default, aten.pin_memory.default):
            # rounded up to a power of two ([Note: exact pinned memory] in zero/runtime/device.py)
            self.caching_pinned.append(str(func))
        if func is aten._local_scalar_dense.default:
            (t,) = args
            if t.device.type == "cuda":
                self.access(self.current_stream(t.device), [t], [], f"{func} (a scalar read on the host)")
                self.host_sync(self.snapshot(self.current_stream(t.device)))  # .item() waits for the stream
            else:
                self.access(HOST, [t], [], str(func))
            return True if t.dtype == torch.bool else 1 if not t.is_floating_point() else 1.0
        if func is aten.nonzero.default:
            (t,) = args
            self.access(self._context_of([t]), [t], [], str(func))
            return torch.empty((0, t.dim()), dtype=torch.long, device=t.device)
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        mutated = _mutated(func, args, kwargs)
        if not mutated and (_is_view(func) or func in _METADATA_ONLY or not _tensors([out])):
            return  # reads no data: a view, a query of shapes or devices, a tensor made like another
        inputs = [t for t in _tensors(args) + _tensors(list(kwargs.values())) if isinstance(t, torch.Tensor)]
        fresh = [t for t in _tensors([out]) if isinstance(t, torch.Tensor)]
        born = [t for t in fresh if not any(_storage(t) == _storage(i) for i in inputs)]
        for t in born:  # new memory (a freed storage's address may come back): no history
            self.storages.pop(_storage(t), None)
        outputs = mutated + born
        everything = inputs + fresh
        if not everything:
            return
        devices = {t.device.type for t in everything if t.dim() > 0 or t.device.type == "cuda"}
        what = str(func.__name__ if hasattr(func, "__name__") else func)
        if devices == {"cuda", "cpu"}:
            self._copy(func, args, kwargs, inputs, outputs, what)
            return
        self.access(self._context_of(everything), inputs, outputs, what)

    def _context_of(self, tensors: list[torch.Tensor]):
        cuda = [t for t in tensors if t.device.type == "cuda"]
        return self.current_stream(cuda[0].device) if cuda else HOST

    def _copy(self, func, args, kwargs, inputs, outputs, what: str) -> None:
        """A copy between host and device memory: on the device's current stream; the host waits
        for it unless it is non-blocking with pinned host memory ([Note: ordering model])."""
        device = next(t.device for t in inputs + outputs if t.device.type == "cuda")
        stream = self.current_stream(device)
        host = [t for t in inputs + outputs if t.device.type == "cpu" and t.dim() > 0]
        non_blocking = bool(kwargs.get("non_blocking", False)) or (
            func in (aten.copy_.default,) and len(args) > 2 and bool(args[2])
        )
        asynchronous = non_blocking and all(_storage(t) in self.pinned for t in host)
        self.access(stream, inputs, outputs, what + (" (non-blocking, pinned)" if asynchronous else ""))
        if not asynchronous:
            self.host_sync(self.snapshot(stream))


class FakeCudaOps:
    """The stand-in for ``hf_lowzero.zero.runtime.device.CudaOps`` on fake tensors, reporting to ``checker``.

    ``current_device`` is the CUDA device current in this process (0: a user who never called
    ``torch.cuda.set_device``); ``on_device`` changes it, and the NCCL stand-in checks object
    collectives against it. ``device``: this rank's GPU (the params'), where page-locking must run
    (``cudaHostRegister`` makes a context on the current device); None: not checked."""

    name = "fake cuda"

    def __init__(self, checker: AccessChecker, device: torch.device | None = None) -> None:
        self.checker = checker
        self.device = device
        self.current_device = 0
        self.pinned_allocations: list[int] = []  # bytes of each pinned buffer, in allocation order
        self.observer = None  # a StepObserver (observer.py): told every event, wait and collective

    def side_stream(self, device: torch.device) -> FakeStream:
        return self.checker.stream(torch.device(device))

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.checker.current_stream(torch.device(device))

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[None]:
        index = stream.device.index or 0
        previous = self.checker.current_stream(stream.device)
        self.checker.current[index] = stream
        try:
            yield
        finally:
            self.checker.current[index] = previous

    def record_event(self, stream: FakeStream) -> FakeEvent:
        event = FakeEvent(self.checker.snapshot(stream), repr(stream))
        if self.observer is not None:
            self.observer.event_recorded(stream, event)
        return event

    def stream_waits(self, stream: FakeStream, event: FakeEvent) -> None:
        self.checker.merge(stream, event.clock)
        if self.observer is not None:
            self.observer.stream_waits(stream, event)

    def stream_waits_stream(self, stream: FakeStream, other: FakeStream) -> None:
        self.checker.merge(stream, self.checker.snapshot(other))
        if self.observer is not None:
            self.observer.stream_waits_stream(stream, other)

    def host_waits(self, event: FakeEvent) -> None:
        self.checker.host_sync(event.clock)
        if self.observer is not None:
            self.observer.host_waits(event)

    def event_done(self, event: FakeEvent) -> bool:
        # Known done only when the host already waited past it (a later sync covered it); otherwise the
        # query answers "not yet", the answer a real GPU gives when the work is slow.
        host = self.checker.snapshot(HOST)
        return all(host.get(context, -1) >= time for context, time in event.clock.items())

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        pass  # the fake allocator never reuses memory ([Note: ordering model])

    @contextlib.contextmanager
    def on_device(self, device: torch.device) -> Iterator[None]:
        previous, self.current_device = self.current_device, torch.device(device).index or 0
        try:
            yield
        finally:
            self.current_device = previous

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.device is not None and self.current_device != (self.device.index or 0):
            raise WrongDeviceError(
                f"cudaHostRegister with cuda:{self.current_device} current, but this rank's GPU is {self.device}: it "
                "makes a CUDA context on the current device (half a GiB of GPU 0 for every rank that never called "
                "torch.cuda.set_device); page-lock under the params' device (device.host_buffer's pin_for)"
            )
        tensor = torch.empty(numel, dtype=dtype)
        self.checker.pinned.add(_storage(tensor))
        self.pinned_allocations.append(tensor.untyped_storage().nbytes())
        return tensor

    def pinned_footprint(self, tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().nbytes() if _storage(tensor) in self.checker.pinned else 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.checker.phase = self.checker.phase, name
        try:
            yield
        finally:
            self.checker.phase = previous

    def mark_stale(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        for t, name in zip(tensors, names):
            self.checker.stale[_storage(t)] = name

    def mark_current(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self.checker.stale.pop(_storage(t), None)


# Ops that read no data of their tensor inputs (only shape, dtype and device).
_METADATA_ONLY = frozenset(
    getattr(aten, name).default
    for name in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
) | frozenset(
    getattr(aten, name).default for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
)


def _is_view(func) -> bool:
    """An op whose outputs alias its inputs without writing them (``view``, ``slice``, ``detach``)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` covers: from its first element to its last."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * abs(stride) for n, stride in zip(t.shape, t.stride()))
    return start, start + extent * size


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tracked(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and (t.dim() > 0 or t.device.type == "cuda")


def _tensors(values) -> list:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_tensors(v))
    return found


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes (in-place and ``out=`` arguments, from its schema)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        written.extend(_tensors([value]))
    return written


def _name(key) -> str:
    return "the host" if key == HOST else f"the {key[1]} stream of cuda:{key[0]}"


def _caller() -> str:
    """The innermost hf_lowzero line outside this simulation on the stack: where a host sync came from."""
    import traceback

    for frame in reversed(traceback.extract_stack()):
        if "hf_lowzero" in frame.filename and "simulation" not in frame.filename:
            return f"{frame.filename.rsplit('hf_lowzero/', 1)[-1]}:{frame.lineno} {frame.line}"
    return "?"
