"""Pinned host buffers through ``CudaOps`` with the CUDA runtime stood in (no GPU here): locked at
their exact size ([Note: exact pinned memory] in ``zero/runtime/device.py``), with the params' device
current, and unlocked there when freed. The fake-GPU simulation checks the device too
(``tests/test_gpu_path.py``: "pinned on the current device")."""

import contextlib
import weakref

import torch


class _Cudart:
    """Stands in for the CUDA runtime's page-locking calls and its current device (no GPU here)."""

    def __init__(self) -> None:
        self.current = 0  # the current device: 0, as for a rank that never called torch.cuda.set_device
        self.registered: dict[int, tuple[int, int]] = {}  # pointer -> (bytes, the device current then)
        self.unregistered: list[tuple[int, int]] = []  # (pointer, the device current then)

    @contextlib.contextmanager
    def device(self, device):  # torch.cuda.device
        previous, self.current = self.current, device if isinstance(device, int) else torch.device(device).index
        try:
            yield
        finally:
            self.current = previous

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered[pointer] = (size, self.current)
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        self.unregistered.append((pointer, self.current))
        return 0


def test_pinned_buffers_are_locked_at_their_exact_size_on_the_params_device_and_unlocked_when_freed(monkeypatch):
    """Registered and unregistered with the params' device current (cuda:1 here, with cuda:0 current):
    the CUDA runtime would make a context on the current device otherwise."""
    from hf_lowzero.zero.runtime import device as dev

    cudart = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "device", cudart.device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cudart.current)
    ops = dev.CudaOps()
    with dev.use_ops(ops):
        buffer = dev.host_buffer(3_000_001, torch.float32, torch.device("cuda", 1))
        pointer = buffer.untyped_storage().data_ptr()
        # not 16 MiB (torch's allocator rounds to 2**24), and on cuda:1, not the current cuda:0
        assert cudart.registered == {pointer: (12_000_004, 1)} and cudart.current == 0
        assert torch.count_nonzero(buffer) == 0
        assert dev.pinned_bytes([buffer, buffer[5:]]) == 12_001_280  # whole pages, counted once
        freed = weakref.ref(buffer)
        del buffer
        assert freed() is None and cudart.unregistered == [(pointer, 1)] and dev.pinned_bytes([]) == 0
        assert dev.host_buffer(7, torch.float32, None).is_pinned() is False and len(cudart.registered) == 1
