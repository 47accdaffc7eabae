"""bf16 master rows (``ZeroConfig.master_dtype="bf16"``, [Note: bf16 masters]): the rounding
functions, parity with a hand-written reference at world sizes 1 and 2, the bytes saved and the
scratch freed after the step, checkpoints (also across master dtypes), offload, FakeTensorMode, and
the Trainer taking them from ``--zero_config``."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig, consolidate_checkpoint, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.update.master_precision import round_nearest, round_stochastic
from tests.hf_models import tiny_gpt2
from tests.models import BranchyNet, batch, make_inner, param_groups
from tests.trainer_runs import logged, make_args, train

STEPS = 4


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 values around fp32 ``x``: truncated toward zero, and one bf16 ulp further out."""
    low = (x.view(torch.int32) & -(1 << 16)).view(torch.float32)
    high = ((x.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    return low, high


# ------------------------------------------------------------------------------ rounding units


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g) * torch.logspace(-6, 3, 50_000)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_stochastic(x, out, torch.Generator().manual_seed(0))
    low, high = neighbours(x)
    assert bool(((out.float() == low) | (out.float() == high)).all())
    assert 0.3 < float((out.float() == high).float().mean()) < 0.7  # both neighbours occur

    # Unbiased: the mean of n draws is within 5 standard errors (each draw's deviation is at most
    # one ulp, so its std is at most ulp / 2). More than ROUNDING_CHUNK draws: chunking is covered.
    n = 1_500_000
    for value in (1.0 + 2**-9, -3.3, 1.37e-3, 7.123e4):
        x = torch.full((n,), value)
        low, high = neighbours(x[:1])
        ulp = abs(float(high - low))
        out = torch.empty_like(x, dtype=torch.bfloat16)
        round_stochastic(x, out, torch.Generator().manual_seed(2))
        bound = 5 * ulp / 2 / n**0.5
        assert abs(out.double().mean().item() - float(x[0])) < bound, value
        # round-to-nearest is biased here by much more than the bound: the test can tell them apart
        assert abs(float(x[0].to(torch.bfloat16)) - float(x[0])) > 20 * bound, value


def test_stochastic_rounding_is_reproducible_and_exact_on_bf16_values():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    a, b = (torch.empty_like(x, dtype=torch.bfloat16) for _ in range(2))
    round_stochastic(x, a, torch.Generator().manual_seed(5))
    round_stochastic(x, b, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    exact = x.to(torch.bfloat16).float()  # already representable: never moves
    round_stochastic(exact, b, torch.Generator().manual_seed(6))
    assert torch.equal(b.float(), exact)


def test_nearest_rounding_is_torchs_cast():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(4)) * 1e3
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_nearest(x, out)
    assert torch.equal(out, x.to(torch.bfloat16))


def test_config_validates_master_fields():
    assert ZeroConfig(master_dtype="bfloat16").master_dtype is torch.bfloat16
    assert ZeroConfig(master_dtype=torch.float32).master_dtype is torch.float32
    for bad in ("fp16", torch.float16, "int8"):
        with pytest.raises(ValueError, match="master_dtype"):
            ZeroConfig(master_dtype=bad)
    with pytest.raises(ValueError, match="master_rounding"):
        ZeroConfig(master_rounding="up")
    with pytest.raises(ValueError, match="master_rounding_seed"):
        ZeroConfig(master_rounding_seed=-1)


# ------------------------------------------------------------------ training against a reference


def build(master_dtype="bf16", rounding="nearest", seed=0, offload=False, inner="adamw", partition="rows"):
    model = BranchyNet(seed).to(torch.bfloat16)
    opt = LowLevelZeroOptimizer(
        model,
        make_inner(inner, model),
        reduce_bucket_mb=0.001,
        communication_dtype="fp32",  # the fp32 sum of halves is the same at W=1 and W=2
        master_dtype=master_dtype,
        master_rounding=rounding,
        offload_optimizer=offload,
        partition=partition,
    )
    return model, opt


def micro_batches(rank: int, world_size: int, step: int):
    """The global batch of a step is the batches of ranks 0 and 1; at W=1 one rank runs both,
    each loss halved (exact), so the fp32 gradient sum equals W=2's average."""
    ranks = [0, 1] if world_size == 1 else [rank]
    return [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in (batch(r, step) for r in ranks)]


def train_step(model, opt, rank, world_size, step):
    micros = micro_batches(rank, world_size, step)
    for x, y in micros:
        opt.backward(mse_loss(model(x), y) / len(micros))
    assert opt.step()
    opt.zero_grad()


class RoundedMasterReference:
    """A bf16 model and fp32 masters stepped by a plain fused AdamW, the masters rounded to bf16
    (nearest) after every step: what bf16 masters with nearest rounding compute."""

    def __init__(self) -> None:
        self.model = BranchyNet(0).to(torch.bfloat16)
        self.masters = BranchyNet(0)  # fp32
        with torch.no_grad():
            for m, p in zip(self.masters.parameters(), self.model.parameters()):
                m.copy_(p)
        self.optim = torch.optim.AdamW(param_groups(self.masters), betas=(0.9, 0.95), fused=True)

    def step(self, step: int) -> None:
        trainable = [(m, p) for m, p in zip(self.masters.parameters(), self.model.parameters()) if p.requires_grad]
        grads = [torch.zeros_like(m) for m, _ in trainable]
        for x, y in micro_batches(0, 1, step):
            (mse_loss(self.model(x), y) / 2).backward()
            for grad, (_, p) in zip(grads, trainable):
                if p.grad is not None:
                    grad.add_(p.grad.float())
                p.grad = None
        for grad, (m, p) in zip(grads, trainable):
            m.grad = grad if p is not self.model.never.weight and p is not self.model.never.bias else None
        self.optim.step()
        with torch.no_grad():
            for m, p in trainable:
                m.copy_(m.to(torch.bfloat16))
                p.copy_(m)


def nearest_parity_body(rank, world_size, tmp):
    model, opt = build()
    assert opt.master.flat.dtype is torch.bfloat16
    ref = RoundedMasterReference()
    for step in range(STEPS):
        train_step(model, opt, rank, world_size, step)
        ref.step(step)
        for (name, p), q in zip(model.named_parameters(), ref.model.parameters()):
            # W=1 steps whole tensors as the reference does: bit-identical. At W=2 fused AdamW sees
            # rows; a rare last-bit difference (a vectorized vs scalar tail) may flip a rounding.
            differ = p != q
            if world_size == 1:
                assert torch.equal(p, q), f"W=1 step {step} {name}: {int(differ.sum())} of {p.numel()} differ"
            assert float(differ.float().mean()) <= 0.002, f"W={world_size} step {step} {name}: {int(differ.sum())}"
            torch.testing.assert_close(p, q, rtol=2**-7, atol=1e-6, msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], f"{tmp}/params-{world_size}.pt")
    if world_size == 1:
        fp32_model, fp32_opt = build(master_dtype="fp32")
        for step in range(STEPS):
            train_step(fp32_model, fp32_opt, rank, world_size, step)
        torch.save([p.detach().clone() for p in fp32_model.parameters()], f"{tmp}/params-fp32.pt")


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_nearest_bf16_masters_match_the_rounded_reference_at_world_sizes_1_and_2(tmp_path):
    for world_size in (1, 2):
        run_distributed(nearest_parity_body, world_size, tmp=str(tmp_path))
    one, two, fp32 = (torch.load(tmp_path / f"params-{w}.pt") for w in (1, 2, "fp32"))
    for p, q in zip(one, two):
        torch.testing.assert_close(p, q, rtol=2**-7, atol=1e-6)
    # the tolerances above can tell the masters' precision: fp32 masters end elsewhere
    differ = sum(int((p != q).sum()) for p, q in zip(one, fp32))
    assert differ > 0.01 * sum(p.numel() for p in one), differ


