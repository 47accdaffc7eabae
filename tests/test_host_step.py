"""The offloaded step with our host kernel against today's path (torch's fused AdamW/Adam stepping
the same host rows): bit-equal params and optimizer state after every step without clipping, and
within rounding with it (ours multiplies by the clip factor, as the device path does; torch's path
divides by its inverse, as ``grad_scale``), stage 1 and 2, fp32/bf16/fp16
params, accumulation and unused params, W = 1 and 2; and a run switches between the two paths
([Note: our kernel in torch's place] in ``hf_lowzero/zero/host/adam_step.py``)."""

import pytest
import torch

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.host.kernel import host_kernel
from hf_lowzero.zero.runtime import native
from tests.models import BranchyNet, param_groups
from tests.test_offload import train_step  # the same accumulation, unused branches and stage-1 no_sync

CASES = [  # stage, params' dtype, inner, clip
    (1, torch.float32, "adamw", 0.0),
    (2, torch.float32, "adam", 0.05),
    (2, torch.bfloat16, "adamw", 0.0),
    (1, torch.bfloat16, "adamw", 0.5),
    (2, torch.float16, "adam", 0.0),
]


def build(stage, dtype, inner, clip):
    model = BranchyNet(0).to(dtype)
    groups = param_groups(model)
    kind = torch.optim.AdamW if inner == "adamw" else torch.optim.Adam
    fp16 = {"initial_scale": 2.0**10} if dtype is torch.float16 else {}
    opt = LowLevelZeroOptimizer(
        model, kind(groups, betas=(0.9, 0.95)), stage=stage, clip_grad_norm=clip, reduce_bucket_mb=0.001,
        offload_optimizer=True, **fp16,
    )  # fmt: skip
    return model, opt


def torch_path(opt):
    """Today's path: a step hook on the inner optimizer sends the step to torch's own kernel."""
    return opt.optim.register_step_pre_hook(lambda *_: None)


def assert_same_state(opt, ref, where):
    """torch's format, the same keys (no state for a param used on no rank), the same bits."""
    mine, theirs = opt.optim.state_dict()["state"], ref.optim.state_dict()["state"]
    assert mine.keys() == theirs.keys(), where
    for index in mine:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            a, b = mine[index][key], theirs[index][key]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: state {index} {key}"


def assert_close_state(opt, ref, where):
    """With clipping: the same keys, values within a few roundings (one rounding of each gradient differs)."""
    mine, theirs = opt.optim.state_dict()["state"], ref.optim.state_dict()["state"]
    assert mine.keys() == theirs.keys(), where
    for index in mine:
        assert torch.equal(mine[index]["step"], theirs[index]["step"]), f"{where}: state {index} step"
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(mine[index][key], theirs[index][key], rtol=1e-4, atol=1e-9, msg=where)


def parity_body(rank, world_size):
    for stage, dtype, inner, clip in CASES:
        where = f"W={world_size} stage {stage} {dtype} {inner} clip {clip}"
        (model, opt), (ref_model, ref) = build(stage, dtype, inner, clip), build(stage, dtype, inner, clip)
        hook = torch_path(ref)
        assert (opt.host_step.copy is None) == (dtype is torch.float32), where  # 16-bit params: the kernel writes them
        for step in range(5):
            if step == 3:  # switch: the state is torch's own, so either path continues the other's run
                hook.remove()
                hook = torch_path(opt)
            train_step(model, opt, rank, step, dtype)
            train_step(ref_model, ref, rank, step, dtype)
            paths = (opt.host_step.last_path, ref.host_step.last_path)
            assert paths == (("ours", "torch") if step < 3 else ("torch", "ours")), f"{where} step {step}: {paths}"
            for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
                if clip == 0.0:
                    assert torch.equal(p, q), f"{where} step {step} param {i}"
                else:  # one ulp of the 16-bit params where the fp32 masters round across a boundary
                    rtol = 1e-5 if dtype is torch.float32 else 1e-2
                    torch.testing.assert_close(p, q, rtol=rtol, atol=1e-6, msg=f"{where} step {step} param {i}")
            if clip == 0.0:
                assert_same_state(opt, ref, f"{where} step {step}")
            else:
                assert_close_state(opt, ref, f"{where} step {step}")


def run_with_our_kernel(body, world_size: int) -> None:
    """``body`` on ``world_size`` ranks, or a skip saying why our kernel is not here (no compiler)."""
    kernel = host_kernel()
    if isinstance(kernel, native.NativeUnavailable):
        pytest.skip(kernel.why)
    run_distributed(body, world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_our_host_kernel_steps_as_todays_offload_path(world_size):
    run_with_our_kernel(parity_body, world_size)


def fallback_body(rank, world_size):
    """Where ours would not be exact, torch's step runs, as before: SGD gets no host step of ours
    at all; amsgrad, a foreach group and a step hook are told apart at every step."""
    model = BranchyNet(0)
    opt = LowLevelZeroOptimizer(model, torch.optim.SGD(param_groups(model), lr=0.1), offload_optimizer=True)
    assert opt.host_step.why_not() == "not Adam or AdamW" and opt.host_step.copy is None
    for make, why in (
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.AdamW(ps, foreach=True), "not fused"),
    ):
        model = BranchyNet(0)
        opt = LowLevelZeroOptimizer(model, make(param_groups(model)), offload_optimizer=True)
        train_step(model, opt, rank, 0, torch.float32)
        assert opt.host_step.last_path == "torch" and why in opt.host_step.why_not(), why
        assert all(s["step"].item() == 1 for s in opt.optim.state.values())  # torch's step ran
    model = BranchyNet(0)
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(param_groups(model)), offload_optimizer=True)
    train_step(model, opt, rank, 0, torch.float32)
    assert opt.host_step.last_path == "ours"
    hook = torch_path(opt)
    assert "step hooks" in opt.host_step.why_not()
    hook.remove()
    assert opt.host_step.why_not() is None
    state = next(iter(opt.optim.state.values()))
    state["step"] = state["step"].double()  # a state tensor replaced (a load): checked again
    assert "float32 scalar step" in opt.host_step.why_not()
    state["step"] = state["step"].float()
    assert opt.host_step.why_not() is None


def test_where_ours_would_not_be_exact_torchs_step_runs():
    run_distributed(fallback_body, 1)


def narrow_rows_body(rank, world_size):
    """[Note: 16-bit rows]: bf16 reductions that get one contribution a step (stage 1) are stepped
    from the bf16 rows themselves; the fp32 rows the inner params' ``.grad`` view are never
    written (no widening pass), yet the bits are those of torch's step, which widens them first."""
    (model, opt), (ref_model, ref) = build(1, torch.bfloat16, "adamw", 0.0), build(1, torch.bfloat16, "adamw", 0.0)
    torch_path(ref)
    for step in range(3):
        train_step(model, opt, rank, step, torch.bfloat16)
        train_step(ref_model, ref, rank, step, torch.bfloat16)
        assert (opt.host_step.last_path, ref.host_step.last_path) == ("ours", "torch")
        assert not opt.reducer.store.flat.any(), "our step widened the bf16 rows into the fp32 rows"
        assert ref.reducer.store.flat.any(), "torch's step read fp32 rows that were never written"
        for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
            assert torch.equal(p, q), f"step {step} param {i}"
        assert_same_state(opt, ref, f"step {step}")


def test_sixteen_bit_rows_are_stepped_as_they_came():
    run_with_our_kernel(narrow_rows_body, 2)
