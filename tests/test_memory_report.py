"""The per-rank memory report, measured from live tensors, against byte counts from the shapes."""

import pytest
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.simulation import call_on_fake_gpus
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.grads.backward import MAX_IN_FLIGHT
from tests.models import BranchyNet, batch, make_inner


def memory_body(rank: int, world_size: int, stage: int, overlap: bool) -> None:
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=stage, reduce_bucket_mb=0.001, overlap_allgather=overlap
    )
    trainable_numel = sum(s.param.numel() for s in opt.slots)
    rows = sum(s.shard.shard_numel for s in opt.slots)  # this rank's row elements, padding included
    assert rows * world_size - trainable_numel < world_size * len(opt.slots)  # padding < W per param
    all_params = 4 * sum(p.numel() for p in model.parameters())

    report = opt.memory_report()
    assert (report.params, report.grads, report.master_rows, report.optimizer_state) == (all_params, 0, 4 * rows, 0)

    x, y = batch(rank, 0)
    opt.backward(mse_loss(model(x), y))
    report = opt.memory_report()
    assert report.grads == 0, "full gradients are freed once bucketed"
    # Both stages keep only this rank's fp32 gradient rows once the buckets are reduced. The
    # communication scratch is reported on its own, bounded by the buckets in flight (not by
    # their number).
    assert report.grad_buffers == 4 * rows
    assert report.comm_buffers == sum(t.nbytes for t in opt.reducer.pool.tensors()) > 0
    # fp32: a bucket in flight holds its packed gradients and (W > 1) a receive buffer.
    largest_bucket = max(b.row_numel for b in opt.buckets) * world_size * 4
    assert len(opt.buckets) > 3 * MAX_IN_FLIGHT and report.comm_buffers <= 2 * MAX_IN_FLIGHT * largest_bucket

    opt.step()
    report = opt.memory_report()
    if overlap:  # [Note: overlapped all-gather]: every bucket's gather is alive until the next forward
        gathered = 4 * sum(s.shard.padded_numel for s in opt.slots)  # one fp32 copy of the trainable params
        assert gathered <= report.comm_buffers <= gathered + 2 * MAX_IN_FLIGHT * largest_bucket
        opt.wait_for_params()  # they go back to the pool, which keeps them for the next step
    else:  # at most two gathers in flight, reusing the pool: it does not grow
        assert len(opt.reducer.pool.tensors()) <= 2 * MAX_IN_FLIGHT
        assert report.comm_buffers <= 2 * MAX_IN_FLIGHT * largest_bucket
    used = [s for s in opt.slots if not s.name.startswith("never.")]
    exp_avg_and_sq = sum(2 * 4 * s.shard.shard_numel for s in used)
    step_counters = 4 * len(used)  # AdamW keeps a float32 scalar step per param it has stepped
    assert report.optimizer_state == exp_avg_and_sq + step_counters
    # ZeRO's fp32 accounting with Adam (K=12 incl. the master copy): 4Psi + 16Psi/W for both
    # stages (gradient rows counted when held, right after backward). `never` has master rows
    # (4 bytes) but no Adam state (8 bytes): it was never used.
    used_numel = sum(s.param.numel() for s in used)
    sharded = report.master_rows + report.optimizer_state
    assert sharded == pytest.approx((4 * trainable_numel + 8 * used_numel) / world_size, rel=0.01)


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, False), (2, True)])
def test_memory_report_counts_live_bytes(stage, overlap):
    run_distributed(memory_body, 2, stage=stage, overlap=overlap)


# ------------------------------------------------------------- the gathers in flight, on fake GPUs

SETUPS = [  # (params' dtype, overlap_allgather, offload_optimizer)
    ("bf16", True, False),
    ("bf16", False, False),
    ("fp32", True, False),
    ("bf16", True, True),
    ("fp32", True, True),
]


def _gathers_on_fake_gpus() -> dict:
    """Rank 1 of 2 on fake ``cuda:1`` (``hf_lowzero.simulation``), one step per setup: what
    ``memory_report()`` says the all-gathers hold at most, what the buckets' sizes give, and what the
    gathers still pending right after ``step()`` hold (their gathered buffers and row copies)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_lowzero.simulation.gpu_step import DTYPES, SimNet, fake_storage
    from hf_lowzero.simulation.nccl import simulated_world
    from hf_lowzero.simulation.streams import AccessChecker, FakeCudaOps
    from hf_lowzero.zero.runtime import device as dev
    from hf_lowzero.zero.runtime.memory import tensor_bytes

    device, found = torch.device("cuda", 1), {}
    for dtype, overlap, offload in SETUPS:
        checker = AccessChecker()
        ops = FakeCudaOps(checker, device)
        with torch.device("meta"):
            model = SimNet().to(DTYPES[dtype])
        with simulated_world(2, 1, device, checker, ops), FakeTensorMode(), checker, dev.use_ops(ops):
            model = fake_storage(model, device)
            inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
            opt = LowLevelZeroOptimizer(
                model, inner, reduce_bucket_mb=0.004, overlap_allgather=overlap, offload_optimizer=offload
            )
            opt.backward(model(torch.zeros(4, 9, dtype=torch.long, device=device), True))
            opt.step()
            report = opt.memory_report()
            pending = list(opt._parts.gather.pending.values())
            live = tensor_bytes([g.out for g in pending] + [g.chunk for g in pending if g.copied])
            itemsize = DTYPES[dtype].itemsize
            copy = dtype != "fp32" or offload  # the rows sent are a copy: cast from fp32 masters, or uploaded
            held = [itemsize * (b.packed_numel + b.row_numel * copy) for b in reversed(opt.buckets)]
            found[dtype, overlap, offload] = {
                "reported": report.gather_buffers,
                "by device": report.by_device,
                "step counters": sum(
                    st["step"].nbytes for st in inner.state.values() if st["step"].device.type == "cpu"
                ),
                "parts": report.model_state_bytes + report.buffers + report.comm_buffers + report.gather_buffers,
                "live": live,
                "every bucket": sum(held),
                "two at once": max(a + b for a, b in zip(held, held[1:])),
                "buckets": len(held),
            }
    return found


def test_the_report_counts_the_gathers_in_flight_on_cuda_from_the_bucket_sizes():
    """[Note: overlapped all-gather]'s memory: with overlap every bucket's gathered buffer (and, where
    the rows sent are a copy, this rank's rows in the params' dtype) is alive from ``step()`` to the
    forward, which CUDA's allocator recycles and no pool holds; without, two buckets' at once inside
    the step. ``gather_buffers`` is that peak, and what the pending gathers hold after a step."""
    found = call_on_fake_gpus(_gathers_on_fake_gpus)
    for setup, f in found.items():
        _, overlap, _ = setup
        assert f["buckets"] > 3, setup  # several buckets: every one's vs. two at once differ
        if overlap:
            assert f["reported"] == f["every bucket"] == f["live"] > 0, (setup, f)
        else:
            assert f["reported"] == f["two at once"] < f["every bucket"] and f["live"] == 0, (setup, f)
    for setup in [s for s in SETUPS if not s[2]]:  # in the GPU's total (on the host: AdamW's step counters)
        by_device = found[setup]["by device"]
        assert by_device["cpu"] == found[setup]["step counters"] > 0, (setup, by_device)
        assert by_device["cuda:1"] == found[setup]["parts"] - by_device["cpu"], (setup, found[setup])
