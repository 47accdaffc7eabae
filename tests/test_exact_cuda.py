"""``reduction="exact"`` on CUDA GPUs (``pytest -m cuda``; they skip without one; ``benchmarks/gpu_check.sh``
runs them). Not run yet: the sessions that wrote them had no GPU.

- The inner optimizer's CUDA kernels (foreach and fused AdamW) must give an element the same bits
  wherever it sits in the tensor they step, as exact mode's row shards assume (``zero/exact/kernels.py``).
- With two or more GPUs: NCCL at W = 1 and W = 2 (or 4), deterministic algorithms on, the same
  parameters bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, make_inner
from tests.test_exact_reduction import GLOBAL, STEPS, micro_batch, step_in_pieces, usage

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int):
    def mark(fn):
        fn = pytest.mark.skipif(n > GPUS, reason=f"needs {n} CUDA GPU{'s' * (n > 1)}, {GPUS} here")(fn)
        return pytest.mark.cuda(fn)

    return mark


@requires_gpus(1)
@pytest.mark.parametrize("kernel", ["foreach", "fused"])
def test_cuda_row_kernels_compute_each_element_alike(kernel):
    g = torch.Generator().manual_seed(3)
    n = 100_003
    start = torch.randn(n, generator=g).cuda()
    grads = [(torch.randn(n, generator=g) * 10.0**-k).cuda() for k in range(4)]

    def steps(cuts: list[int]) -> torch.Tensor:
        return step_in_pieces(
            start, grads, cuts, lambda pieces: torch.optim.AdamW(pieces, lr=1e-2, weight_decay=0.1, **{kernel: True})
        )

    whole = steps([0, n])
    for world_size in (2, 3, 4, 8):
        rows = -(-n // world_size)
        assert torch.equal(steps([min(r * rows, n) for r in range(world_size + 1)]), whole), world_size


def exact_on_gpus(rank: int, world_size: int, out: str) -> None:
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = BranchyNet().to(device)
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2, reduction="exact", clip_grad_norm=0.5)
    for step in range(STEPS):
        for m in range(rank, GLOBAL, world_size):
            x, y = (t.to(device) for t in micro_batch(step, m, torch.float32))
            opt.backward(mse_loss(model(x, *usage(step, m)), y))
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    if rank == 0:
        torch.save({n: p.detach().cpu() for n, p in model.named_parameters()}, out)


@requires_gpus(2)
def test_exact_same_bits_on_gpus(tmp_path):
    results = []
    for world_size in (1, min(GPUS, 4)):
        out = str(tmp_path / f"w{world_size}.pt")
        run_distributed(exact_on_gpus, world_size, backend="nccl", out=out)
        results.append(torch.load(out))
    for name, p in results[0].items():
        assert torch.equal(p, results[1][name]), name
