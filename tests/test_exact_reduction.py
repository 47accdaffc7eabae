"""``reduction="exact"``: the same bits at any world size, with the optimizer alone.

A fixed global batch of GLOBAL micro-batches per step (each of PER_DEVICE samples) is dealt to ranks,
micro-batch m to rank m % W, so W ranks run GLOBAL / W micro-batches each; every rank passes each
micro-batch's own loss. After several steps the params at W = 2, 3, 4 must equal those at W = 1 bit
for bit, for every case below; and "exact" at W = 2 must be within float rounding of "ddp" there.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, make_inner
from tests.tiers import slow

GLOBAL = 12  # micro-batches per step: divides by 1, 2, 3 and 4
PER_DEVICE = 4
STEPS = 4


class WideNet(nn.Module):
    """A bucket over 2 MiB in int64: gloo's point-to-point reduce-scatter path ([Note: gloo point-to-point])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(17, 600)
        self.mid = nn.Linear(600, 500)
        self.out = nn.Linear(500, 3)

    def forward(self, x: torch.Tensor, use_a: bool = True, use_b: bool = True) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


# name -> (model, inner optimizer, dtype, ZeroConfig fields)
CASES = {
    "stage 1 fp32": (BranchyNet, "adamw", torch.float32, dict(stage=1)),
    "stage 2 fp32 clip": (BranchyNet, "adamw", torch.float32, dict(stage=2, clip_grad_norm=0.5)),
    "stage 2 bf16 clip": (BranchyNet, "adamw", torch.bfloat16, dict(stage=2, clip_grad_norm=0.5)),
    "stage 1 fp16 loss scaling clip": (
        BranchyNet,
        "adamw",
        torch.float16,
        dict(stage=1, clip_grad_norm=0.5, initial_scale=2.0**15, hysteresis=1),
    ),
    "stage 2 whole params adafactor clip": (
        BranchyNet,
        "adafactor",
        torch.float32,
        dict(stage=2, partition="params", clip_grad_norm=0.1),
    ),
    "stage 2 wide one bucket, verified": (WideNet, "sgd", torch.float32, dict(stage=2, verify_every=1)),
}


