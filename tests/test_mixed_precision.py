"""fp16/bf16 params with fp32 master rows: parity with the unsharded master-weight math, overflow
agreement across ranks, loss-scale dynamics, giving up loudly, and ZeRO's memory formulas."""

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, MasterWeightReference, batch, make_inner
from tests.tiers import slow

MICRO = 2
STEPS = 6


def branches(rank: int, step: int, micro: int) -> tuple[bool, bool]:
    return (rank + step) % 2 == 0, (rank + step + micro) % 3 != 0


def train_zero(rank: int, dtype: torch.dtype, stage: int, reference: MasterWeightReference | None = None):
    """STEPS steps of MICRO micro-batches; compares with ``reference`` after every step if given."""
    model = BranchyNet().to(dtype)
    # 2**10: the default 2**16 overflows the first fp16 backwards (as in DeepSpeed); skipping is
    # tested on its own below, here every step should apply so the loss curves can be compared.
    opt = LowLevelZeroOptimizer(
        model, make_inner("sgd", model), stage=stage, clip_grad_norm=0.5, reduce_bucket_mb=0.001, initial_scale=2.0**10
    )
    eps = torch.finfo(dtype).eps
    losses = []
    for step in range(STEPS):
        scale = opt.loss_scale
        total = 0.0
        for micro in range(MICRO):
            x, y = (t.to(dtype) for t in batch(rank, step, micro))
            use_a, use_b = branches(rank, step, micro)
            local = opt.no_sync() if (stage == 1 and micro < MICRO - 1) else contextlib.nullcontext()
            with local:
                loss = mse_loss(model(x, use_a, use_b), y) / MICRO
                opt.backward(loss)
            total += loss.item()
            if reference is not None:
                ref_local = reference.ddp.no_sync() if (stage == 1 and micro < MICRO - 1) else contextlib.nullcontext()
                with ref_local:
                    ((mse_loss(reference.ddp(x, use_a, use_b), y) / MICRO).float() * scale).backward()
                if stage == 2:
                    reference.collect()  # stage 2 accumulates reduced micro-batch grads in fp32
        losses.append(total)
        applied = opt.step()
        if reference is None:
            continue
        assert applied and reference.step(scale), f"step {step} was skipped"
        where = f"{dtype} stage {stage} step {step}"
        for (name, p), q in zip(model.named_parameters(), reference.ddp.module.parameters()):
            torch.testing.assert_close(
                p, q, rtol=2 * eps, atol=2 * eps * 1e-2, msg=lambda m, n=name, w=where: f"{w} {n}: {m}"
            )
        masters = dict(reference.master_model.named_parameters())
        for slot in opt.slots:
            start, end = slot.shard.owned_range(rank)
            row = opt.master.rows[slot.index]
            expected = masters[slot.name].detach().view(-1)[start:end]
            torch.testing.assert_close(row[: end - start], expected, rtol=2 * eps, atol=2 * eps * 1e-2)
            assert not row[end - start :].any(), "master padding must stay zero"
            assert row.dtype is torch.float32
        assert all(p.dtype is dtype for p in model.parameters())
    return losses


