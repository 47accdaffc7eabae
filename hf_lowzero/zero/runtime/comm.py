"""Collectives: the only module that calls ``torch.distributed``.

Stateless functions taking the process group and tensors explicitly. They paper over the
torch 2.11 -> 2.13 renames (``reduce_scatter_tensor`` -> ``reduce_scatter_single``,
``all_gather_into_tensor`` -> ``all_gather_single``) and count the bytes each collective moves,
so benchmarks can compare traffic against the theoretical minimum.

Example::

    work = reduce_scatter(out_row, flat_bucket, group, async_op=True)
    ...
    wait(work)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.memory import same_memory

ProcessGroup = dist.ProcessGroup

_reduce_scatter_impl = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_impl = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommStats:
    """Per-process counters of collective calls and bytes.

    ``payload_bytes`` is the size of the full (pre-scatter / post-gather) tensor of each call;
    ``sent_bytes`` is what one rank sends with a bandwidth-optimal ring algorithm:
    ``2 (W-1)/W`` of the payload for all-reduce and ``(W-1)/W`` for reduce-scatter and all-gather.
    """

    calls: Counter = field(default_factory=Counter)
    payload_bytes: Counter = field(default_factory=Counter)
    sent_bytes: Counter = field(default_factory=Counter)

    def record(self, op: str, payload: int, world_size: int, sent: int | None = None) -> None:
        """Count one call; ``sent`` overrides the ring formula (point-to-point exchanges of
        uneven chunks know exactly what this rank sends)."""
        factor = 2 if op == "all_reduce" else 1
        self.calls[op] += 1
        self.payload_bytes[op] += payload
        self.sent_bytes[op] += factor * payload * (world_size - 1) // world_size if sent is None else sent

    def reset(self) -> None:
        self.calls.clear()
        self.payload_bytes.clear()
        self.sent_bytes.clear()


comm_stats = CommStats()


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, async_op: bool = False, op: str = "sum"):
    """In-place sum (or ``op="max"``) over ``group``. Returns a work handle when ``async_op``."""
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    comm_stats.record("all_reduce", _nbytes(tensor), group_size(group))
    return dist.all_reduce(tensor, op=reduce_op, group=group, async_op=async_op)


# [Note: gloo point-to-point]
# On gloo, a reduce-scatter or all-gather of a bucket is done as W-1 sends and W-1 receives posted
# at once (batch_isend_irecv), one per peer: the same (W-1)/W of the payload per rank as the
# bandwidth-optimal collective, and much faster than gloo's own collectives on CPU. Measured with
# torch 2.13, 11 MB rows, 2-core machine: all-gather 15 ms vs 30 ms (all_gather_into_tensor) at
# W=2 and 55 vs 130 ms at W=4; reduce-scatter 12 ms vs 30 ms (reduce_scatter_tensor) at W=2.
# Every rank posts its bucket exchanges in the same (plan) order, and gloo matches sends to
# receives in order per peer, so exchanges in flight at once never mix. The received chunks of a
# reduce-scatter are summed in rank order, which is what a sum over ranks does on every backend.
# That holds for large payloads. A small exchange posted after the host computed for a while (the
# end of backward, the optimizer step) often waits ~2 ms for gloo's transport to pick it up, where
# gloo's own collective takes less. Measured at W=2 right after 2 ms of compute, median ms (own vs
# exchange; ``benchmarks/step_ab.py``): 20K floats per rank, reduce-scatter 1.7 vs 2.1, all-gather
# 0.26 vs 2.0; 200K, 1.1 vs 2.7 and 0.73 vs 2.3; 1.4M, 9.4 vs 4.6 and 5.2 vs 4.8. So reduce-scatters
# and all-gathers under POINT_TO_POINT_MIN_BYTES (the full tensor) use gloo's own collectives: on a
# model of 300 small tensors (one 160 KB bucket) that took a stage 2 step from 1.41-1.53 to
# 1.22-1.33 of fused DDP's in the same runs. At 1.1 MB (2,000 small tensors) the exchanges were
# 0-6% faster in the step, within the noise: the best limit is somewhere between. NCCL and other
# backends use their native collectives at every size.
POINT_TO_POINT_MIN_BYTES = 2 * 2**20


class _Exchange:
    """Work handle of a point-to-point exchange: ``wait()`` waits for every send and receive, then
    runs ``finish`` (the local part: the rank-order sum of a reduce-scatter)."""

    def __init__(self, works: list, finish=None) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            self.finish()
            self.finish = None


def uses_point_to_point(group: ProcessGroup | None, nbytes: int | None = None) -> bool:
    """Whether :func:`reduce_scatter` and :func:`all_gather` of ``nbytes`` (the full, rank-major
    tensor; None: any size) on ``group`` exchange chunks point to point (gloo, W > 1, at least
    POINT_TO_POINT_MIN_BYTES; see [Note: gloo point-to-point])."""
    large = nbytes is None or nbytes >= POINT_TO_POINT_MIN_BYTES
    return large and backend(group) == "gloo" and group_size(group) > 1


# A memory plan runs the real code on torch's fake process group (no data moves), standing in for
# the backend the planned run will use, so that the code takes that backend's path.
_FAKE_STANDS_FOR = {"name": "nccl"}


def backend(group: ProcessGroup | None) -> str:
    """``group``'s backend; for the fake process group of a memory plan, or a simulated group
    (``hf_lowzero.simulation``: its ``stands_for``), the backend it stands for."""
    name = dist.get_backend(group)
    if name == "fake":
        return _FAKE_STANDS_FOR["name"]
    return getattr(_process_group(group), "stands_for", None) or name


def _process_group(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


@contextlib.contextmanager
def fake_group_stands_for(name: str):
    """Within: the fake process group takes ``name``'s code paths (``"nccl"`` or ``"gloo"``)."""
    previous = _FAKE_STANDS_FOR["name"]
    _FAKE_STANDS_FOR["name"] = name
    try:
        yield
    finally:
        _FAKE_STANDS_FOR["name"] = previous


