"""Optimizer offload: master rows, optimizer state and gradient rows in host memory.

On CPU the host is the device, so the offload path (host gradient rows with staging, the step on
the host rows, the copy back before the all-gather) runs the same kernels as without offload:
parameters must be bit-identical after every step. The CUDA tests (skipped without a GPU) check
placement, pinned memory, and that the host step never reads a row before its copy completed.
"""

import contextlib
import math

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.grads.grad_store import HostGradStore
from hf_lowzero.zero.grads.norm import squared_norm
from hf_lowzero.zero.update.kernel_factor import StepFactor
from tests.models import BranchyNet, batch, make_inner
from tests.tiers import slow

MICRO = 2
CASES = [  # stage, dtype, inner, clip, partition
    (1, torch.float32, "adamw", 0.05, "rows"),
    (2, torch.float32, "sgd", 0.0, "rows"),
    (2, torch.bfloat16, "adamw", 0.5, "rows"),
    (1, torch.float16, "adamw", 0.0, "rows"),
    (2, torch.bfloat16, "adafactor", 0.5, "params"),
]


def build(stage, dtype, inner, clip, offload, seed=0, partition="rows"):
    model = BranchyNet(seed).to(dtype)
    fp16 = {"initial_scale": 2.0**10} if dtype is torch.float16 else {}
    opt = LowLevelZeroOptimizer(
        model,
        make_inner(inner, model),
        stage=stage,
        clip_grad_norm=clip,
        reduce_bucket_mb=0.001,
        offload_optimizer=offload,
        partition=partition,
        **fp16,
    )
    return model, opt


def train_step(model, opt, rank, step, dtype):
    for micro in range(MICRO):
        x, y = (t.to(dtype) for t in batch(rank, step, micro))
        use_a, use_b = (rank + step) % 2 == 0, (rank + micro) % 3 != 0
        local = opt.no_sync() if opt.config.stage == 1 and micro < MICRO - 1 else contextlib.nullcontext()
        with local:
            opt.backward(mse_loss(model(x, use_a, use_b), y) / MICRO)
    opt.step()
    opt.zero_grad()


def assert_same(p, q, clip, where):
    """Offload against no offload: bit-equal without clipping; with it, up to the norm's summation
    order and the clip factor's rounding in the kernel ([Note: the factor in the kernel]), within
    torch's tolerance for the params' dtype."""
    if clip:
        torch.testing.assert_close(p, q, msg=lambda m: f"{where}: {m}")
    else:
        assert torch.equal(p, q), where


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def parity_body(rank, world_size, tmp):
    for stage, dtype, inner, clip, partition in CASES:
        where = f"stage {stage} {dtype} {inner} clip {clip} {partition}"
        runs = {offload: build(stage, dtype, inner, clip, offload, partition=partition) for offload in (False, True)}
        offloaded = runs[True][1]
        assert isinstance(offloaded.reducer.store, HostGradStore) and offloaded.master.flat.device.type == "cpu"
        for step in range(4):
            for model, opt in runs.values():
                train_step(model, opt, rank, step, dtype)
            (ref_model, ref_opt), (model, opt) = runs[False], runs[True]
            # [Note: the norm before the copy]: the same blocks, summed per bucket first.
            assert math.isclose(opt.last_grad_norm, ref_opt.last_grad_norm, rel_tol=1e-6), where
            assert (opt.loss_scale, opt.skipped_steps) == (ref_opt.loss_scale, ref_opt.skipped_steps), where
            for i, (p, q) in enumerate(zip(params_of(model), params_of(ref_model))):
                assert_same(p, q, clip, f"{where} step {step} param {i}")
        assert all(v.device.type == "cpu" for s in offloaded.optim.state.values() for v in s.values())
        report = offloaded.memory_report()
        held = report.model_state_bytes + report.buffers + report.comm_buffers
        assert sum(report.by_device.values()) == held

        # Checkpoints are interchangeable: saved with offload, loaded without (and back).
        tag = f"{tmp}/{stage}-{dtype}-{inner}"
        save_checkpoint(offloaded, f"{tag}-offload")
        save_checkpoint(runs[False][1], f"{tag}-device")
        swapped = {
            False: build(stage, dtype, inner, clip, False, seed=4, partition=partition),
            True: build(stage, dtype, inner, clip, True, 4, partition=partition),
        }
        load_checkpoint(swapped[False][1], f"{tag}-offload")
        load_checkpoint(swapped[True][1], f"{tag}-device")
        for step in range(4, 6):
            for model, opt in list(runs.values()) + list(swapped.values()):
                train_step(model, opt, rank, step, dtype)
        for model, _ in swapped.values():
            for i, (p, q) in enumerate(zip(params_of(model), params_of(runs[False][0]))):
                assert_same(p, q, clip, f"{where} resumed across offload, param {i}")