def parity_body(rank: int, world_size: int, dtype: torch.dtype) -> None:
    fp32_losses = train_zero(rank, torch.float32, stage=2)
    for stage in (1, 2):
        reference = MasterWeightReference(BranchyNet().to(dtype), "sgd", clip=0.5)
        losses = train_zero(rank, dtype, stage, reference)
        # The 16-bit loss curve tracks the fp32 one (16-bit forward rounding only).
        assert losses == pytest.approx(fp32_losses, rel=20 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("world_size", [2, slow(3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_matches_unsharded_master_weights(world_size, dtype):
    run_distributed(parity_body, world_size, dtype=dtype)


def poison(param: nn.Parameter, when) -> None:
    """Make one element of ``param``'s gradient inf whenever ``when()`` is true."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when():
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    param.register_hook(hook)


def snapshot(model: nn.Module, opt: LowLevelZeroOptimizer) -> list[torch.Tensor]:
    state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + [opt.master.flat.clone()] + state


def overflow_body(rank: int, world_size: int) -> None:
    model = BranchyNet().half()
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=2, hysteresis=2, growth_interval=3, initial_scale=2.0**10
    )
    step = 0
    poison(model.head.weight, lambda: rank == world_size - 1 and step in (2, 3))  # one rank only
    results, scales = [], []
    for step in range(7):
        before = snapshot(model, opt)
        x, y = (t.half() for t in batch(rank, step))
        opt.backward(mse_loss(model(x), y))
        results.append(opt.step())
        scales.append(opt.loss_scale)
        if not results[-1]:
            after = snapshot(model, opt)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed state"
    assert results == [True, True, False, False, True, True, True]
    # 2nd overflow backs off (hysteresis 2); 3 clean steps grow it back.
    assert scales == [2.0**10] * 3 + [2.0**9] * 3 + [2.0**10]
    assert opt.skipped_steps == 2
    adam_steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
    assert adam_steps == {5}, "skipped steps must not advance the optimizer's step counters"
    assert opt.state_dict()["zero"]["loss_scaler"]["scale"] == opt.loss_scale
    assert opt.state_dict()["zero"]["skipped_steps"] == 2

    # bf16: no scaling, but a nan on one rank still makes every rank skip.
    model = BranchyNet().bfloat16()
    opt = LowLevelZeroOptimizer(model, make_inner("sgd", model), stage=1)
    step = 0
    poison(model.embed.weight, lambda: rank == 0 and step == 1)
    results = []
    for step in range(3):
        before = snapshot(model, opt)
        x, y = (t.bfloat16() for t in batch(rank, step))
        opt.backward(mse_loss(model(x), y))
        results.append(opt.step())
        if not results[-1]:
            assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))
    assert results == [True, False, True] and opt.skipped_steps == 1 and opt.loss_scale == 1.0


def give_up_body(rank: int, world_size: int) -> None:
    cases = [
        ({"max_consecutive_skips": 3}, "3 consecutive steps were skipped", 2),
        ({"initial_scale": 4.0, "min_scale": 1.0, "hysteresis": 1}, "minimum loss scale", 2),  # 4 -> 2 -> 1 -> error
    ]
    for overrides, message, skips_before_error in cases:
        model = BranchyNet().half()
        opt = LowLevelZeroOptimizer(model, make_inner("sgd", model), stage=1, **overrides)
        poison(model.head.bias, lambda: rank == 0)
        for step in range(skips_before_error):
            x, y = (t.half() for t in batch(rank, step))
            opt.backward(mse_loss(model(x), y))
            assert opt.step() is False
        opt.backward(mse_loss(model(x), y))
        with pytest.raises(RuntimeError, match=message):
            opt.step()


def test_overflow_on_one_rank_skips_the_step_everywhere():
    run_distributed(overflow_body, 3)


def test_a_run_that_cannot_progress_raises():
    run_distributed(give_up_body, 2)


def memory_body(rank: int, world_size: int, stage: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(257, 301), nn.Tanh(), nn.Linear(301, 129)).half()
    psi = sum(p.numel() for p in model.parameters())
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=stage, reduce_bucket_mb=0.05)

    def backward():
        opt.backward(model(torch.randn(4, 257).half()).float().square().mean())

    backward()
    assert opt.step()
    backward()  # gradients held until the next step
    # ZeRO paper, fp16 params + Adam (fp32 master copy, momentum, variance: K = 12 bytes/param),
    # plus fp32 gradient rows: 2Psi + 16Psi/W for both stages (stage 1 reduce-scatters too).
    report = opt.memory_report()
    assert report.model_state_bytes == pytest.approx(2 * psi + 16 * psi / world_size, rel=0.01)
    assert report.model_state_bytes < 16 * psi  # plain DDP with fp16 params + Adam: (2 + 2 + 12) psi
    if stage == 1:  # accumulating under no_sync() keeps the full local fp16 gradients: + 2Psi
        with opt.no_sync():
            backward()
        report = opt.memory_report()
        assert report.model_state_bytes == pytest.approx(4 * psi + 16 * psi / world_size, rel=0.01)
    assert opt.step()


@pytest.mark.parametrize("world_size", [2, slow(4)])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_adam_memory_matches_zero_formulas(stage, world_size):
    run_distributed(memory_body, world_size, stage=stage)
