"""What a GPU machine changes outside the step, without a GPU: plans on fake GPUs, and on CPU
against a reference: ``use_cpu`` on a GPU machine, kernel choices after a load, the snapshot's RNG
layout, ``zero_stage="auto"``'s device and the offload recommendation (the step itself on fake GPUs:
``tests/test_gpu_path.py``).
"""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig, load_checkpoint, save_checkpoint
from hf_lowzero.checkpoint.layout import META_FILE
from hf_lowzero.plan.request import PlanRequest
from tests.hf_models import tiny_gpt2
from tests.trainer_runs import logged, make_args, train


@pytest.mark.slow  # two plans (18 s); test_plan.py's fast cases plan on fake CUDA devices too
def test_gpu_plans_run_on_fake_gpus():
    """``plan_memory`` plans GPU setups on fake CUDA devices, so the GPU's branches run: CUDA's
    caching allocator recycles the communication scratch that the CPU's pool keeps."""
    from hf_lowzero.plan import plan_memory
    from hf_lowzero.plan.measure import tiny_model_spec

    spec = tiny_model_spec("gpt2")
    plans = {
        backend: plan_memory(spec.config, world_size=2, device_memory="1GiB", seq_len=32, backend=backend)
        for backend in ("nccl", "gloo")
    }
    assert plans["nccl"].simulated_on == "cuda" and plans["gloo"].simulated_on == "cpu"
    assert "simulated on fake CUDA devices" in plans["nccl"].to_text()
    assert plans["nccl"].row(2).breakdown["buffers"] == 0 < plans["gloo"].row(2).breakdown["buffers"]
    gpu, cpu = plans["nccl"].row(2, offload=True), plans["gloo"].row(2, offload=True)
    assert gpu.host_bytes == cpu.host_bytes > 0  # the same host rows, counted exactly


# ---------------------------------------------------------------- use_cpu on a GPU machine


def _train_on_cpu_where_cuda_is_available(out: str) -> tuple[dict, str]:
    torch.cuda.is_available = lambda: True  # what a GPU machine says; the run asks for the CPU
    losses = {stage: logged(train(tiny_gpt2(), make_args(f"{out}/{stage}", stage)), "loss") for stage in (0, 2)}
    return losses, dist.get_backend()


def test_use_cpu_on_a_gpu_machine_trains_on_gloo_like_plain_trainer(tmp_path):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        losses, backend = pool.apply(_train_on_cpu_where_cuda_is_available, (str(tmp_path),))
    assert backend == "gloo"  # NCCL would refuse the CPU tensors at the first collective
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)


# ------------------------------------------------------------------------ kernel choice


def _optimizer(model, offload: bool) -> LowLevelZeroOptimizer:
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return LowLevelZeroOptimizer(model, inner, ZeroConfig(stage=2, offload_optimizer=offload))


def _steps(model, opt, n: int) -> None:
    for i in range(n):
        torch.manual_seed(100 + i)
        ids = torch.randint(0, model.config.vocab_size, (2, 12))
        opt.backward(model(ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("saved_kernel", [{"fused": None, "foreach": None}, {"capturable": True, "fused": None}])
def test_kernel_choice_after_loading_is_the_loading_optimizers(single_rank_group, tmp_path, saved_kernel):
    """A checkpoint's groups say which kernel the saving run used (on a GPU: torch's default, or
    capturable for CUDA graphs); an offloaded run loading it keeps the fused host kernel it chose."""
    model = tiny_gpt2()
    opt = _optimizer(model, offload=True)
    _steps(model, opt, 2)
    save_checkpoint(opt, tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / META_FILE
    meta = json.loads(meta_file.read_text())
    for group in meta["param_groups"]:
        group["hyperparameters"].update(saved_kernel)  # what a GPU run's checkpoint holds
    meta_file.write_text(json.dumps(meta))
    expected = {k: opt.optim.param_groups[0][k] for k in ("fused", "foreach", "capturable")}
    reference = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, 2)
    continued = [p.detach().clone() for p in model.parameters()]

    model = tiny_gpt2()
    resumed = _optimizer(model, offload=True)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference))
    for group in resumed.optim.param_groups + resumed.param_groups:
        assert {k: group[k] for k in expected} == expected == {"fused": True, "foreach": None, "capturable": False}
    _steps(model, resumed, 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), continued))


