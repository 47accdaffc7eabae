"""The host-sync counter of ``benchmarks/gpu_overlap.py`` (``benchmarks/host_syncs.py``), on CPU:
each sync lands in the phase in progress and names where it was; other warnings pass through."""

from __future__ import annotations

import warnings

import torch

from benchmarks.host_syncs import SYNC_WARNING, HostSyncs


def a_sync() -> None:
    warnings.warn(f"called a {SYNC_WARNING}", UserWarning, stacklevel=1)  # as torch's sync debug mode does


def test_syncs_count_in_their_phase_and_name_their_site(monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: None)  # no CUDA here: what it wraps
    syncs = HostSyncs()
    with warnings.catch_warnings(record=True) as passed:
        warnings.simplefilter("always")
        with syncs.counting():
            with syncs.phase("backward"):
                a_sync()
            with syncs.phase("step"):
                a_sync()
                torch.cuda.Event.synchronize(object())  # counted by the wrapper, then torch's runs
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert syncs.counts() == {"forward": 0, "backward": 1, "step": 2, "gather": 0}
    sites = [site for _, site in syncs.sites]
    assert any(site.endswith(" a_sync") for site in sites)
    assert any(site.endswith(" test_syncs_count_in_their_phase_and_name_their_site") for site in sites)
    assert not syncs.ours  # no frame of hf_lowzero on these stacks
    assert [str(w.message) for w in passed] == ["something else"]
