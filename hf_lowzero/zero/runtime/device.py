"""Every use of CUDA streams, events, page-locked host memory and the current CUDA device.

The rest of the optimizer, the snapshot stager and the collectives call these functions and never
``torch.cuda`` directly. That does two things:

- **Device discipline.** Every stream, event and device context is taken for a device given
  explicitly, the params' device, never the current CUDA device. A user who moved the model with
  ``model.to(f"cuda:{rank}")`` and never called ``torch.cuda.set_device`` gets the same ordering
  as one who did ([Note: the params' device]).
- **A stand-in.** A simulation of the GPU step on fake CUDA tensors (``hf_lowzero.simulation``)
  replaces the implementation with one whose streams and events check the ordering of every
  access (``use_ops``). On a CPU device all of this is a no-op: ``side_stream`` returns None and
  every function taking a stream or an event accepts None.

Example::

    stream = side_stream(device)                     # None on CPU
    ready = record_event(current_stream(device))     # after the work queued so far
    stream_waits(stream, ready)
    with on_stream(stream):
        host.copy_(chunk, non_blocking=True)
    done = record_event(stream)
    host_waits(done)                                 # before the host reads ``host``

# [Note: the params' device]
# Streams, events, barriers and object collectives follow the params' device explicitly. Left to
# the current device, three things break when it differs from the params' (``model.to("cuda:1")``
# without ``torch.cuda.set_device(1)``): an event recorded on the current device's stream orders
# nothing on the params' device (offload's copy of a reduced gradient could read it before the
# reduce-scatter wrote it; a snapshot could copy rows mid-step), and NCCL barriers and object
# collectives run on GPU 0 for every rank, which hangs or crosses devices.

# [Note: exact pinned memory]
# torch's caching host allocator (``pin_memory=True``) rounds every page-locked allocation up to
# a power of two: a 1.1 GiB offloaded master buffer takes 2 GiB of locked RAM. ``host_buffer``
# allocates ordinary host memory of the exact size and page-locks it with ``cudaHostRegister``
# (as torch's distributed checkpoint stager does), unlocked when the tensor is freed, so pinned
# buffers take what ``memory_report()`` and the memory plan say they take. Both calls run with the
# params' device current ([Note: the params' device]): the CUDA runtime makes a context on the
# current device at its first call there, half a GiB of GPU 0 for every rank that never called
# ``torch.cuda.set_device`` otherwise.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

PAGE_BYTES = 4096


class CudaOps:
    """The real implementation, on ``torch.cuda``. Only called for CUDA devices."""

    name = "cuda"

    def __init__(self) -> None:
        self._pinned: dict[int, int] = {}  # storage data pointer -> bytes locked

    def side_stream(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def on_stream(self, stream):
        return torch.cuda.stream(stream)

    def record_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def stream_waits(self, stream, event) -> None:
        stream.wait_event(event)

    def stream_waits_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def host_waits(self, event) -> None:
        event.synchronize()

    def event_done(self, event) -> bool:
        return event.query()

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def on_device(self, device: torch.device):
        return torch.cuda.device(device)

    def pinned_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked in the current device's context (``host_buffer`` makes the params' device current)."""
        tensor = torch.empty(numel, dtype=dtype)
        storage = tensor.untyped_storage()
        nbytes, pointer = storage.nbytes(), storage.data_ptr()
        if nbytes == 0:
            return tensor
        device = torch.cuda.current_device()
        error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
        if error != 0:
            raise RuntimeError(
                f"page-locking {nbytes} bytes of host memory failed (cudaHostRegister error {error}); "
                "the node may be out of lockable memory (ulimit -l), or pass pin_memory=False"
            )
        self._pinned[pointer] = _page_rounded(nbytes)
        finalizer = weakref.finalize(tensor, self._unpin, pointer, device)
        finalizer.atexit = False  # never after the CUDA context is gone
        return tensor

    def _unpin(self, pointer: int, device: int) -> None:
        self._pinned.pop(pointer, None)
        with torch.cuda.device(device):  # where it was registered, whatever is current when it is freed
            torch.cuda.cudart().cudaHostUnregister(pointer)

    def pinned_footprint(self, tensor: torch.Tensor) -> int:
        if not self._pinned:  # nothing pinned (and no data pointer read: a memory plan's fake tensors)
            return 0
        return self._pinned.get(tensor.untyped_storage().data_ptr(), 0)

    def phase(self, name: str):
        return contextlib.nullcontext()

    def mark_stale(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        pass

    def mark_current(self, tensors: list[torch.Tensor]) -> None:
        pass


def _page_rounded(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


_ACTIVE: list[Any] = [CudaOps()]


def ops():
    """The implementation in use: ``CudaOps``, or a simulation's stand-in (``use_ops``)."""
    return _ACTIVE[-1]


@contextlib.contextmanager
def use_ops(stand_in) -> Iterator[None]:
    """Within: every function of this module goes to ``stand_in`` (the same methods as ``CudaOps``)."""
    _ACTIVE.append(stand_in)
    try:
        yield
    finally:
        _ACTIVE.remove(stand_in)


def is_cuda(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def side_stream(device: torch.device):
    """A new stream on ``device`` for work that overlaps the compute stream; None on CPU."""
    return ops().side_stream(device) if is_cuda(device) else None


def current_stream(device: torch.device):
    """``device``'s current stream (where its compute runs); None on CPU."""
    return ops().current_stream(device) if is_cuda(device) else None


def on_stream(stream):
    """Within: work on the stream's device goes to ``stream`` (nothing changes for None)."""
    return contextlib.nullcontext() if stream is None else ops().on_stream(stream)


def record_event(stream):
    """An event that completes once the work queued on ``stream`` so far did (None for None)."""
    return None if stream is None else ops().record_event(stream)


def stream_waits(stream, event) -> None:
    """Work queued on ``stream`` from now on starts after ``event`` completed."""
    if stream is not None and event is not None:
        ops().stream_waits(stream, event)


def stream_waits_stream(stream, other) -> None:
    """Work queued on ``stream`` from now on starts after the work queued on ``other`` so far."""
    if stream is not None and other is not None:
        ops().stream_waits_stream(stream, other)


def host_waits(event) -> None:
    """Block the host until ``event`` completed."""
    if event is not None:
        ops().host_waits(event)


def event_done(event) -> bool:
    """Whether ``event`` completed, asked without waiting (``cudaEventQuery``); True for None. When
    it says so, the host may read what the work before the event wrote."""
    return event is None or ops().event_done(event)


def keep_alive(tensor: torch.Tensor, stream) -> None:
    """The caching allocator may reuse ``tensor``'s memory only after the work queued on
    ``stream`` so far (``Tensor.record_stream``)."""
    if stream is not None:
        ops().keep_alive(tensor, stream)


def on_device(device: torch.device | None):
    """Within: ``device`` is the current CUDA device (for torch code that takes the current
    device, such as NCCL's object collectives); nothing changes for a CPU device or None."""
    return ops().on_device(device) if is_cuda(device) else contextlib.nullcontext()


def phase(name: str):
    """Within: the work belongs to ``name`` (``"gather"``), for a simulation that counts host syncs
    per phase; nothing on a real GPU or the CPU."""
    return ops().phase(name)


def mark_stale(tensors: list[torch.Tensor], names: list[str]) -> None:
    """``tensors`` (params named ``names``) hold outdated values until :func:`mark_current`: their
    all-gather is in flight ([Note: overlapped all-gather] in ``update/allgather.py``). A simulation fails
    any read of them meanwhile; nothing happens on a real GPU or the CPU."""
    if tensors and is_cuda(tensors[0].device):
        ops().mark_stale(tensors, names)


def mark_current(tensors: list[torch.Tensor]) -> None:
    """``tensors`` are about to receive their current values (see :func:`mark_stale`)."""
    if tensors and is_cuda(tensors[0].device):
        ops().mark_current(tensors)


def host_buffer(numel: int, dtype: torch.dtype, pin_for: torch.device | None, zero: bool = True) -> torch.Tensor:
    """A host tensor of ``numel`` elements (zeroed unless ``zero=False``), page-locked at exactly its
    size for the CUDA device ``pin_for`` (the params'), registered with it current ([Note: exact
    pinned memory]); ordinary memory when ``pin_for`` is None or not a CUDA device."""
    if not is_cuda(pin_for):
        return torch.zeros(numel, dtype=dtype) if zero else torch.empty(numel, dtype=dtype)
    with on_device(pin_for):
        tensor = ops().pinned_empty(numel, dtype)
    return tensor.zero_() if zero else tensor


def pinned_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of host memory page-locked for the distinct storages behind ``tensors`` by
    ``host_buffer`` (whole pages)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == "cpu":
            seen[t.untyped_storage()._cdata] = ops().pinned_footprint(t)
    return sum(seen.values())