# ---------------------------------------------------------------------- snapshot RNG files


def test_snapshot_rng_state_has_the_layout_the_trainer_saves(tmp_path, monkeypatch):
    """transformers keeps every GPU's CUDA RNG state when the run is distributed, whatever its size
    (a one-worker Ray run), and reads the same layout back; a snapshot's RNG state matches it."""
    from transformers.training_args import ParallelMode

    from hf_lowzero import LowZeroTrainer
    from hf_lowzero.trainer.snapshot_files import rng_from_json, trainer_manifest
    from tests.hf_models import TokenDataset

    states = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.random, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda.random, "get_rng_state", lambda device="cuda": states[0].clone())
    args = make_args(tmp_path, 2)
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset())
    for mode in (ParallelMode.DISTRIBUTED, ParallelMode.NOT_PARALLEL):  # both at world size 1
        monkeypatch.setattr(type(args), "parallel_mode", property(lambda self, mode=mode: mode))
        saved_dir = tmp_path / mode.value
        trainer._save_rng_state(str(saved_dir))
        saved = torch.load(saved_dir / "rng_state.pth", weights_only=False)["cuda"]
        restored = rng_from_json(trainer_manifest(trainer, include_state=False)["rng"])["cuda"]
        assert type(restored) is type(saved), mode
        for a, b in zip(
            restored if isinstance(restored, list) else [restored], saved if isinstance(saved, list) else [saved]
        ):
            assert torch.equal(a, b), mode


# ------------------------------------------------------------------ zero_stage="auto"


def test_auto_stage_measures_the_trainers_device_and_checks_host_memory(tmp_path, monkeypatch):
    from hf_lowzero.trainer import auto

    asked, planned = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (3 << 30, 8 << 30))
    monkeypatch.setattr(auto, "node_available_memory", lambda: 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")

    def plan(spec, args, **options):
        planned.append(PlanRequest.of(args, **options))  # what plan_memory makes of the Trainer's inputs
        raise RuntimeError("planned")  # what was asked is all this test needs

    monkeypatch.setattr(auto, "plan_memory", plan)
    args = make_args(tmp_path, "auto")  # use_cpu=True
    with pytest.raises(RuntimeError, match="planned"):
        auto.resolve_auto_stage(args, tiny_gpt2())
    assert asked == []  # use_cpu: no GPU is asked, none gets a context
    assert planned[-1].backend == "gloo" and planned[-1].device_memory == 8 << 30  # 64 GiB / 8 ranks
    assert (planned[-1].host_memory, planned[-1].ranks_per_node) == (64 << 30, 8)

    args.use_cpu = False  # a GPU run: the Trainer trains on the GPU its arguments give it
    monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda", 3)))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match="planned"):
        auto.resolve_auto_stage(args, tiny_gpt2())
    assert asked == [torch.device("cuda", 3)]  # the GPU the Trainer trains on, not LOCAL_RANK's
    assert planned[-1].backend == "nccl" and planned[-1].device_memory == 3 << 30


def test_offload_is_recommended_only_when_the_nodes_ranks_fit_in_its_memory():
    from hf_lowzero.plan import plan_memory
    from hf_lowzero.plan.measure import tiny_model_spec

    config = tiny_model_spec("gpt2").config
    tight = plan_memory(config, world_size=8, device_memory="1GiB", seq_len=32, backend="gloo")
    host = tight.row(2, offload=True).host_bytes
    for ranks_per_node, fits in [(1, True), (8, False)]:
        plan = plan_memory(
            config,
            world_size=8,
            device_memory="1GiB",
            seq_len=32,
            backend="gloo",
            host_memory=4 * host,
            ranks_per_node=ranks_per_node,
        )
        assert plan.row(2, offload=True).fits is fits and plan.ranks_per_node == ranks_per_node
