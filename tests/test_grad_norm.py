"""The global gradient norm ZeRO clips with is the true norm of the averaged gradients, also over
long gradient rows where an fp32 sum drifts (float64 accumulation; DESIGN.md section 3)."""

import pytest
import torch
import torch.distributed as dist

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import ddp_reference

VOCAB, WIDTH = 8192, 256  # GPT-2-like embedding rows: 2M elements in one gradient


def long_rows_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, VOCAB))


def true_norm(ref: torch.nn.Module) -> float:
    """The L2 norm of DDP's averaged gradients, summed in float64."""
    return torch.cat([p.grad.double().flatten() for p in ref.parameters()]).norm().item()


def norm_body(rank, world_size):
    for stage, offload in ((1, False), (2, False), (2, True)):
        model = long_rows_model()
        ref = ddp_reference(model)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = LowLevelZeroOptimizer(model, inner, stage=stage, clip_grad_norm=1.0, offload_optimizer=offload)
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, VOCAB, (64,), generator=g)
        for m, backward in ((model, opt.backward), (ref, lambda loss: loss.backward())):
            logits = m(tokens)
            backward(torch.nn.functional.cross_entropy(logits, tokens.roll(1)) * 1e3)  # norms far from 1
        expected, where = true_norm(ref), f"stage {stage}, offload {offload}, W={world_size}"
        assert opt.grad_norm() == pytest.approx(expected, rel=1e-6, abs=0), where
        dist.barrier()
        assert opt.step() is True
        assert opt.last_grad_norm == pytest.approx(expected, rel=1e-6, abs=0), where


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_norm_is_the_true_norm_of_the_averaged_gradients(world_size):
    run_distributed(norm_body, world_size)
