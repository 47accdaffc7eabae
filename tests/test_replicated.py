"""Stage 1's replicated reduction ([Note: replicated reduction] in hf_lowzero/zero/grads/replicated.py).

A model of one small bucket all-reduces it with the step's flags, so the step needs no collective
before its update. Each case runs the same training twice on the same ranks, replicated and with
the replication switched off (the reduce-scatter and the stats all-reduce), and asserts the two
agree bit for bit at W=2 (both sum a pair of ranks, the norm's chunks in rank order): the norm, the
step's verdict and every param. Usage differs by rank (``branch_a`` on rank 0 only, ``never`` on no
rank), so a lost flag masks or updates the wrong params; clipping is on, so a norm of this rank's
rows only changes every param.
"""

import contextlib
import math

import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.grads import replicated
from hf_lowzero.zero.runtime.comm import comm_stats
from tests.models import BranchyNet, batch, make_inner

MICRO = 2


def build(off: bool, **config) -> tuple[BranchyNet, LowLevelZeroOptimizer]:
    model = BranchyNet()
    limit = replicated.REPLICATED_MAX_BYTES
    replicated.REPLICATED_MAX_BYTES = 0 if off else limit
    try:
        opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=1, clip_grad_norm=0.5, **config)
    finally:
        replicated.REPLICATED_MAX_BYTES = limit
    assert opt.reducer.replicated is not off
    return model, opt


def train_step(rank: int, model, opt, step: int, *, no_sync: bool, poison: bool = False) -> tuple[bool, float, dict]:
    """One step of MICRO micro-batches; ``poison``: rank 1's loss is inf. Returns the step's result,
    the norm and the collectives the step made."""
    comm_stats.reset()
    for micro in range(MICRO):
        x, y = batch(rank, step, micro)
        last = micro == MICRO - 1
        with opt.no_sync() if (no_sync and not last) else contextlib.nullcontext():
            loss = mse_loss(model(x, use_a=rank == 0, use_b=micro == 0), y) / MICRO
            if poison and rank == 1:
                loss = loss * math.inf
            opt.backward(loss)
    applied = opt.step()
    norm = opt.last_grad_norm
    opt.zero_grad()
    return applied, norm, dict(comm_stats.calls)


def assert_same(a: BranchyNet, b: BranchyNet, where: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{where}: {name} differs by {(p - q).abs().max().item()}"


def cases_body(rank: int, world_size: int) -> None:
    for no_sync, verify in ((True, "off"), (False, "off"), (True, 1)):
        where = f"no_sync {no_sync}, verify_every {verify}"
        (ours, opt), (ref, ref_opt) = build(False, verify_every=verify), build(True, verify_every=verify)
        for step in range(3):
            poison = step == 1
            got = train_step(rank, ours, opt, step, no_sync=no_sync, poison=poison)
            want = train_step(rank, ref, ref_opt, step, no_sync=no_sync, poison=poison)
            assert got[0] == want[0] == (not poison), f"{where} step {step}: applied {got[0]}, {want[0]}"
            assert got[1] == want[1] or (math.isnan(got[1]) and math.isnan(want[1])), (
                f"{where}: norms {got[1]}, {want[1]}"
            )
            assert_same(ours, ref, f"{where} step {step}")
            if no_sync and verify == "off":  # one collective before the update, the gather after it
                gather = {} if poison else {"all_gather": 1}  # a skipped step gathers nothing
                assert got[2] == {"all_reduce": 1} | gather, got[2]
                renorm = 2 if poison else 1  # not finite: the float64 norm, all-reduced too (replicated: local)
                assert want[2] == {"reduce_scatter": 1, "all_reduce": renorm} | gather, want[2]
            if no_sync and verify == 1:  # a verify step stays replicated: the checks' own gather, no stats all-reduce
                assert got[2] == {"all_reduce": 1, "all_gather": 1 if poison else 2}, got[2]
            if not no_sync:  # two reductions in the step: the norm is the sum's, taken by the stats all-reduce
                assert got[2]["all_reduce"] == MICRO + (2 if poison else 1), got[2]
        assert opt.skipped_steps == ref_opt.skipped_steps == 1
        if verify == 1:
            assert opt.integrity_checks == ref_opt.integrity_checks > 0
        initial = dict(BranchyNet().named_parameters())  # used on no rank: no update, no weight decay
        for name, p in ours.named_parameters():
            assert torch.equal(p, initial[name]) == name.startswith(("never", "frozen")), f"{where}: {name}"


def test_replicated_reduction_equals_the_reduce_scatter_path():
    run_distributed(cases_body, 2)