# ----------------------------------------------------------------------------- memory and scratch


def memory_body(rank, world_size):
    runs = {dtype: build(master_dtype=dtype) for dtype in ("fp32", "bf16")}
    during = []
    bf16_opt = runs["bf16"][1]
    bf16_opt.optim.register_step_pre_hook(lambda *_: during.append(bf16_opt._parts.precision.scratch_bytes()))
    for step in range(2):
        for model, opt in runs.values():
            train_step(model, opt, rank, world_size, step)
    fp32, bf16 = (runs[d][1].memory_report() for d in ("fp32", "bf16"))
    numel = runs["bf16"][1].master.flat.numel()
    assert fp32.master_rows == 4 * numel and bf16.master_rows == 2 * numel
    assert bf16.optimizer_state == fp32.optimizer_state > 0  # AdamW's moments stay fp32
    assert bf16.grad_buffers == fp32.grad_buffers  # gradient rows stay fp32
    assert during == [4 * numel, 4 * numel]  # the fp32 scratch exists during the inner step...
    assert bf16_opt._parts.precision.scratch.untyped_storage().nbytes() == 0  # ...and not after it
    assert all(s["exp_avg"].dtype is torch.float32 for s in bf16_opt.state.values())


def test_bf16_masters_halve_the_master_rows_and_free_the_scratch():
    run_distributed(memory_body, 2)


# ---------------------------------------------------------------------------------- checkpoints