@pytest.mark.parametrize("world_size", [1, 2, slow(3)])
def test_offload_is_bit_identical_to_no_offload(tmp_path, world_size):
    run_distributed(parity_body, world_size, tmp=str(tmp_path))


def reshard_body(rank, world_size, tmp, phase):
    stage, dtype, inner, clip, _ = CASES[2]
    if phase == "save":
        model, opt = build(stage, dtype, inner, clip, offload=True)
        for step in range(3):
            train_step(model, opt, rank, step, dtype)
        save_checkpoint(opt, f"{tmp}/ckpt")
        return
    model, opt = build(stage, dtype, inner, clip, offload=False, seed=5)
    load_checkpoint(opt, f"{tmp}/ckpt")
    reference, ref_opt = build(stage, dtype, inner, clip, offload=True, seed=5)
    load_checkpoint(ref_opt, f"{tmp}/ckpt")
    for p, q in zip(params_of(model), params_of(reference)):
        assert torch.equal(p, q)


def test_offload_checkpoint_loads_at_another_world_size_without_offload(tmp_path):
    run_distributed(reshard_body, 2, tmp=str(tmp_path), phase="save")
    run_distributed(reshard_body, 3, tmp=str(tmp_path), phase="load")


def fused_adamw_step(grad, factor_in_kernel, coef):
    """One fused AdamW step over a fixed row, the factor applied by ``StepFactor``."""
    row = torch.linspace(-1, 1, 4099)
    row.grad = grad.clone()
    inner = torch.optim.AdamW([row], lr=1e-2, fused=True)
    factor = StepFactor(inner, host_rows=factor_in_kernel)
    with factor.applied([row.grad], coef, host_kernel=False):
        inner.step()
    assert not hasattr(inner, "grad_scale")  # only for that step
    return row


def test_the_factor_in_the_kernel_is_the_multiply():
    """[Note: the factor in the kernel]: a power of two (the fp16 loss scale) gives the multiply's
    bits; a clipping factor differs from it by at most one rounding of the gradient."""
    grad = torch.randn(4099, generator=torch.Generator().manual_seed(0)) * 1e3
    row = torch.zeros(1, requires_grad=True)
    assert StepFactor(torch.optim.AdamW([row], fused=True), host_rows=True).in_kernel()
    assert not StepFactor(torch.optim.AdamW([row], fused=True), host_rows=False).in_kernel()
    assert not StepFactor(torch.optim.AdamW([row], foreach=True), host_rows=True).in_kernel()
    assert not StepFactor(torch.optim.SGD([row], lr=0.1, fused=True), host_rows=True).in_kernel()
    for coef in (2.0**-10, 0.37 / 2.0**10):
        folded, multiplied = fused_adamw_step(grad, True, coef), fused_adamw_step(grad, False, coef)
        if coef == 2.0**-10:
            assert torch.equal(folded, multiplied)
        else:
            torch.testing.assert_close(folded, multiplied, rtol=1e-6, atol=1e-7)
            assert not torch.equal(folded.grad, grad)  # the kernel wrote the divided gradient back


def store_body(rank, world_size):
    model, opt = build(2, torch.float32, "adamw", 1.0, offload=True)
    store, buckets = opt.reducer.store, opt.buckets
    x, y = batch(rank, 0, 0)
    opt.backward(mse_loss(model(x, True, True), y))
    taken = [store.taken_square(b) for b in buckets]
    assert all(square is not None for square in taken)  # one contribution: taken as it was reduced
    for bucket, square in zip(buckets, taken):
        assert torch.equal(square, squared_norm([store.view(bucket)]))  # the blocked norm of its rows
    opt.backward(mse_loss(model(x, True, True), y))  # stage 2 accumulation: the host rows decide
    assert all(store.taken_square(b) is None for b in buckets)
    opt.step()
    assert all(store.taken_square(b) is None for b in buckets)


def test_the_norm_is_taken_before_the_copy_while_a_bucket_holds_one_contribution():
    run_distributed(store_body, 2)