def micro_batch(step: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch ``m`` of ``step``: the same tensors whichever rank runs it."""
    g = torch.Generator().manual_seed(7919 * step + m)
    return torch.randn(PER_DEVICE, 17, generator=g).to(dtype), torch.randn(PER_DEVICE, 3, generator=g).to(dtype)


def usage(step: int, m: int) -> tuple[bool, bool]:
    """Which branches global micro-batch ``m`` uses: branch_a in most, branch_b in a few."""
    return m % 3 != 0, (m + step) % 5 == 0


def train(
    rank: int, world_size: int, name: str, reduction: str = "exact", steps=range(STEPS), load=None, save=None
) -> dict:
    """``steps`` of case ``name`` (from checkpoint ``load``, into checkpoint ``save``); the params,
    norms and applied flags (rank 0's view)."""
    model_cls, inner, dtype, fields = CASES[name]
    model = model_cls().to(dtype)
    bucket_mb = 25.0 if model_cls is WideNet else 0.001  # one bucket / one per param (W-dependent either way)
    config = ZeroConfig(reduction=reduction, reduce_bucket_mb=bucket_mb, **fields)
    opt = LowLevelZeroOptimizer(model, make_inner(inner, model), config)
    if load is not None:
        load_checkpoint(opt, load)
    local = GLOBAL // world_size
    norms, applied = [], []
    for step in steps:
        for m in range(rank, GLOBAL, world_size):
            x, y = micro_batch(step, m, dtype)
            loss = mse_loss(model(x, *usage(step, m)).float(), y.float())
            opt.backward(loss if reduction == "exact" else loss / local)
        applied.append(opt.step())
        norms.append(opt.last_grad_norm)
        opt.zero_grad()
    if save is not None:
        save_checkpoint(opt, save)
    opt.wait_for_params()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "applied": applied, "checks": opt.integrity.checks}


def cases_body(rank: int, world_size: int, out: str, names: list[str], reductions: tuple[str, ...]) -> None:
    results = {(name, r): train(rank, world_size, name, r) for name in names for r in reductions}
    if rank == 0:
        torch.save(results, out)


def run_cases(tmp_path, world_size: int, names: list[str], reductions=("exact",)) -> dict:
    out = str(tmp_path / f"w{world_size}.pt")
    run_distributed(cases_body, world_size, out=out, names=names, reductions=reductions)
    return torch.load(out)


def assert_identical(result: dict, reference: dict, where: str) -> None:
    assert result["applied"] == reference["applied"], where
    assert result["norms"] == reference["norms"], where  # floats compared exactly
    for name, p in reference["params"].items():
        q = result["params"][name]
        assert torch.equal(p, q), f"{where}: param {name} differs by {(p.float() - q.float()).abs().max().item()}"


@pytest.fixture(scope="module")
def at_one_rank(tmp_path_factory) -> dict:
    return run_cases(tmp_path_factory.mktemp("exact_w1"), 1, list(CASES))


# W=4 runs in test_resume_at_another_world_size_continues_bit_for_bit and test_exact_trainer.py.
@pytest.mark.parametrize("world_size", [2, slow(3)])
def test_same_bits_at_any_world_size(world_size, at_one_rank, tmp_path):
    reductions = ("exact", "ddp") if world_size == 2 else ("exact",)
    results = run_cases(tmp_path, world_size, list(CASES), reductions)
    for name in CASES:
        reference = at_one_rank[(name, "exact")]
        assert any(reference["applied"]), f"{name}: no step applied, the case tests nothing"
        assert_identical(results[(name, "exact")], reference, f"{name} at W={world_size}")
    if world_size == 2:
        assert results[("stage 2 wide one bucket, verified", "exact")]["checks"] == STEPS  # replicas hashed


def test_exact_within_rounding_of_ddp(at_one_rank, tmp_path):
    """At W = 2, per parameter: "exact" and "ddp" differ by the float rounding of the sums only."""
    names = ["stage 2 fp32 clip", "stage 2 whole params adafactor clip"]
    results = run_cases(tmp_path, 2, names, ("exact", "ddp"))
    for name in names:
        exact, ddp = results[(name, "exact")], results[(name, "ddp")]
        assert exact["applied"] == ddp["applied"]
        assert exact["norms"] == pytest.approx(ddp["norms"], rel=1e-6)
        for (n, p), q in zip(exact["params"].items(), ddp["params"].values()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, name=name: f"{name}: {n}: {m}")
        assert any(not torch.equal(p, q) for p, q in zip(exact["params"].values(), ddp["params"].values())), (
            "exact and ddp agree bit for bit: the comparison cannot tell them apart"
        )


RESUMED = ["stage 2 fp32 clip", "stage 1 fp16 loss scaling clip", "stage 2 whole params adafactor clip"]


def resume_body(rank: int, world_size: int, tmp: str, phase: str) -> None:
    """``save``: the first half of the steps, then a checkpoint; ``load``: the rest from it."""
    half = STEPS // 2
    results = {}
    for name in RESUMED:
        checkpoint = f"{tmp}/{name.replace(' ', '_')}"
        if phase == "save":
            train(rank, world_size, name, steps=range(half), save=checkpoint)
        else:
            results[name] = train(rank, world_size, name, steps=range(half, STEPS), load=checkpoint)
    if rank == 0 and phase == "load":
        torch.save(results, f"{tmp}/resumed.pt")


@pytest.mark.parametrize("saved_at, resumed_at", [(2, 1), slow((2, 4)), slow((3, 2))])
def test_resume_at_another_world_size_continues_bit_for_bit(saved_at, resumed_at, at_one_rank, tmp_path):
    """A checkpoint holds the grid (by parameter name): saved at one world size and resumed at another,
    the run ends with the uninterrupted run's bits."""
    run_distributed(resume_body, saved_at, tmp=str(tmp_path), phase="save")
    run_distributed(resume_body, resumed_at, tmp=str(tmp_path), phase="load")
    resumed = torch.load(tmp_path / "resumed.pt")
    for name in RESUMED:
        reference = at_one_rank[(name, "exact")]
        tail = {k: reference[k][STEPS // 2 :] for k in ("norms", "applied")}
        assert_identical(resumed[name], reference | tail, f"{name}: saved at W={saved_at}, resumed at {resumed_at}")


def grad_of(rank: int, world_size: int, out: str) -> None:
    """One step of SGD(lr=1) without momentum from zero weights: the weights become minus the
    averaged gradient, which the test compares with the mean computed in float64."""
    model = nn.Linear(5, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=1.0), reduction="exact")
    for m in range(rank, GLOBAL, world_size):
        x = torch.full((1, 5), float(m + 1))
        opt.backward(model(x).sum())  # gradient: x
    opt.step()
    opt.wait_for_params()
    if rank == 0:
        torch.save(model.weight.detach().clone(), out)


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_mean_over_every_micro_batch(world_size, tmp_path):
    """The step's gradient is the mean over the GLOBAL micro-batches of every rank, rounded once."""
    out = str(tmp_path / "w.pt")
    run_distributed(grad_of, world_size, out=out)
    mean = sum(range(1, GLOBAL + 1)) / GLOBAL
    assert torch.equal(torch.load(out), torch.full((1, 5), -mean))


def overflow_body(rank: int, world_size: int, out: str) -> None:
    """Step 0: one micro-batch's gradient beyond the first step's grid (2**16): skipped everywhere,
    params untouched. Step 1: a NaN in one micro-batch: skipped. Steps 2, 3: applied."""
    model = BranchyNet()
    before = [p.detach().clone() for p in model.parameters()]
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), reduction="exact")
    applied, reasons = [], []
    for step in range(4):
        for m in range(rank, GLOBAL, world_size):
            x, y = micro_batch(step, m, torch.float32)
            loss = mse_loss(model(x), y)
            if m == 5 and step == 0:
                loss = loss * 1e9
            if m == 7 and step == 1:
                loss = loss * float("nan")
            opt.backward(loss)
        applied.append(opt.step())
        reasons.append(opt.last_skip_reason)
        opt.zero_grad()
        if step == 0:
            opt.wait_for_params()
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "a skipped step changed params"
    opt.wait_for_params()
    if rank == 0:
        torch.save({"applied": applied, "reasons": reasons, "params": list(model.parameters())}, out)


