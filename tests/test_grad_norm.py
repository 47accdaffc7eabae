"""The global gradient norm ZeRO clips with is the true norm of the averaged gradients, also over
long gradient rows where an fp32 sum drifts (float64 accumulation; DESIGN.md section 3)."""

import copy

import pytest
import torch
import torch.distributed as dist

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import ddp_reference
from tests.tiers import slow

VOCAB, WIDTH = 8192, 256  # GPT-2-like embedding rows: 2M elements in one gradient


def long_rows_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB)).to(dtype)


def true_norm(ref: torch.nn.Module) -> float:
    """The L2 norm of DDP's averaged gradients, summed in float64."""
    return torch.cat([p.grad.double().flatten() for p in ref.parameters()]).norm().item()


def averaged_true_norm(local: torch.nn.Module) -> float:
    """The L2 norm of every rank's local gradients averaged over the ranks, all in float64."""
    flat = torch.cat([p.grad.double().flatten() for p in local.parameters()])
    dist.all_reduce(flat)
    return (flat / dist.get_world_size()).norm().item()


NORM_CASES = [  # stage, offload, params' dtype, partition
    (1, False, torch.float32, "rows"),
    (2, False, torch.float32, "rows"),
    (2, True, torch.float32, "rows"),
    (1, False, torch.bfloat16, "rows"),
    (2, True, torch.bfloat16, "rows"),
    (2, False, torch.float16, "rows"),
    (1, True, torch.float16, "rows"),
    (2, True, torch.bfloat16, "params"),
    (1, False, torch.float16, "params"),
    (2, False, torch.float32, "params"),
]


def norm_body(rank, world_size):
    for stage, offload, dtype, partition in NORM_CASES:
        model = long_rows_model(dtype)
        local = copy.deepcopy(model)  # the same backward, without ZeRO
        knobs = {"communication_dtype": "fp32", "initial_scale": 1.0}  # exact sums; fp16 loss unscaled
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = LowLevelZeroOptimizer(
            model, inner, stage=stage, clip_grad_norm=1.0, offload_optimizer=offload, partition=partition, **knobs
        )
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, VOCAB, (64,), generator=g)
        factor = 1.0 if dtype is torch.float16 else 1e3  # norms far from 1 where the range allows
        for m, backward in ((model, opt.backward), (local, lambda loss: loss.backward())):
            logits = m(tokens).float()
            backward(torch.nn.functional.cross_entropy(logits, tokens.roll(1)) * factor)
        expected = averaged_true_norm(local)
        where = f"stage {stage}, offload {offload}, {dtype}, {partition}, W={world_size}"
        assert opt.grad_norm() == pytest.approx(expected, rel=1e-6, abs=0), where
        assert opt.step() is True, where
        assert opt.last_grad_norm == pytest.approx(expected, rel=1e-6, abs=0), where


# W=3 is the odd size (padded, uneven rows); W=4 proved nothing more and cost the slow tier a 4-rank run.
@pytest.mark.parametrize("world_size", [1, 2, slow(3)])
def test_global_norm_is_the_true_norm_of_the_averaged_gradients(world_size):
    run_distributed(norm_body, world_size)


def clipped_steps_body(rank, world_size):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=WIDTH, n_layer=4, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    ref = ddp_reference(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2, clip_grad_norm=1.0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        ids = torch.randint(0, VOCAB, (4, 32), generator=g)
        opt.backward(model(input_ids=ids, labels=ids).loss)
        assert opt.step() is True
        opt.zero_grad()
        ref(input_ids=ids, labels=ids).loss.backward()
        coef = min(1.0, 1.0 / (true_norm(ref) + 1e-6))  # clip_grad_norm_'s rule on the exact norm
        for p in ref.parameters():
            p.grad.mul_(coef)
        ref_opt.step()
        ref_opt.zero_grad()
    # Measured: 8.7e-6 with the float64 norm, 3.3e-5 with the fp32 sum it replaced.
    for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_twenty_clipped_adamw_steps_track_exactly_clipped_ddp():
    """GPT-2 4x256 with an 8192 vocabulary at W=2, clipped at 1.0 every step."""
    run_distributed(clipped_steps_body, 2)


def test_blocked_norm_is_float64_exact_at_fp32_speed_and_keeps_huge_gradients_finite():
    """[Note: blocked norm]: fp32 block norms summed in float64 match a float64 sum over a 3M-element
    row (a single fp32 reduction is off by ~1e-4 there); squares that overflow fp32 fall back to
    float64 instead of reporting a finite gradient as inf; inf/nan still make the norm non-finite."""
    from hf_lowzero.zero.grads.norm import squared_norm

    g = torch.Generator().manual_seed(0)
    row = torch.randn(3_000_001, generator=g) * torch.rand(3_000_001, generator=g) ** 4
    rows = [row, torch.randn(5, generator=g), torch.empty(0), row[:1000].bfloat16()]
    exact = sum(r.double().square().sum().item() for r in rows)
    assert squared_norm(rows).dtype == torch.float64
    assert squared_norm(rows).item() == pytest.approx(exact, rel=1e-7, abs=0)
    huge = torch.full((2048,), 1e20)  # squares overflow fp32, not float64
    assert squared_norm([huge]).item() == pytest.approx(huge.double().square().sum().item(), rel=1e-12)
    assert squared_norm([]).item() == 0.0
    for bad in (float("inf"), float("nan")):
        poisoned = row.clone()
        poisoned[12345] = bad
        assert not torch.isfinite(squared_norm([poisoned]))
