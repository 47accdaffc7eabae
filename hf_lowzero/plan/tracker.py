"""The memory tracker of a simulated or measured step: torch's ``MemTracker``, keeping the peak only.

``torch.distributed._tools.MemTracker`` counts every tensor storage created under it (real or
fake) by category: params, buffers, gradients, activations, temporaries, optimizer state. Its
per-module peaks cost a pass over every module at every op, which makes a 70B simulation take
minutes, and it refuses a module called again in a later iteration (a warm-up step, gradient
accumulation); a plan needs the step's peak alone, so ``PeakTracker`` keeps only that. It still
categorizes as MemTracker does: params and buffers of each module as it first runs, gradients
through the same hooks, recomputation under activation checkpointing as activations.

Example::

    tracker = PeakTracker()
    with tracker:
        loss = model(**batch).loss
        loss.backward()
    tracker.peak_total(), tracker.peak_snapshot()["Gradient"]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

from hf_lowzero.zero.runtime.memory import plain_tensors


class PeakTracker(MemTracker):
    """``MemTracker`` without its per-module peaks (the totals and categories are MemTracker's)."""

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module not in self.memory_tracking:
            self._track_module_params_and_buffers(module, install_grad_hooks=False)
            self._install_grad_hooks(module)
            self.memory_tracking[module] = None  # no per-module stats: only "seen"
        elif self._mod_tracker.is_bw and self._ac_mod is None:  # recomputation (activation checkpointing)
            self._ac_mod = weakref.ref(module)
            self._in_ac = True

    def _install_grad_hooks(self, module) -> None:
        """MemTracker's gradient hooks, on trainable params only (it hooks frozen ones too, which
        torch refuses: a LoRA model's base)."""

        def track(grad) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        for param in module.parameters():
            if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(track),
                    param.register_post_accumulate_grad_hook(lambda p: track(p.grad)),
                )

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def reset_peak(self) -> None:
        """Start the peak afresh from what is held now."""
        self._peak_mem = {device: snapshot[_TOTAL_KEY] for device, snapshot in self._curr_mem_snap.items()}
        self._peak_mem_snap = {device: dict(snapshot) for device, snapshot in self._curr_mem_snap.items()}

    def peak_total(self) -> int:
        """The peak of all devices together (each device's own peak, summed)."""
        self._update_peak_stats(None)
        return sum(self._peak_mem.values())

    def peak_on(self, device: torch.device) -> int:
        self._update_peak_stats(None)
        return self._peak_mem.get(torch.device(device), 0)

    def peak_snapshot(self) -> dict[str, int]:
        """Bytes per category at the peak so far (``"Gradient"``, ``"Activation"``, ...), all devices."""
        self._update_peak_stats(None)
        totals: dict[str, int] = {}
        for snapshot in self._peak_mem_snap.values():
            for category, nbytes in snapshot.items():
                key = getattr(category, "value", category)
                totals[key] = totals.get(key, 0) + nbytes
        return totals


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views count once; packed tensors count
    what they store). Works on fake tensors, which have no data pointers."""
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in plain_tensors(tensors):
        storage = t.untyped_storage()
        seen[id(storage)] = (storage, storage.nbytes())
    return sum(nbytes for _, nbytes in seen.values())
