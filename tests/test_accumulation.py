"""Stage-aware gradient accumulation, against DDP on the same micro-batches.

Stage 1 accumulates under no_sync() and reduce-scatters once per step; stage 2 reduce-scatters
every micro-batch into fp32 rows. A param used in an earlier micro-batch but not in the last one must
still be reduced: the reference is DDP synchronizing every micro-batch (its reducer reads p.grad,
so an earlier micro-batch's average is carried through), which is exact for that case.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime.comm import comm_stats
from tests.models import BranchyNet, assert_params_equal, batch, ddp_reference, make_inner
from tests.tiers import slow

MICRO = 3


def usage(rank: int, step: int, micro: int) -> tuple[bool, bool]:
    """branch_b is used only in the first micro-batch, on every rank; branch_a in the last one
    on rank 0 only, and in the middle one on the other ranks."""
    use_a = (micro == MICRO - 1) if rank == 0 else (micro == 1)
    return use_a, micro == 0


def accumulate_body(
    rank: int, world_size: int, stage: int, ref_no_sync: bool, partition: str = "rows", direct: bool = False
) -> None:
    """``direct``: a bare ``loss.backward()``, flushed by the callback a bucket hook queues; after
    ``no_sync`` the buckets must wait for this backward's gradients, not launch on the accumulated
    ones ([Note: one hook per bucket]), so the step sends exactly one reduction per bucket."""
    model = BranchyNet()
    ref = ddp_reference(model)
    ref_opt = make_inner("adamw", ref.module)
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=stage, reduce_bucket_mb=0.001, clip_grad_norm=0.5, partition=partition
    )
    reduce = "reduce_scatter" if partition == "rows" else "reduce_to_owners"
    n_buckets = len(opt.buckets)
    for step in range(3):
        comm_stats.reset()
        for micro in range(MICRO):
            x, y = batch(rank, step, micro)
            use_a, use_b = usage(rank, step, micro) if not ref_no_sync else (True, rank % 2 == 0)
            last = micro == MICRO - 1
            local = opt.no_sync() if (stage == 1 and not last) else contextlib.nullcontext()
            with local:
                loss = mse_loss(model(x, use_a, use_b), y) / MICRO
                loss.backward() if direct else opt.backward(loss)
            if stage == 1 and not last:
                assert sum(comm_stats.calls.values()) == 0, "stage 1 must not communicate under no_sync"
            ref_local = ref.no_sync() if (ref_no_sync and not last) else contextlib.nullcontext()
            with ref_local:
                (mse_loss(ref(x, use_a, use_b), y) / MICRO).backward()
        expected = n_buckets if stage == 1 else MICRO * n_buckets  # stage 1: the minimum; 2: every micro-batch
        assert comm_stats.calls[reduce] == expected
        opt.step()
        assert comm_stats.calls[reduce] == expected, "nothing may be left for step() to reduce"
        opt.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert opt.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-5)
        assert_params_equal(model, ref.module, f"stage {stage} {partition} direct {direct} step {step}")


def all_accumulation_cases(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        for ref_no_sync in (True, False):  # all used / used in an earlier micro-batch only
            accumulate_body(rank, world_size, stage, ref_no_sync)
        accumulate_body(rank, world_size, stage, False, partition="params")
        accumulate_body(rank, world_size, stage, False, direct=True)
        for direct in (False, True):
            reached_first_body(rank, stage, direct)
    synced_micro_batches_body(rank, world_size)


@pytest.mark.parametrize("world_size", [2, slow(3)])
def test_accumulation_matches_ddp(world_size):
    run_distributed(all_accumulation_cases, world_size)


class UsedInReverse(nn.Module):
    """Registered in the reverse of use: backward reaches the earliest registered param, where a
    bucket's hook sits, first instead of last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(8, 3)
        self.mid = nn.Linear(8, 8)
        self.inp = nn.Linear(17, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def reached_first_body(rank: int, stage: int, direct: bool) -> None:
    """One bucket whose hook fires before the rest of its gradients arrive: after stage 1's
    ``no_sync`` every param already holds a gradient then, and the bucket must still wait for this
    backward's (one reduction per step, equal to DDP)."""
    model = UsedInReverse()
    ref = ddp_reference(model)
    ref_opt = make_inner("adamw", ref.module)
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=stage, verify_every="off")
    assert len(opt.buckets) == 1
    assert opt.reducer.replicated == (stage == 1)  # [Note: replicated reduction]: one small bucket
    for step in range(2):
        comm_stats.reset()
        for micro in range(MICRO):
            x, y = batch(rank, step, micro)
            last = micro == MICRO - 1
            with opt.no_sync() if (stage == 1 and not last) else contextlib.nullcontext():
                loss = mse_loss(model(x), y) / MICRO
                loss.backward() if direct else opt.backward(loss)
            with ref.no_sync() if not last else contextlib.nullcontext():
                (mse_loss(ref(x), y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
        # Stage 1: the one bucket's all-reduce carries the step's norm and flags, nothing else syncs
        # before the all-gather; stage 2: every micro-batch reduce-scattered, then the stats all-reduce.
        reductions = {op: comm_stats.calls[op] for op in ("reduce_scatter", "all_reduce")}
        assert reductions == (
            {"reduce_scatter": 0, "all_reduce": 1} if stage == 1 else {"reduce_scatter": MICRO, "all_reduce": 1}
        )
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_equal(model, ref.module, f"reached first: stage {stage} direct {direct} step {step}")


def synced_micro_batches_body(rank: int, world_size: int) -> None:
    """Stage 1 without no_sync(): each micro-batch reduce-scatters and adds into the fp32 rows."""
    model = BranchyNet()
    ref = ddp_reference(model)
    ref_opt = make_inner("sgd", ref.module)
    opt = LowLevelZeroOptimizer(model, make_inner("sgd", model), stage=1)
    for step in range(2):
        for micro in range(MICRO):
            x, y = batch(rank, step, micro)
            use_a, use_b = usage(rank, step, micro)
            opt.backward(mse_loss(model(x, use_a, use_b), y))
            mse_loss(ref(x, use_a, use_b), y).backward()
        opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_equal(model, ref.module, f"step {step}")


def idle_rank_body(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        idle_rank_case(rank, stage)


def idle_rank_case(rank: int, stage: int) -> None:
    """A rank whose loss touches no parameter still joins every collective (opt.backward flushes)."""
    model = BranchyNet()
    ref = ddp_reference(model)
    ref_opt = make_inner("sgd", ref.module)
    opt = LowLevelZeroOptimizer(model, make_inner("sgd", model), stage=stage, reduce_bucket_mb=0.001)
    x, y = batch(rank, 0)
    if rank == 1:
        opt.backward(torch.zeros(1, requires_grad=True).sum())  # no parameter gets a gradient here
        (mse_loss(ref(x), y) * 0).backward()  # DDP: zeros from this rank
    else:
        opt.backward(mse_loss(model(x), y))
        mse_loss(ref(x), y).backward()
    opt.step()
    ref_opt.step()
    assert_params_equal(model, ref.module, "idle rank")


def test_rank_with_no_gradients_does_not_hang():
    run_distributed(idle_rank_body, 2)
