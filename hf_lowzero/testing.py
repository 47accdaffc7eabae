"""Run a function in ``world_size`` local processes, one per rank, with a gloo process group on CPU.

Used by the test suite and the benchmarks.

Example::

    def body(rank, world_size, stage):
        ...assertions...

    run_distributed(body, 2, stage=1)
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_lowzero.process_guard import die_with_parent

TIMEOUT = datetime.timedelta(seconds=120)  # a hang fails the test instead of blocking the suite


def free_port() -> int:
    """A port free now. Another process can take it before it is bound (a connection's local port, in
    the ephemeral range): for ranks to meet at, hold a ``rendezvous`` instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# [Note: the rendezvous held by the caller]
# Ranks once met at a port picked free (bind to 0, close) that rank 0 bound again a moment later. In
# between, any process on the machine can take it: every outgoing connection gets a local port from
# the same ephemeral range, and Ray's clusters beside the tests open many. Seen in CI: rank 0 failed
# with EADDRINUSE. Now the caller binds the store's port and keeps it (a TCPStore server in its own
# process, on port 0), and every rank joins it as a client, as torchrun's workers join the store
# their agent hosts. Passed as ``store=``, not through TORCHELASTIC_USE_AGENT_STORE: that variable
# would reach whatever a rank starts (a Ray job's workers would all wait for a store none hosts).


@contextlib.contextmanager
def rendezvous(world_size: int) -> Iterator[int]:
    """A store for ``world_size`` ranks to meet at, served from this process while entered: yields
    its port ([Note: the rendezvous held by the caller]).

    Example::

        with rendezvous(2) as port:
            mp.spawn(body, args=(2, port), nprocs=2)     # body: join_group("gloo", rank, 2, port)
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    try:
        yield store.port
    finally:
        del store


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of a one-machine world meeting at ``port`` (libraries
    such as accelerate read them; ``init_process_group()`` without arguments uses them)."""
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def join_group(backend: str, rank: int, world_size: int, port: int) -> None:
    """Join the default process group of ``world_size`` ranks meeting at ``rendezvous``'s ``port``,
    with ``rank_environment``'s variables set."""
    os.environ.update(rank_environment(rank, world_size, port))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)


def _entry(rank: int, world_size: int, port: int, fn, kwargs, backend: str = "gloo") -> None:
    die_with_parent()  # a rank ends with the process that started it ([Note: parent death] in process_guard.py)
    torch.set_num_threads(1)
    join_group(backend, rank, world_size, port)
    fn(rank, world_size, **kwargs)
    # Tear down together: a rank destroying its gloo group while a peer is still using the
    # connections can abort the peer ("terminate called without an active exception").
    if backend == "nccl":
        dist.barrier(device_ids=[rank % torch.cuda.device_count()])  # rank r's GPU, not the current one
    else:
        dist.barrier()
    dist.destroy_process_group()
    # Even so, gloo's background threads can outlive the group and abort the interpreter's own
    # shutdown with that message (measured with torch 2.13: about 1 spawn in 10 to 50 under load,
    # with this library's code before and after the current changes; 0 in 80 with this exit).
    # This rank's work is done and checked: leave without running the shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# [Note: ranks from a fork server]
# A spawned rank starts a fresh interpreter and imports torch, transformers' models and the test
# module again: 5 to 8 s per rank on the 2-core machine, most of a small distributed test's time. On
# CPU (gloo) the ranks come from a fork server instead: one clean process, started at the first call,
# that imports PRELOAD once and forks a rank per request, so a rank starts with those imports done.
# Not a fork of the caller: a test process that ran torch ops holds an OpenMP thread team, and a
# child forked from it can deadlock in its first parallel kernel (seen: a forked rank hung in
# layer_norm). The server runs no torch op, and its children start as a spawned rank would, from
# a clean state (no random state or module attribute of the caller's). NCCL ranks are spawned (CUDA
# does not survive a fork), and so is everything where the platform has no fork server.
PRELOAD = ["torch", "torch.distributed", "hf_lowzero"]


def preload(*modules: str) -> None:
    """Modules the fork server imports once, for every rank it forks ([Note: ranks from a fork
    server]); call before the first ``run_distributed``."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def run_distributed(fn, world_size: int, backend: str = "gloo", **kwargs) -> None:
    """Start ``world_size`` ranks running ``fn(rank, world_size, **kwargs)``; re-raise any failure.
    ``backend="nccl"`` (one GPU per rank) leaves the current CUDA device alone: ``fn`` places its
    tensors. On CPU the ranks come from a fork server ([Note: ranks from a fork server]).
    """
    method = "forkserver" if backend == "gloo" and "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(PRELOAD)
    with rendezvous(world_size) as port:
        args = (world_size, port, fn, kwargs, backend)
        mp.start_processes(_entry, args=args, nprocs=world_size, join=True, start_method=method)
