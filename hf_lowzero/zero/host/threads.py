"""How many threads the host step of an offloaded optimizer runs on, and the warning when the machine
has cores it leaves idle.

The host step (our kernel, or torch's on the host) runs on ``torch.get_num_threads()`` threads, read
at every step. ``torchrun`` sets ``OMP_NUM_THREADS=1`` for every rank, so an offloaded step there runs
on one core of a machine that may have dozens (Ray sets it from ``--cpus-per-worker``).

Example::

    text = host_threads_warning(torch.get_num_threads(), machine_cores(), local_ranks())
    # under torchrun, 8 ranks on 64 cores: "... runs on 1 thread per rank ... OMP_NUM_THREADS=8 ..."
"""

from __future__ import annotations

import os


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_ranks() -> int:
    """The ranks on this machine (``LOCAL_WORLD_SIZE``, set by torchrun, accelerate and Ray Train; else 1)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_threads_warning(threads: int, cores: int, ranks_here: int) -> str | None:
    """None when ``threads`` per rank use this machine's share of ``cores`` per rank (of
    ``ranks_here``); otherwise what to set."""
    share = cores // max(1, ranks_here)
    if threads >= share:
        return None
    return (
        f"offload: the host optimizer step runs on {threads} thread{'s' * (threads != 1)} per rank, while this "
        f"machine has {cores} cores for {ranks_here} rank{'s' * (ranks_here != 1)}: set OMP_NUM_THREADS={share} "
        f"(torchrun sets 1), or call torch.set_num_threads({share}) before training"
    )
