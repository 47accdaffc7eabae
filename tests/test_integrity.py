"""Integrity checks at runtime ([Note: integrity checks] in hf_lowzero/zero/integrity/checker.py).

Faults injected through hf_lowzero.zero.integrity.reduction_faults (transport and reduced rows) or by the test itself
(a weight changed on one rank, a NaN in one rank's gradient) are caught within ``verify_every``
steps and named exactly: rank, step, parameter; at W = 2, 3 and 4. Long runs with every step
verified raise no false alarm: fp32, fp16 with overflow skips, bf16, row shards and whole params,
accumulation and unused params.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import IntegrityError, LowLevelZeroOptimizer, ZeroConfig
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.integrity.reduction_faults import Fault, inject
from tests.models import BranchyNet, batch, make_inner

EVERY = 3


def _optimizer(model, world_size, **overrides):
    config = dict(stage=2, reduce_bucket_mb=0.001, verify_every=EVERY, clip_grad_norm=1.0)
    inner = make_inner(overrides.pop("inner", "adamw"), model)
    return LowLevelZeroOptimizer(model, inner, ZeroConfig(**(config | overrides)))


def _train(model, opt, rank, steps, micro=1, dtype=torch.float32, each_step=None):
    for step in range(steps):
        if each_step is not None:
            each_step(step + 1)
        for m in range(micro):
            x, y = (t.to(dtype) for t in batch(rank, step, m))
            local = opt.no_sync() if opt.config.stage == 1 and m < micro - 1 else contextlib.nullcontext()
            with local:
                # every rank uses embed and head; branch_a only even ranks, branch_b not every step
                use_b = step % 3 != 0 or rank % 2 == 1
                opt.backward(mse_loss(model(x, use_a=rank % 2 == 0, use_b=use_b).float(), y.float()) / micro)
        opt.step()
        opt.zero_grad()


def _bucket_of(opt, name):
    return next(b for b in opt.buckets if any(s.name == name for s in b.slots))


# -------------------------------------------------------------------------- faults


def _fault_body(rank, world_size, kinds, target):
    for kind in kinds:  # one spawn for all: starting ranks costs more than the runs
        _one_fault(rank, world_size, kind, target)


def _one_fault(rank, world_size, kind, target):
    """A fault lasting EVERY steps from step 5, between verify steps (1, 4, 7, ... with EVERY=3):
    caught at step 7, named exactly."""
    model = BranchyNet()
    opt = _optimizer(model, world_size)
    bucket = _bucket_of(opt, target)
    assert [s.name for s in bucket.slots] == [target], "one param per bucket: the fault names it alone"
    faulty = world_size - 1
    fault = Fault(kind, rank=faulty, step=5, bucket=bucket.index, element=3, times=EVERY)
    with inject(fault), pytest.raises(IntegrityError) as caught:
        _train(model, opt, rank, steps=10)
    error = caught.value
    assert (error.step, error.names, error.kind) == (7, [target], "reduction"), str(error)
    assert error.ranks == [faulty], str(error)
    what = {"drop": "contribution was dropped", "double": "contribution was doubled", "flip": "reduced rows differ"}
    assert f"rank {faulty}'s {what[kind]}" in str(error) and "at step 7" in str(error), str(error)
    assert (opt.integrity.checks, opt.integrity.failures) == (3, 1)  # steps 1 and 4 passed, 7 failed


# W=3 in the fast tier (an odd size: padding, a majority); 2 (no majority) in the slow one. W=4 runs in
# test_a_weight_changed_on_one_rank_is_caught_and_named only: a majority of 3 among 4 is nothing new here.
SIZES = [pytest.param(2, marks=pytest.mark.slow), 3]


@pytest.mark.parametrize("world_size", SIZES)
def test_reduction_faults_are_caught_and_named(world_size):
    """A contribution dropped, one doubled, a bit flipped in the reduced rows."""
    run_distributed(_fault_body, world_size, kinds=["drop", "double", "flip"], target="embed.weight")


def _replica_body(rank, world_size, targets):
    for target in targets:
        _one_replica(rank, world_size, target)


def _one_replica(rank, world_size, target):
    model = BranchyNet()
    opt = _optimizer(model, world_size)
    param = dict(model.named_parameters())[target]

    def corrupt(step):  # rank 1's copy goes wrong after step 4's all-gather, for EVERY steps
        if rank == 1 and 5 <= step < 5 + EVERY:
            opt.wait_for_params()  # the fault strikes the landed params, not a gather still in flight
            with torch.no_grad():
                param.view(-1)[2] += 0.5

    with pytest.raises(IntegrityError) as caught:
        _train(model, opt, rank, steps=12, each_step=corrupt)
    error = caught.value
    assert (error.step, error.names, error.kind) == (7, [target], "replica"), str(error)
    assert error.ranks == ([0, 1] if world_size == 2 else [1]), str(error)


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_a_weight_changed_on_one_rank_is_caught_and_named(world_size):
    """A trainable weight (repaired by the next all-gather, so changed for EVERY steps) and a frozen one."""
    run_distributed(_replica_body, world_size, targets=["head.weight", "frozen.weight"])


def _nan_body(rank, world_size, target):
    model = BranchyNet()
    opt = _optimizer(model, world_size, verify_every=1)
    param = dict(model.named_parameters())[target]
    faulty = world_size - 1
    param.register_hook(lambda g: g.clone().fill_(float("nan")) if rank == faulty and opt.integrity.step == 3 else g)
    _train(model, opt, rank, steps=3)
    assert opt.skipped_steps == 1  # step 3, on every rank
    assert opt.integrity.last_nonfinite == [(faulty, target)]  # named before the reduction mixed it in
    _train(model, opt, rank, steps=1)
    assert opt.skipped_steps == 1 and opt.integrity.last_nonfinite == [] and opt.integrity.failures == 0
    # when skipping becomes an error, the error says where the non-finite gradients came from
    opt.config.max_consecutive_skips = 1
    param.register_hook(lambda g: g.clone().fill_(float("nan")) if rank == faulty else g)
    with pytest.raises(RuntimeError, match=rf"rank {faulty}: '{target}'"):
        _train(model, opt, rank, steps=1)


@pytest.mark.parametrize("world_size", SIZES)
def test_nan_in_one_ranks_gradient_is_attributed_to_its_rank_and_parameter(world_size):
    run_distributed(_nan_body, world_size, target="embed.weight")


# ----------------------------------------------------------------- no false alarms


def _clean_body(rank, world_size, runs, steps):
    for dtype, stage, micro, inner in runs:
        _one_clean(rank, world_size, dtype, stage, micro, inner, steps)


def _one_clean(rank, world_size, dtype, stage, micro, inner, steps):
    torch.manual_seed(0)
    model = BranchyNet().to(dtype)
    config = dict(stage=stage, verify_every=1, clip_grad_norm=1.0)
    if dtype == torch.float16:
        config |= dict(initial_scale=2.0**24, growth_interval=5)  # overflows at the start and as it regrows
    opt = _optimizer(model, world_size, inner=inner, **config)
    _train(model, opt, rank, steps=steps, micro=micro, dtype=dtype)
    assert opt.integrity.checks == steps and opt.integrity.failures == 0
    if dtype == torch.float16:
        assert opt.skipped_steps >= 2  # the overflows were there, and raised nothing


CLEAN_RUNS = [
    (torch.float32, 2, 1, "adamw"),
    (torch.float16, 1, 2, "adamw"),
    (torch.bfloat16, 2, 2, "adamw"),
    (torch.bfloat16, 2, 1, "adafactor"),  # whole-param ownership: all-to-all reductions
]


@pytest.mark.slow  # about 90 s; the fast tier runs 40 steps of each
def test_three_hundred_verified_steps_raise_no_false_alarm():
    run_distributed(_clean_body, 2, runs=CLEAN_RUNS, steps=300)


def test_verified_steps_raise_no_false_alarm():
    run_distributed(_clean_body, 2, runs=CLEAN_RUNS, steps=40)


def _auto_body(rank, world_size):
    import torch.distributed as dist

    model = BranchyNet()
    opt = _optimizer(model, world_size, verify_every="auto")
    _train(model, opt, rank, steps=30)
    intervals = [None] * world_size
    dist.all_gather_object(intervals, (opt.integrity.interval, opt.integrity.checks))
    assert len(set(intervals)) == 1  # every rank verifies the same steps: the collectives line up
    assert opt.integrity.checks >= 1 and opt.integrity.failures == 0


def test_auto_interval_is_the_same_on_every_rank():
    run_distributed(_auto_body, 3)


def test_verify_every_validates():
    with pytest.raises(ValueError, match="verify_every=0 is invalid"):
        ZeroConfig(verify_every=0)
    with pytest.raises(ValueError, match="on_mismatch='ignore' is invalid"):
        ZeroConfig(on_mismatch="ignore")
    assert ZeroConfig(verify_every="10").verify_every == 10 and ZeroConfig().verify_every == "auto"
