"""The per-rank memory report, measured from live tensors, against byte counts from the shapes."""

import pytest
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
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
