"""Snapshot work yields the CPU to training: the background thread and the holders run niced.

# [Note: background priority]
# A snapshot's background work (a rank's writer thread on a GPU node; its node's holder, which sends the piece
# to the buddy node; the buddy's holder, which receives it) runs on the CPUs that train. At equal
# priority the kernel shares a core between them, and every millisecond it takes is a millisecond
# a training rank waits, its peers then waiting for it in the next collective. At a lower priority
# (``nice`` NICE, or ``$HF_LOWZERO_SNAPSHOT_NICE``) it runs in the gaps training leaves (the
# collectives' waits, data loading), and takes longer; a snapshot asked for while both staging
# buffers are still being written waits (``stager.py``), which auto's cost counts. On Linux a
# thread's niceness is its own and threads inherit their creator's.
"""

from __future__ import annotations

import contextlib
import os
import threading

NICE = 10
ENV = "HF_LOWZERO_SNAPSHOT_NICE"


def snapshot_nice() -> int:
    """The niceness of snapshot work ([Note: background priority]): ``$HF_LOWZERO_SNAPSHOT_NICE`` or NICE."""
    value = os.environ.get(ENV, "")
    return int(value) if value.strip() else NICE


def lower_this_thread() -> None:
    """Run the calling thread (and the threads it starts later) at ``snapshot_nice()``."""
    _renice(threading.get_native_id())


def lower_this_process() -> None:
    """Run every thread of this process (and the threads they start later) at ``snapshot_nice()``."""
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            _renice(int(tid))


def _renice(tid: int) -> None:
    nice = snapshot_nice()
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):  # gone, or not allowed: run at the priority it has
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
