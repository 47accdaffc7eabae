"""Optimizer offload: master rows, optimizer state and gradient rows in host memory.

On CPU the host is the device, so the offload path (host gradient rows with staging, the step on
the host rows, the copy back before the all-gather) runs the same kernels as without offload:
parameters must be bit-identical after every step. The CUDA tests (skipped without a GPU) check
placement, pinned memory, and that the host step never reads a row before its copy completed.
"""

import contextlib

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.grad_store import HostGradStore
from tests.models import BranchyNet, batch, make_inner

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
            assert opt.last_grad_norm == ref_opt.last_grad_norm, where
            assert (opt.loss_scale, opt.skipped_steps) == (ref_opt.loss_scale, ref_opt.skipped_steps), where
            for i, (p, q) in enumerate(zip(params_of(model), params_of(ref_model))):
                assert torch.equal(p, q), f"{where} step {step} param {i}"
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
                assert torch.equal(p, q), f"{where} resumed across offload, param {i}"


@pytest.mark.parametrize("world_size", [1, 2, 3])
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


# ----------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@contextlib.contextmanager
def world_of_one_on_cuda(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


def cuda_run(device, offload, delay_copies=False, steps=3):
    """bf16 BranchyNet on CUDA with AdamW; returns params after each step and the optimizer."""
    model = BranchyNet().to(device=device, dtype=torch.bfloat16)
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=2, reduce_bucket_mb=0.001, offload_optimizer=offload
    )
    history = []
    for step in range(steps):
        if delay_copies:
            # Everything queued on the copy stream waits ~1 s: a host step that read a row before
            # its copy completed would see stale values.
            with torch.cuda.stream(opt.reducer.store.stream):
                torch.cuda._sleep(2_000_000_000)
        x, y = (t.to(device=device, dtype=torch.bfloat16) for t in batch(0, step))
        opt.backward(mse_loss(model(x), y))
        opt.step()
        history.append([p.detach().float().cpu() for p in model.parameters()])
    return history, opt


@cuda
def test_cuda_offload_places_state_on_pinned_host_memory_and_tracks_no_offload(tmp_path):
    with world_of_one_on_cuda(tmp_path) as device:
        ref_history, ref_opt = cuda_run(device, offload=False)
        history, opt = cuda_run(device, offload=True)
        assert opt.master.flat.device.type == "cpu" and opt.master.flat.is_pinned()
        assert opt.reducer.store.flat.is_pinned()
        assert all(v.device.type == "cpu" for s in opt.optim.state.values() for v in s.values() if v.dim())
        report = opt.memory_report()
        on_gpu = report.by_device[str(device)]
        assert on_gpu == report.params + report.buffers  # only the bf16 params (and buffers) stay on the GPU
        # The host step runs torch's CPU AdamW kernels, the device step the CUDA ones: rounding may
        # differ in the last bit of the fp32 masters, which can flip one bf16 ulp of a param.
        for step, (params, ref) in enumerate(zip(history, ref_history)):
            for p, q in zip(params, ref):
                torch.testing.assert_close(p, q, rtol=2 * 2**-8, atol=1e-6, msg=f"step {step}")


@cuda
def test_cuda_host_step_waits_for_delayed_copies(tmp_path):
    with world_of_one_on_cuda(tmp_path) as device:
        ref_history, ref_opt = cuda_run(device, offload=True)
        history, opt = cuda_run(device, offload=True, delay_copies=True)
        assert opt.last_grad_norm == ref_opt.last_grad_norm
        for params, ref in zip(history, ref_history):
            assert all(torch.equal(p, q) for p, q in zip(params, ref))
