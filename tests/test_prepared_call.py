"""A CPU run's inner step with our host kernel, its call prepared once ([Note: a prepared call] in
``hf_lowzero/zero/host/prepared.py``), against torch's fused step of the same rows (the path before
it): bit-equal params and optimizer state after every step, at W = 1 and 2, stage 1 and 2, with two
param groups, an lr that changes every step, clipping, branches used on some ranks and steps and a
param used on no rank; and after what changes the tensors the call points into (the state loaded from
a checkpoint, a moment replaced by hand, params made unused), the new tensors are the ones stepped."""

import io

import pytest
import torch

from hf_lowzero import LowLevelZeroOptimizer
from tests.models import BranchyNet, param_groups
from tests.test_host_step import assert_same_state, run_with_our_kernel, torch_path
from tests.test_offload import train_step

STEPS = 8


def build(stage: int, clip: float):
    model = BranchyNet(0)
    opt = LowLevelZeroOptimizer(
        model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)), stage=stage, clip_grad_norm=clip,
        reduce_bucket_mb=0.001,
    )  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, opt, schedule


def reload(opt) -> None:
    """The inner state through a checkpoint's bytes: every state tensor a new one."""
    buffer = io.BytesIO()
    torch.save(opt.optim.state_dict(), buffer)
    buffer.seek(0)
    opt.optim.load_state_dict(torch.load(buffer))


def parity_body(rank, world_size):
    for stage, clip in ((1, 0.0), (2, 0.05), (1, 0.5)):
        where = f"W={world_size} stage {stage} clip {clip}"
        (model, opt, schedule), (ref_model, ref, ref_schedule) = build(stage, clip), build(stage, clip)
        assert opt.host_step is not None and opt.host_step.copy is None, where  # fp32 params: no 16-bit copy
        torch_path(ref)
        for step in range(STEPS):
            if step == 3:  # a checkpoint loaded into both
                reload(opt)
                reload(ref)
            if step == 5:  # a moment replaced by hand, on ours only: the new tensor is the one stepped
                state = next(iter(opt.optim.state.values()))
                state["exp_avg"] = state["exp_avg"].clone()
            train_step(model, opt, rank, step, torch.float32)
            train_step(ref_model, ref, rank, step, torch.float32)
            schedule.step()
            ref_schedule.step()
            assert (opt.host_step.last_path, ref.host_step.last_path) == ("ours", "torch"), f"{where} step {step}"
            for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
                assert torch.equal(p, q), f"{where} step {step} param {i}"
            assert_same_state(opt, ref, f"{where} step {step}")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_cpu_runs_kernel_call_steps_as_torchs_fused_step(world_size):
    run_with_our_kernel(parity_body, world_size)