def test_overflow_and_nonfinite_skip_alike_at_any_world_size(tmp_path):
    results = []
    for world_size in (1, 2):
        out = str(tmp_path / f"w{world_size}.pt")
        run_distributed(overflow_body, world_size, out=out)
        results.append(torch.load(out))
    for result in results:
        assert result["applied"] == [False, False, True, True]
        assert "exceed the fixed-point grid" in result["reasons"][0]
        assert "non-finite" in result["reasons"][1]
        assert result["reasons"][2:] == [None, None]
    assert all(torch.equal(p, q) for p, q in zip(results[0]["params"], results[1]["params"]))


def test_an_infinite_gradient_skips_the_step_and_keeps_the_grid(single_rank_group):
    """An inf gradient (an fp16 overflow) is non-finite, not a large one: the grid must not widen to
    fp32's largest value, which would round the param's next gradients to 0 for many steps."""
    model = nn.Linear(2, 1)
    opt = LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), reduction="exact")
    before = opt.reducer.grid_state()["bounds"]
    opt.backward(model(torch.tensor([[float("inf"), 1.0]])).sum())  # weight's gradient: [inf, 1]
    assert not opt.step()
    assert "non-finite gradients in ['weight']" in opt.last_skip_reason
    opt.zero_grad()
    assert opt.reducer.grid_state()["bounds"]["weight"] == before["weight"]
    opt.remove_hooks()


def test_no_sync_refused(single_rank_group):
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=1, reduction="exact")
    with pytest.raises(RuntimeError, match="reduction='exact'.*without no_sync"), opt.no_sync():
        pass


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(reduction="sum"), "reduction='sum' is invalid; expected 'ddp'"),
        (dict(reduction="exact", offload_optimizer=True), "offload_optimizer=True"),
        (dict(reduction="exact", communication_dtype="fp32"), "communication_dtype=torch.float32"),
        (dict(reduction="exact", master_dtype="bf16"), "master_rounding='nearest'"),
    ],
)
def test_config_refuses(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ZeroConfig(**fields)


def test_config_accepts():
    assert ZeroConfig().reduction == "ddp"
    config = ZeroConfig(reduction="exact", master_dtype="bf16", master_rounding="nearest")
    assert config.reduction == "exact" and math.isfinite(config.clip_grad_norm)


ROW_OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.RMSprop, dict(lr=1e-2)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
]


def step_in_pieces(start: torch.Tensor, grads: list[torch.Tensor], cuts: list[int], make_optimizer) -> torch.Tensor:
    """``start`` cut at ``cuts`` into pieces (as row shards cut a param), stepped by
    ``make_optimizer(pieces)`` with each of ``grads`` cut alike; the pieces joined again."""
    pieces = [start[a:b].clone() for a, b in zip(cuts, cuts[1:])]
    opt = make_optimizer(pieces)
    for grad in grads:
        for piece, a, b in zip(pieces, cuts, cuts[1:]):
            piece.grad = grad[a:b].clone()
        opt.step()
    return torch.cat(pieces)


@pytest.mark.parametrize("cls, kwargs", ROW_OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("foreach", [True, False])
def test_row_kernels_compute_each_element_alike(cls, kwargs, foreach):
    """What exact mode relies on with row shards (``zero/exact/kernels.py``): the foreach and
    single-tensor kernels give an element the same bits wherever it sits in the tensor they step."""
    g = torch.Generator().manual_seed(3)
    n = 1001
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 10.0**-k for k in range(4)]

    def steps(cuts: list[int]) -> torch.Tensor:
        return step_in_pieces(start, grads, cuts, lambda pieces: cls(pieces, foreach=foreach, **kwargs))

    whole = steps([0, n])
    for world_size in (2, 3, 4):
        rows = -(-n // world_size)
        assert torch.equal(steps([min(r * rows, n) for r in range(world_size + 1)]), whole), world_size


def test_fused_cpu_kernel_switched_to_foreach_on_rows(single_rank_group):
    model = WideNet()
    rows = torch.optim.AdamW(model.parameters(), fused=True)
    LowLevelZeroOptimizer(model, rows, reduction="exact").remove_hooks()
    assert [(g["fused"], g["foreach"]) for g in rows.param_groups] == [(False, True)]
    whole = torch.optim.AdamW(model.parameters(), fused=True)
    LowLevelZeroOptimizer(model, whole, reduction="exact", partition="params").remove_hooks()
    assert all(group["fused"] for group in whole.param_groups)