def _exchange(send: list[torch.Tensor], receive: list[torch.Tensor], group: ProcessGroup | None) -> list:
    """Post, for every peer r != this rank, a send of ``send[r]`` and a receive into ``receive[r]``."""
    rank, ops = group_rank(group), []
    for peer in range(group_size(group)):
        if peer != rank:  # empty chunks (uneven exchanges) are skipped on both sides alike
            global_peer = peer if group is None else dist.get_global_rank(group, peer)
            if send[peer].numel():
                ops.append(dist.P2POp(dist.isend, send[peer], global_peer, group))
            if receive[peer].numel():
                ops.append(dist.P2POp(dist.irecv, receive[peer], global_peer, group))
    return dist.batch_isend_irecv(ops) if ops else []


# [Note: the divide in the collective]
# Gradients are averaged over ranks as DDP averages them: each element divided by W before the SUM
# collective. Dividing the packed bucket is one more read and write of every gradient byte (4.8 ms for
# GPT-2 4x256's 22 MB bucket on one CPU core). NCCL can fold it in: its PREMUL_SUM multiplies each
# input element by a scalar before it sums, and for W a power of two multiplying by 1/W rounds exactly
# as dividing by W does (both round the same real number, x * 2^-k), so the result is DDP's, bit for
# bit. Other world sizes, gloo (no PREMUL_SUM) and the uneven exchanges of whole params divide first.


def premultiplies(group: ProcessGroup | None) -> bool:
    """Whether a reduce-scatter on ``group`` averages by itself (``reduce_scatter(..., average=True)``):
    NCCL and a world size that is a power of two ([Note: the divide in the collective])."""
    world_size = group_size(group)
    return backend(group) == "nccl" and world_size > 1 and world_size & (world_size - 1) == 0


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    async_op: bool = False,
    workspace: torch.Tensor | None = None,
    average: bool = False,
):
    """Sum ``input`` (1D, rank-major, ``W * output.numel()``) over ranks; rank r receives chunk r.
    ``average``: each element divided by W first, in the collective (only where ``premultiplies``).

    On gloo (see [Note: gloo point-to-point]) the peers' chunks are received into ``workspace``
    (like ``input``; allocated when None), which must stay untouched until the work is waited
    for; ``output`` may be ``workspace``'s first chunk. The sum runs in ``wait()``.
    """
    world_size = group_size(group)
    comm_stats.record("reduce_scatter", _nbytes(input), world_size)
    if average:
        if not premultiplies(group):
            raise ValueError(f"reduce_scatter(average=True) needs NCCL and a power-of-two world size, not {world_size}")
        op = dist.ReduceOp.PREMUL_SUM(1.0 / world_size)
        return _reduce_scatter_impl(output, input, op=op, group=group, async_op=async_op)
    if not uses_point_to_point(group, _nbytes(input)):
        return _reduce_scatter_impl(output, input, group=group, async_op=async_op)
    rank = group_rank(group)
    chunks = input.view(world_size, -1)
    received = (torch.empty_like(input) if workspace is None else workspace).view(world_size, -1)
    works = _exchange(list(chunks), list(received), group)
    return _settle(_Exchange(works, _rank_order_sum(output, chunks[rank], received, rank)), async_op)


def _rank_order_sum(output: torch.Tensor, own: torch.Tensor, received: torch.Tensor, rank: int):
    """The local part of a reduction: ``output`` = the W chunks summed in rank order, this rank's
    own chunk from ``own``, the peers' from ``received`` (``[W, n]``)."""

    def finish() -> None:
        parts = [own if r == rank else received[r] for r in range(received.shape[0])]
        if same_memory(output, parts[0]):
            rest = parts[1:]
        else:  # one pass for the first two chunks, not a copy and an add
            torch.add(parts[0], parts[1], out=output)
            rest = parts[2:]
        for part in rest:
            output.add_(part)

    return finish


