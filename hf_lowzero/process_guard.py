"""Children that do not outlive their parent: a parent-death signal for every process we start.

A child of ours (the fake-GPU simulation, a test's or benchmark's ranks, a benchmark's one-run
process) may compute for an hour. If its parent is killed (a caller's timeout, ``kill -9``), the
child is orphaned and would go on burning a core. On Linux ``prctl(PR_SET_PDEATHSIG)`` makes the
kernel signal the child when the parent dies; elsewhere these are no-ops (nothing else needs it).

Example::

    run_tied([sys.executable, "-c", "..."], check=True)   # subprocess.run, the child tied to this process
    die_with_parent()                                      # first thing in a child started by other means

# [Note: parent death]
# The kernel sends the signal when the *thread* that started the child exits, not the process:
# start tied children from a thread that lives as long as they should (the main thread, or the
# thread that waits for them, as ``subprocess.run`` does). The signal is set in the child, after
# the fork; a parent that died before that is caught by comparing ``getppid()`` with the parent's
# pid taken before the fork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, looked up here (not after a fork), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have this process get ``sig`` when its parent dies (Linux); exit now if it already has.

    Args:
        parent_pid: The parent's pid as the parent knew it (None: ``os.getppid()`` now).
        sig: The signal to get (SIGKILL: nothing of a child's is worth a cleanup its parent cannot see).
    """
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        os._exit(1)


def run_tied(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` with the child killed if this process dies first
    ([Note: parent death]).

    Example::

        done = run_tied([sys.executable, "job.py"], capture_output=True, text=True)
    """
    prctl, parent_pid = _prctl(), os.getpid()
    if prctl is None:
        return subprocess.run(command, **kwargs)

    def tie() -> None:  # in the child, between fork and exec: only the prctl call and getppid
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return subprocess.run(command, preexec_fn=tie, **kwargs)
