"""Count the host syncs of a CUDA training step, per phase, and say where each one is.

    syncs = HostSyncs()
    with syncs.counting():
        with syncs.phase("forward"):
            loss = model(input_ids=x, labels=x).loss
        with syncs.phase("backward"):
            opt.backward(loss)
        with syncs.phase("step"):
            opt.step()
    syncs.counts()   # {"forward": 0, "backward": 0, "step": 1, "gather": 0}
    syncs.sites      # Counter({("step", "hf_lowzero/zero/update/step.py:52 global_norm_and_usage"): 1})

How: ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call warn (a stream
or device synchronize, a copy to the host, ``.item()``, a blocking copy from pageable memory).
``cudaEventSynchronize`` does not, so ``torch.cuda.Event.synchronize`` is wrapped as well. Each sync
counts in the phase in progress, except that one whose stack passes through the code that writes
the updated params back (a function of ``hf_lowzero/zero`` named for gathering, copying to the
params or unpacking) counts in ``"gather"``: with the all-gather overlapped, that code runs in the
next forward. ``sites`` names the innermost frame of hf_lowzero (else of the code that called torch).
A sync made by Python code on autograd's thread (a gradient hook) is named where it is; one made
inside autograd's own kernels is reported when ``backward()`` returns, at its caller.
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch

import hf_lowzero

PHASES = ("forward", "backward", "step", "gather")
SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode says
GATHER_CODE = re.compile(r"gather|copy_to_params|copy_master_to_params|unpack")
OURS = os.path.dirname(hf_lowzero.__file__) + os.sep  # frames of the package, not of a checkout named after it
ZERO = os.path.join(OURS, "zero") + os.sep
SKIPPED = ("/torch/", "/warnings.py", __file__)


class HostSyncs:
    """See the module docstring. Counts only while ``counting()`` is active."""

    def __init__(self) -> None:
        self.sites: Counter = Counter()  # (phase, site) -> syncs
        self.ours: Counter = Counter()  # phase -> syncs with a frame of hf_lowzero on the stack
        self._phase = "outside"

    def counts(self) -> dict[str, int]:
        """Syncs per phase (every phase of PHASES, zero included)."""
        total = Counter()
        for (phase, _), n in self.sites.items():
            total[phase] += n
        return {phase: total[phase] for phase in PHASES}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        original_sync = torch.cuda.Event.synchronize
        cuda = torch.cuda.is_available()  # without CUDA nothing syncs: only the counting itself can be tested
        previous_mode = torch.cuda.get_sync_debug_mode() if cuda else None

        def event_synchronize(event) -> None:
            self._note()
            original_sync(event)

        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None) -> None:
                if SYNC_WARNING in str(message):
                    self._note()
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            torch.cuda.Event.synchronize = event_synchronize
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous_mode)
                torch.cuda.Event.synchronize = original_sync

    def _note(self) -> None:
        frames = [f for f in traceback.extract_stack() if not any(s in f.filename for s in SKIPPED)]
        ours = [f for f in frames if f.filename.startswith(OURS)]
        gathering = any(GATHER_CODE.search(f.name) for f in ours if f.filename.startswith(ZERO))
        phase = "gather" if gathering else self._phase
        where = (ours or frames or [None])[-1]
        site = "?" if where is None else f"{_short(where.filename)}:{where.lineno} {where.name}"
        self.sites[(phase, site)] += 1
        if ours:
            self.ours[phase] += 1


def _short(filename: str) -> str:
    """A path from its package down: hf_lowzero/..., transformers/..., else the file's name."""
    parts = Path(filename).parts
    for package in ("hf_lowzero", "transformers", "benchmarks", "accelerate"):
        if package in parts:
            return "/".join(parts[parts.index(package) :])
    return parts[-1]