def _settle(pending: _Exchange, async_op: bool):
    """The handle of an async call; otherwise wait now and return None, as torch.distributed does."""
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = False):
    """Concatenate every rank's ``input`` into ``output`` (1D, rank-major)."""
    world_size = group_size(group)
    comm_stats.record("all_gather", _nbytes(output), world_size)
    if not uses_point_to_point(group, _nbytes(output)):
        return _all_gather_impl(output, input, group=group, async_op=async_op)
    chunks = output.view(world_size, -1)
    pending = _Exchange(_exchange([input] * world_size, list(chunks), group))
    chunks[group_rank(group)].copy_(input)  # local, while the peers' chunks travel
    if async_op:
        return pending
    pending.wait()
    return None


# [Note: uneven exchanges]
# Whole-parameter ownership ([Note: two ways to own a parameter] in layout/partition.py) gives the ranks
# chunks of different lengths in a bucket, which reduce-scatter and all-gather cannot carry. The
# gradient goes to its owner and the update comes back as an all-to-all with uneven splits: each
# rank sends exactly the chunks of its peers (reduce) or its own chunk to each peer (gather), no
# padding. On gloo these are the same per-peer sends and receives as [Note: gloo point-to-point];
# elsewhere ``all_to_all_single`` with split sizes. The reduced chunk is summed in rank order.


def reduce_to_owners(
    output: torch.Tensor,
    input: torch.Tensor,
    chunks: list[int],
    group: ProcessGroup | None,
    async_op: bool = False,
    workspace: torch.Tensor | None = None,
):
    """Sum ``input`` (1D, rank-major chunks of lengths ``chunks``) over ranks; this rank receives
    its chunk into ``output`` (``chunks[rank]`` long). ``workspace`` (``W * chunks[rank]``
    elements, allocated when None) receives the peers' chunks and stays untouched until the work is
    waited for; the sum runs in ``wait()``. See [Note: uneven exchanges]."""
    world_size, rank = group_size(group), group_rank(group)
    own = chunks[rank]
    itemsize = input.element_size()
    comm_stats.record("reduce_to_owners", _nbytes(input), world_size, sent=(sum(chunks) - own) * itemsize)
    parts = list(input.split(chunks))
    received = torch.empty(world_size * own, dtype=input.dtype, device=input.device) if workspace is None else workspace
    received = received[: world_size * own].view(world_size, own)
    if uses_point_to_point(group):
        works = _exchange(parts, list(received), group)
    else:
        works = [
            dist.all_to_all_single(
                received.view(-1), input, [own] * world_size, list(chunks), group=group, async_op=True
            )
        ]

    return _settle(_Exchange(works, _rank_order_sum(output, parts[rank], received, rank)), async_op)


def gather_from_owners(
    output: torch.Tensor, input: torch.Tensor, chunks: list[int], group: ProcessGroup | None, async_op: bool = False
):
    """Concatenate every rank's ``input`` (its chunk, ``chunks[rank]`` long) into ``output`` (1D,
    rank-major, ``sum(chunks)``). See [Note: uneven exchanges]."""
    world_size, rank = group_size(group), group_rank(group)
    comm_stats.record("gather_from_owners", _nbytes(output), world_size, sent=_nbytes(input) * (world_size - 1))
    parts = list(output.split(chunks))
    if uses_point_to_point(group):
        works = _exchange([input] * world_size, parts, group)
        parts[rank].copy_(input)  # local, while the peers' chunks travel
    else:  # all_to_all_single delivers this rank's own chunk too
        works = [
            dist.all_to_all_single(
                output, input.repeat(world_size), list(chunks), [input.numel()] * world_size, group=group, async_op=True
            )
        ]
    return _settle(_Exchange(works), async_op)


# [Note: the params' device] (device.py): NCCL runs object collectives on the current CUDA device,
# so these take the params' device and make it current.


def all_gather_object(obj, group: ProcessGroup | None, device: torch.device | None = None) -> list:
    """Every rank's small picklable ``obj`` (e.g. a validation verdict), in rank order; with NCCL
    through ``device`` (the params' device)."""
    with dev.on_device(device if backend(group) == "nccl" else None):
        simulated = getattr(_process_group(group), "object_collective", None)
        if simulated is not None:  # a simulation moves no data (hf_lowzero/simulation/nccl.py)
            return simulated("all_gather_object", obj, device)
        out = [None] * group_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out


def gather_object(obj, group: ProcessGroup | None, device: torch.device | None = None) -> list | None:
    """Every rank's picklable ``obj``, in rank order, on rank 0 of ``group`` (None elsewhere); with
    NCCL through ``device`` (the params' device)."""
    rank = group_rank(group)
    with dev.on_device(device if backend(group) == "nccl" else None):
        simulated = getattr(_process_group(group), "object_collective", None)
        if simulated is not None:
            gathered = simulated("gather_object", obj, device)
            return gathered if rank == 0 else None
        out = [None] * group_size(group) if rank == 0 else None
        dst = 0 if group is None else dist.get_global_rank(group, 0)
        dist.gather_object(obj, out, dst=dst, group=group)
        return out


def wait(work) -> None:
    """Wait for an async handle; ``None`` (a synchronous call) is a no-op."""
    if work is not None:
        work.wait()