def checkpoint_body(rank, world_size, tmp):
    model, opt = build()
    for step in range(2):
        train_step(model, opt, rank, world_size, step)
    save_checkpoint(opt, f"{tmp}/bf16")
    fp32_model, fp32_opt = build(master_dtype="fp32")
    for step in range(2):
        train_step(fp32_model, fp32_opt, rank, world_size, step)
    save_checkpoint(fp32_opt, f"{tmp}/fp32")
    fp32_masters = fp32_opt.master.flat.clone()
    for step in range(2, 4):
        train_step(model, opt, rank, world_size, step)

    # bf16 -> bf16: resumes exactly (nearest rounding is deterministic)
    resumed_model, resumed = build(seed=7)
    load_checkpoint(resumed, f"{tmp}/bf16")
    for step in range(2, 4):
        train_step(resumed_model, resumed, rank, world_size, step)
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(opt.master.flat, resumed.master.flat)

    # bf16 -> fp32 masters: the masters are cast (exactly); fp32 -> bf16: rounded to nearest
    widened_model, widened = build(master_dtype="fp32", seed=7)
    load_checkpoint(widened, f"{tmp}/bf16")
    saved_params = dict(consolidate_checkpoint(f"{tmp}/bf16"))
    for name, p in widened_model.named_parameters():
        assert torch.equal(p.float(), saved_params[name]), name  # export: the weights, fp32
    narrowed_model, narrowed = build(seed=7)
    load_checkpoint(narrowed, f"{tmp}/fp32")
    assert torch.equal(narrowed.master.flat, fp32_masters.to(torch.bfloat16))
    for (name, p), q in zip(narrowed_model.named_parameters(), fp32_model.parameters()):
        assert torch.equal(p, q), name  # bf16 params are the masters cast down either way


@pytest.mark.slow  # the second tier: keeps the fast one under 10 minutes
def test_bf16_master_checkpoints_resume_and_convert(tmp_path):
    run_distributed(checkpoint_body, 2, tmp=str(tmp_path))


# -------------------------------------------------------------------------------------- offload


def offload_body(rank, world_size):
    for inner, partition in (("adamw", "rows"), ("adafactor", "params")):
        runs = {
            offload: build(rounding="stochastic", offload=offload, inner=inner, partition=partition)
            for offload in (False, True)
        }
        for step in range(STEPS):
            for model, opt in runs.values():
                train_step(model, opt, rank, world_size, step)
            (ref_model, _), (model, opt) = runs[False], runs[True]
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert torch.equal(p, q), f"{inner} step {step} {name}"  # CPU: the same kernels and noise
        assert opt.master.flat.dtype is torch.bfloat16 and opt._parts.precision.scratch_bytes() == 0
    moved = sum(int((p != q).sum()) for p, q in zip(model.parameters(), BranchyNet(0).to(torch.bfloat16).parameters()))
    assert moved > 0


@pytest.mark.slow  # the second tier: keeps the fast one under 10 minutes
def test_offloaded_bf16_masters_match_the_device_run():
    run_distributed(offload_body, 2)


# ------------------------------------------------------------------------------- FakeTensorMode


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_update_runs_under_fake_tensors(master_dtype):
    """A memory planner builds the optimizer, runs backward and ``apply_update()`` on fake tensors
    with a fake process group: nothing there may read tensor data."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM, GPT2Config

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0, eos_token_id=0)
        with FakeTensorMode():
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
            opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), master_dtype=master_dtype)
            ids = torch.randint(0, 1000, (2, 16))
            opt.backward(model(input_ids=ids, labels=ids).loss)
            opt.apply_update()
            assert len(opt.optim.state) == len(opt.slots)
            assert opt.master.flat.dtype is opt.config.master_dtype
            assert opt._parts.precision.scratch_bytes() == 0
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- Trainer


def trainer_body(rank, world_size, tmp):
    knobs = {"bf16": True, "zero_config": json.dumps({"master_dtype": "bf16", "master_rounding": "nearest"})}
    args = make_args(f"{tmp}/bf16", 2, save_strategy="steps", save_steps=3, **knobs)
    model = tiny_gpt2()
    trainer = train(model, args)
    assert trainer.zero_optimizer.master.flat.dtype is torch.bfloat16
    fp32 = train(tiny_gpt2(), make_args(f"{tmp}/fp32", 2, bf16=True))
    assert logged(trainer, "loss") == pytest.approx(logged(fp32, "loss"), rel=2e-2)  # tracks fp32 masters
    resumed = train(tiny_gpt2(seed=5), args, resume=f"{tmp}/bf16/checkpoint-3")
    for p, q in zip(resumed.model.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow  # the second tier: keeps the fast one under 10 minutes
def test_trainer_takes_bf16_masters_from_zero_config_and_resumes_exactly(tmp_path):
    run_distributed(trainer_body, 2, tmp=str(tmp_path))
