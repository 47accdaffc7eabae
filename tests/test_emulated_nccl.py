"""The emulated second rank of ``benchmarks/gpu_overlap.py`` (``benchmarks/emulated_nccl.py``), on
CPU: what each collective writes, that only the sleeping kinds sleep, and that ``wait()`` waits."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from benchmarks.emulated_nccl import EmulatedGroup, Wire, wire_seconds


def group(sleeping=frozenset(), gb_per_s=1e-3) -> EmulatedGroup:
    return EmulatedGroup(0, 2, Wire(gb_per_s=gb_per_s, sleeping=frozenset(sleeping)))


def test_reduce_scatter_writes_the_sum_of_two_copies_of_this_ranks_chunk():
    g = group()
    flat = torch.arange(8, dtype=torch.bfloat16)  # rank-major: rank 0's chunk is 0..3
    out = torch.empty(4, dtype=torch.bfloat16)
    g._reduce_scatter_base(out, flat, dist.ReduceScatterOptions()).wait()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert g.wire.payload_bytes["reduce_scatter"] == 16
    g.shutdown()


def test_all_gather_writes_this_ranks_rows_into_every_chunk_also_in_place():
    g = group()
    out = torch.zeros(6)
    g._allgather_base(out, torch.tensor([1.0, 2.0, 3.0]), None).wait()
    assert out.tolist() == [1.0, 2.0, 3.0] * 2
    out = torch.tensor([4.0, 5.0, 0.0, 0.0])
    g._allgather_base(out, out[:2], None).wait()  # the input is this rank's chunk of the output
    assert out.tolist() == [4.0, 5.0, 4.0, 5.0]
    g.shutdown()


def test_all_reduce_sums_two_copies_and_max_leaves_them():
    g = group()
    t = torch.tensor([1.5, -2.0])
    g.allreduce([t], dist.AllreduceOptions()).wait()
    assert t.tolist() == [3.0, -4.0]
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    g.allreduce([t], opts).wait()
    assert t.tolist() == [3.0, -4.0]
    g.shutdown()


def test_only_sleeping_kinds_sleep_and_wait_waits_for_the_sleep():
    payload = torch.zeros(50_000)  # 200 kB: 100 kB sent at 1 MB/s is 0.1 s
    wire_s = wire_seconds("all_gather", payload.numel() * 4, 2, 1e-3)
    assert abs(wire_s - 0.1) < 1e-9
    g = group(sleeping={"all_gather"})
    g.wire.slept = []
    start = time.perf_counter()
    g._reduce_scatter_base(torch.empty(25_000), payload, None).wait()
    assert time.perf_counter() - start < wire_s / 2  # reduce-scatters do not sleep here
    work = g._allgather_base(torch.empty(100_000), payload, None)
    issued = time.perf_counter() - start
    work.wait()
    assert issued < wire_s / 2 <= wire_s <= time.perf_counter() - start  # asynchronous, and waited for
    assert g.wire.slept_seconds()["all_gather"] >= wire_s
    g.shutdown()
