"""ZeRO stage 1 and 2 against DDP(find_unused_parameters=True) + the same inner optimizer.

Every parameter is compared after every step, at world sizes 1-4 (odd shapes need padding at
every one of them), with parameters used on all, some or no ranks, a frozen layer, two param
groups, an LR scheduler, clipping, and tiny (many collectives) and large buckets.
"""

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, assert_params_equal, batch, ddp_reference, make_inner
from tests.tiers import slow

CASES = [
    # inner, overlap, bucket MiB (tiny: ~1 param per bucket), clip (small enough to bite), scheduler
    dict(inner="adamw", overlap=True, bucket_mb=0.0005, clip=0.05, scheduler=True, direct_backward=False),
    dict(inner="sgd", overlap=False, bucket_mb=25.0, clip=0.0, scheduler=False, direct_backward=True),
    dict(inner="adamw", overlap=False, bucket_mb=0.002, clip=1e3, scheduler=False, direct_backward=True),
    dict(inner="adagrad", overlap=True, bucket_mb=0.002, clip=0.0, scheduler=False, direct_backward=False),
    # whole-parameter ownership: AdamW (exact either way) and Adafactor (exact only whole)
    dict(inner="adamw", overlap=True, bucket_mb=0.0005, clip=0.05, scheduler=True, direct_backward=False, whole=True),
    dict(inner="adafactor", overlap=False, bucket_mb=25.0, clip=0.0, scheduler=False, direct_backward=True, whole=True),
]


def branches(rank: int, step: int) -> tuple[bool, bool]:
    """Which branches a rank uses: differs by rank and step, so some params are used on some ranks
    only, and at world size 1 and 2 some are used on no rank in some steps."""
    return (rank + step) % 2 == 0, (rank + step) % 3 != 0


def run_case(rank: int, stage: int, case: dict, steps: int = 4) -> None:
    where = f"stage {stage} {case}"
    model = BranchyNet()
    ref = ddp_reference(model)
    ref_opt = make_inner(case["inner"], ref.module)
    opt = LowLevelZeroOptimizer(
        model,
        make_inner(case["inner"], model),
        stage=stage,
        overlap_communication=case["overlap"],
        reduce_bucket_mb=case["bucket_mb"],
        clip_grad_norm=case["clip"],
        partition="params" if case.get("whole") else "auto",
    )
    assert opt.partition == ("params" if case.get("whole") else "rows"), where
    schedulers = []
    if case["scheduler"]:
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref_opt)]
    never = model.never.weight.detach().clone(), model.never.bias.detach().clone()
    frozen = model.frozen.weight.detach().clone()

    for step in range(steps):
        x, y = batch(rank, step)
        use_a, use_b = branches(rank, step)
        loss = mse_loss(model(x, use_a, use_b), y)
        if case["direct_backward"]:
            loss.backward()  # the end-of-backward callback must flush the buckets
        else:
            opt.backward(loss)
        assert all(p.grad is None for p in opt.managed_params), "gradients must be freed into buckets"
        assert opt.step() is True
        opt.zero_grad()

        mse_loss(ref(x, use_a, use_b), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case["clip"] or float("inf"))
        ref_opt.step()
        ref_opt.zero_grad()
        for s in schedulers:
            s.step()

        assert_params_equal(model, ref.module, f"{where} step {step}")
        assert opt.last_grad_norm == pytest.approx(ref_norm.item(), rel=1e-5), where
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"]

    # Used on no rank, ever: exactly unchanged and no optimizer state of its own (Adagrad's is the
    # constructor's, untouched: step 0, as in the reference); frozen: never touched.
    assert torch.equal(model.never.weight, never[0]) and torch.equal(model.never.bias, never[1]), where
    owner = {slot.param: slot.shard.owner for slot in opt.slots}
    for p, ref_p in ((model.never.weight, ref.module.never.weight), (model.never.bias, ref.module.never.bias)):
        if owner[p] not in (None, rank):
            assert p not in opt.state, where  # whole params: only the owner holds state
            continue
        assert (p in opt.state) == (ref_p in ref_opt.state), where
        if p in opt.state:
            assert float(opt.state[p]["step"]) == 0, where
    assert torch.equal(model.frozen.weight, frozen), where
    assert all(s.name.split(".")[0] != "frozen" for s in opt.slots)


def parity_body(rank: int, world_size: int) -> None:
    for stage in (1, 2):
        for case in CASES:
            run_case(rank, stage, case)


@pytest.mark.parametrize("world_size", [1, 2, slow(3), slow(4)])
def test_matches_ddp_every_step(world_size):
    run_distributed(parity_body, world_size)
