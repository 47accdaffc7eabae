"""Every test that needs a CUDA GPU (``pytest -m cuda``; they skip without one). NCCL tests of two or
more ranks need as many GPUs and skip otherwise.

``bash benchmarks/gpu_check.sh`` runs them under torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``),
which checks every kernel's accesses against the streams and events ordering them: what
``hf_lowzero.simulation`` checks on fake tensors, on the real thing. This module imports neither Ray
nor anything the lent GPU machines lack (torch, transformers, safetensors and pytest are there).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, batch, make_inner

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int = 1):
    """Marks a test ``cuda`` and skips it with fewer than ``n`` GPUs."""

    def mark(fn):
        fn = pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPU{'s' * (n > 1)}, {GPUS} here")(fn)
        return pytest.mark.cuda(fn)

    return mark


@contextlib.contextmanager
def world_of_one_on_cuda(tmp_path):
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


# ------------------------------------------------------------------------------ offload


@requires_gpus(1)
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
        pinned = [opt.master.flat, *opt.reducer.store.tensors()]
        assert report.pinned == sum(-(-t.untyped_storage().nbytes() // 4096) * 4096 for t in pinned)
        # The host step runs torch's CPU AdamW kernels, the device step the CUDA ones: rounding may
        # differ in the last bit of the fp32 masters, which can flip one bf16 ulp of a param.
        for step, (params, ref) in enumerate(zip(history, ref_history)):
            for p, q in zip(params, ref):
                torch.testing.assert_close(p, q, rtol=2 * 2**-8, atol=1e-6, msg=f"step {step}")


@requires_gpus(1)
def test_cuda_host_step_waits_for_delayed_copies(tmp_path):
    with world_of_one_on_cuda(tmp_path) as device:
        ref_history, ref_opt = cuda_run(device, offload=True)
        history, opt = cuda_run(device, offload=True, delay_copies=True)
        assert opt.last_grad_norm == ref_opt.last_grad_norm
        for params, ref in zip(history, ref_history):
            assert all(torch.equal(p, q) for p, q in zip(params, ref))


@requires_gpus(1)
def test_pinned_buffers_are_locked_at_their_exact_size_not_through_the_caching_allocator():
    """[Note: exact pinned memory]: page-locked by cudaHostRegister, so torch's caching host
    allocator (which rounds up to a power of two) holds nothing more."""
    from hf_lowzero.zero.runtime import device as dev

    torch.cuda.init()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    buffer = dev.host_buffer(3_000_001, torch.float32, torch.device("cuda", 0))
    assert buffer.is_pinned() and torch.count_nonzero(buffer) == 0
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before
    assert dev.pinned_bytes([buffer]) == 12_001_280
    on_gpu = torch.arange(3_000_001, dtype=torch.float32, device="cuda")
    buffer.copy_(on_gpu, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffer, on_gpu.cpu())


# ---------------------------------------------------------------------- memory snapshots


@requires_gpus(1)
def test_on_cuda_the_copy_runs_on_a_side_stream_and_the_next_step_waits_for_it(tmp_path):
    """[Note: double buffer]: the copy to pinned host buffers is queued behind a ~1 s sleep on the
    side stream; the next optimizer step, launched at once, must not change the tensors before the
    copy read them, so the snapshot holds the state of the step it was taken at."""
    from safetensors.torch import load as load_bytes

    from hf_lowzero.checkpoint.save import shard_tensors
    from hf_lowzero.checkpoint.shards import ShardView
    from hf_lowzero.snapshot import ShardStager

    with world_of_one_on_cuda(tmp_path) as device:
        model = BranchyNet().to(device=device, dtype=torch.bfloat16)
        opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2)

        def train_step(step):
            x, y = (t.to(device=device, dtype=torch.bfloat16) for t in batch(0, step))
            opt.backward(mse_loss(model(x), y))
            opt.step()

        for step in range(2):
            train_step(step)
        expected = {k: t.detach().cpu().clone() for k, t in shard_tensors(ShardView.of(opt))[0].items()}
        stager = ShardStager(opt)
        stager._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stager._stream):
            torch.cuda._sleep(2_000_000_000)
        staged = stager.stage(step=2)
        assert staged.copied is not None and all(t.is_pinned() for t in staged.shard.values())
        train_step(2)  # launched while the copy waits behind the sleep
        snapshot = load_bytes(bytes(staged.encode().part("shard")))
        assert set(snapshot) == set(expected)
        for key, value in expected.items():
            assert torch.equal(snapshot[key], value), key
        after = {k: t.detach().cpu() for k, t in shard_tensors(ShardView.of(opt))[0].items()}
        assert any(not torch.equal(after[k], v) for k, v in expected.items()), "the third step changed nothing"
        stager.close()


# ------------------------------------------------------------------------ the memory plan


@requires_gpus(1)
@pytest.mark.parametrize("stage, offload", [(0, False), (2, False), (2, True)])
def test_plan_matches_cuda_max_memory_allocated(stage, offload):
    """The plan (made on fake CUDA tensors, for NCCL) against a real step's
    ``torch.cuda.max_memory_allocated``: within 10%; the model states within 1%."""
    from transformers import GPT2Config

    from hf_lowzero.plan.measure import PlanCase, case_training
    from hf_lowzero.plan.models import ModelSpec
    from hf_lowzero.plan.simulate import Setup, simulate_step

    config = GPT2Config(
        n_layer=4, n_embd=512, n_head=8, vocab_size=8000, n_positions=512, architectures=["GPT2LMHeadModel"]
    )
    spec = ModelSpec.from_source(config)
    training = case_training(PlanCase(bf16=True, batch_size=8))
    planned = simulate_step(spec, training, Setup(stage, offload), 1, 8, 256, backend="nccl")
    assert planned.device == "cuda"
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        measured = simulate_step(spec, training, Setup(stage, offload), 1, 8, 256, fake=False)
    finally:
        dist.destroy_process_group()
    assert planned.model_states == pytest.approx(measured.model_states, rel=0.01)
    assert planned.peak == pytest.approx(measured.allocator_peak, rel=0.10)
    assert planned.host == measured.host


# ------------------------------------------------------------------- NCCL, two or more GPUs


def _nccl_parity(rank: int, world_size: int, offload: bool, tmp: str) -> None:
    """Rank r trains on cuda:r without torch.cuda.set_device ([Note: the params' device]); ZeRO-2
    against DDP on the same data."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", rank)
    model = BranchyNet().to(device)
    reference = DDP(BranchyNet().to(device), device_ids=[rank], find_unused_parameters=True)
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=2, reduce_bucket_mb=0.001, offload_optimizer=offload
    )
    ref_opt = make_inner("adamw", reference.module)
    for step in range(4):
        x, y = (t.to(device) for t in batch(rank, step))
        opt.backward(mse_loss(model(x, use_a=rank == 0), y))
        opt.step()
        opt.zero_grad()
        mse_loss(reference(x, use_a=rank == 0), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), reference.module.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"rank {rank} step {step}")
    from hf_lowzero import full_state_dict, save_checkpoint

    save_checkpoint(opt, f"{tmp}/ckpt")
    full = full_state_dict(opt)
    assert (full is not None) == (rank == 0)


@requires_gpus(2)
@pytest.mark.parametrize("offload", [False, True])
def test_nccl_stage2_equals_ddp_on_gpus_the_current_device_does_not_name(offload, tmp_path):
    run_distributed(_nccl_parity, min(GPUS, 4), backend="nccl", offload=offload, tmp=str(tmp_path))
