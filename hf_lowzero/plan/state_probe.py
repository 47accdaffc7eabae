"""The optimizer state an inner optimizer keeps, found by stepping it on real tensors.

torch's own optimizers run under ``FakeTensorMode``, so a simulated step creates their state like a
real one. Others do not (torchao's 8-bit and 4-bit AdamW run compiled kernels, bitsandbytes calls C
on data pointers), and their state depends on each tensor's size in ways no formula of ours should
guess (block-wise scales, small tensors kept in fp32, maps shared between params). For those the
plan steps a fresh instance of the user's optimizer class once on real tensors of the held shapes
and counts what it created ([Note: probe sizes]).

Example::

    probe = StateProbe(torchao.optim.AdamW8bit, {"lr": 1e-3})
    probe.state_bytes([(4096, 4096), (50257,)])   # bytes of state for these held tensors
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hf_lowzero.zero.runtime.memory import plain_tensors

# [Note: probe sizes]
# A probe allocates real memory, so a held tensor larger than PROBE_NUMEL elements is probed at
# PROBE_NUMEL elements (1D, the same divisibility by every block size up to 4096 when the real
# size has it) and its state scaled by numel: block-wise states are linear in numel between
# blocks. Shapes repeat (every layer of a model), so each distinct shape is probed once.
PROBE_NUMEL = 2**22


def runs_under_fake_tensors(optimizer_cls: type) -> bool:
    """Whether a simulated step may run ``optimizer_cls`` itself: torch's optimizers."""
    return optimizer_cls.__module__.startswith("torch.optim")


class StateProbe:
    """Bytes of state ``optimizer_cls(**kwargs)`` keeps for given tensors, from a real step."""

    def __init__(self, optimizer_cls: type, kwargs: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
        self.optimizer_cls, self.kwargs, self.dtype = optimizer_cls, dict(kwargs), dtype
        self._cache: dict[tuple[int, ...], tuple[int, float]] = {}

    def state_bytes(self, shapes: list[tuple[int, ...]]) -> int:
        """State bytes for one tensor of each shape in ``shapes`` (repeats count each time), in one
        optimizer: storages its params share (bitsandbytes' quantization maps) count once."""
        distinct = sorted({tuple(s) for s in shapes if math.prod(s) > 0} - set(self._cache))
        if distinct:
            self._probe(distinct)
        shared = max((self._cache[tuple(s)][0] for s in shapes if tuple(s) in self._cache), default=0)
        return shared + round(sum(self._cache[tuple(s)][1] for s in shapes if tuple(s) in self._cache))

    def _probe(self, shapes: list[tuple[int, ...]]) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes

        # Real tensors, and no mode of the simulated step sees them (the time model's recorder is
        # one): torchao's compiled kernels refuse to run under any dispatch mode.
        with unset_fake_temporarily(), _disable_current_modes():
            probes = [_probe_shape(s) for s in shapes]
            params = [torch.nn.Parameter(torch.zeros(p, dtype=self.dtype)) for p in probes]
            optimizer = self.optimizer_cls(params, **self.kwargs)
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            optimizer.step()
            seen: dict[int, list[int]] = {}  # storage id -> params using it
            sizes: dict[int, int] = {}
            keep = []
            for i, p in enumerate(params):
                values = [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
                for t in plain_tensors(values):
                    storage = t.untyped_storage()
                    keep.append(storage)
                    seen.setdefault(id(storage), []).append(i)
                    sizes[id(storage)] = storage.nbytes()
            shared = sum(sizes[s] for s, users in seen.items() if len(users) > 1)
            for i, (shape, probe) in enumerate(zip(shapes, probes)):
                own = sum(sizes[s] for s, users in seen.items() if users == [i])
                self._cache[shape] = (shared, own * math.prod(shape) / math.prod(probe))


def _probe_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    numel = math.prod(shape)
    if numel <= PROBE_NUMEL:
        return shape
    return (PROBE_NUMEL if numel % 4096 == 0 else PROBE_NUMEL - 1,)
