"""Integrity checks of ``reduction="exact"`` ([Note: exact checksums] in
``hf_lowzero/zero/integrity/exact_sums.py``): int64 checksums compared exactly, no float bound.

- In one process, W ``IntegrityChecker(exact=True)`` fed random int64 buckets whose sums wrap around:
  a clean reduction checks to the bit; +1 in the last bit of one reduced element, a swap of two, a
  dropped and a doubled contribution are caught and named.
- At W=2 in gloo ranks, the real optimizer: clean runs verified at every step raise nothing and train
  the bits of a run without checks; a fault injected (``reduction_faults``: a flipped last bit, a
  dropped or doubled contribution) is caught at the next verify step and named, before the update; a
  rollback to the last verified step's checkpoint replays to the clean run's bits.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import mse_loss
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowzero import IntegrityError, LowLevelZeroOptimizer, ZeroConfig, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.integrity.checker import IntegrityChecker
from hf_lowzero.zero.integrity.checksums import HASH_WIDTH
from hf_lowzero.zero.integrity.reduction_faults import Fault, inject
from tests.models import BranchyNet, make_inner
from tests.test_checksums import _bucket, _piece, _shard, judged, sent_with_faults
from tests.test_exact_reduction import GLOBAL, micro_batch, usage

# ------------------------------------------------------------------- the arithmetic, in one process

# a 1-element param, a padded one (17 x 257 over 3 ranks), one whose pieces span several hash widths
SHAPES = [(1,), (7,), (17, 257), (3 * (2 * HASH_WIDTH + 5),), (384,)]
LONG = "p3"


def _checkers(bucket, world_size):
    tensors = [(s.name, s.param) for s in bucket.slots]
    return [
        IntegrityChecker(
            [bucket], tensors, comm_dtype=None, every=1, on_mismatch="raise", shard=_shard(r, world_size), exact=True
        )
        for r in range(world_size)
    ]


def _flats(bucket, world_size, seed):
    """Each rank's int64 bucket, over int64's whole range: many sums wrap around."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-(2**63), 2**63 - 1, (bucket.packed_numel,), generator=g) for _ in range(world_size)]


def _step(bucket, flats, checkers, faults=()):
    """One verify step of every rank; ``faults``: (kind, rank, param name): "drop"/"double" a rank's
    contribution on its way, "bit" (+-1 in the last bit of one element) or "swap" (two elements) in
    the owner's reduced rows. Returns the finding or raises ``IntegrityError``."""
    world_size = len(checkers)
    sent = sent_with_faults(bucket, flats, faults)
    total = sum(sent[1:], sent[0].clone())  # int64: wraps, as the SUM collective does
    for rank, checker in enumerate(checkers):
        checker.begin_step()
        checker.after_pack(bucket, flats[rank])
        start = sum(bucket.chunks[:rank])
        rows = total[start : start + bucket.chunks[rank]].clone()
        for kind, owner, name in faults:
            if owner == rank and kind in ("bit", "swap"):
                at = _piece(bucket, world_size, rank, name)[0] - start
                if kind == "bit":
                    rows[at] ^= 1
                else:
                    rows[[at, at + 1]] = rows[[at + 1, at]]
        checker.after_reduce(bucket, rows)
    return judged(checkers)


@pytest.mark.parametrize("whole", [False, True])
def test_a_clean_exact_reduction_checks_to_the_bit_through_wraparound(whole):
    world_size = 3
    bucket = _bucket(SHAPES, world_size, whole)
    checkers = _checkers(bucket, world_size)
    for seed in range(3):
        flats = _flats(bucket, world_size, seed)
        wrapped = (sum(f.double() for f in flats).abs() >= 2.0**63).float().mean()
        assert wrapped > 0.2, "the sums must wrap around for this test to show they may"
        finding = _step(bucket, flats, checkers)
        assert finding.mismatches == [] and finding.nonfinite == []
    assert (checkers[0].checks, checkers[0].failures) == (3, 0)  # rank 0 judged the three tables


@pytest.mark.parametrize("whole", [False, True])
def test_one_in_the_last_bit_is_caught_and_named(whole):
    """Each param in turn (a 1-element one, a padded 17 x 257 one, one over several hash widths): one
    reduced int64 element off by one, or two swapped; no tolerance hides either."""
    world_size = 3
    bucket = _bucket(SHAPES, world_size, whole)
    owner = {s.name: s.shard.owner if whole else 0 for s in bucket.slots}  # rows: rank 0's piece is never padding
    checkers = _checkers(bucket, world_size)
    flats = _flats(bucket, world_size, 7)
    for kind, name in [("bit", "p0"), ("bit", "p2"), ("bit", LONG), ("swap", "p2"), ("swap", LONG)]:
        with pytest.raises(IntegrityError) as caught:
            _step(bucket, flats, checkers, [(kind, owner[name], name)])
        error = caught.value
        assert (error.names, error.ranks, error.kind) == ([name], [owner[name]], "reduction"), str(error)
        text = f"parameter {name!r} (rows of rank {owner[name]}): rank {owner[name]}'s reduced rows differ"
        assert text in str(error) and "exact: no tolerance" in str(error), str(error)
    assert _step(bucket, flats, checkers).mismatches == []  # the checkers go on after a failure


@pytest.mark.parametrize("whole", [False, True])
def test_a_dropped_and_a_doubled_contribution_are_named(whole):
    world_size = 3
    bucket = _bucket(SHAPES, world_size, whole)
    owner = {s.name: s.shard.owner if whole else 0 for s in bucket.slots}
    flats = _flats(bucket, world_size, 8)
    with pytest.raises(IntegrityError) as caught:
        _step(bucket, flats, _checkers(bucket, world_size), [("drop", 1, "p2"), ("double", 2, LONG)])
    error = caught.value
    assert sorted(error.names) == sorted(["p2", LONG]) and error.ranks == [1, 2], str(error)
    for name, text in [("p2", "rank 1's contribution was dropped"), (LONG, "rank 2's contribution was doubled")]:
        assert f"parameter {name!r} (rows of rank {owner[name]}): {text}" in str(error), str(error)


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in ("_local_scalar_dense", "nonzero", "item")):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_exact_hooks_make_no_host_sync():
    bucket = _bucket(SHAPES, 2)
    flats = _flats(bucket, 2, 3)
    checker = _checkers(bucket, 2)[0]
    with _HostReads() as reads:
        checker.begin_step()
        checker.after_pack(bucket, flats[0])
        checker.after_reduce(bucket, flats[0][: bucket.row_numel].clone())
    assert reads.seen == []


# --------------------------------------------------------------------- the optimizer, at W = 2

EVERY = 3  # verify steps 1, 4, 7, 10


def _optimizer(model, **overrides):
    config = dict(stage=2, reduction="exact", reduce_bucket_mb=0.001, clip_grad_norm=0.5, verify_every=EVERY)
    return LowLevelZeroOptimizer(model, make_inner("adamw", model), ZeroConfig(**(config | overrides)))


def _train(model, opt, rank, world_size, steps, after_step=None):
    """The global batch of each step dealt to ranks (micro-batch m to rank m % W), each its own loss."""
    for step in steps:
        for m in range(rank, GLOBAL, world_size):
            x, y = micro_batch(step, m, torch.float32)
            opt.backward(mse_loss(model(x, *usage(step, m)), y))
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)


def _params(model, opt):
    opt.wait_for_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _clean(rank, world_size, stage, steps):
    """Every step verified (stage 1 and 2, unused params, clipping): no alarm, and the bits of the run
    without checks (the checks change nothing the step computes)."""
    results = {}
    for every in (1, "off"):
        model = BranchyNet()
        opt = _optimizer(model, stage=stage, verify_every=every)
        _train(model, opt, rank, world_size, range(steps))
        results[every] = _params(model, opt)
        if every == 1:
            assert (opt.integrity.checks, opt.integrity.failures, opt.integrity.last_verified) == (steps, 0, steps)
    for name, p in results["off"].items():
        assert torch.equal(results[1][name], p), name


def _fault(rank, world_size, kind, tmp):
    """A fault from step 5 for EVERY steps (0-based steps 4, 5, 6 are the checker's 5, 6, 7): caught at
    step 7, named, before that step's update; rolled back to step 4's checkpoint (the last verified
    one), the replay ends on the clean run's bits, its verify steps clean."""
    model = BranchyNet()
    opt = _optimizer(model, on_mismatch="rollback")  # outside Ray: the same error as "raise"
    target = "embed.weight"
    bucket = next(b for b in opt.buckets if [s.name for s in b.slots] == [target])
    fault = Fault(kind, rank=1, step=5, bucket=bucket.index, element=3, bit=0, times=EVERY)
    before = {}

    def save_verified(step):  # a checkpoint at each verified step: the rollback point
        if opt.integrity.last_verified == step + 1:
            save_checkpoint(opt, f"{tmp}/{kind}-step{step + 1}")
        before.update(_params(model, opt))

    with inject(fault), pytest.raises(IntegrityError) as caught:
        _train(model, opt, rank, world_size, range(10), after_step=save_verified)
    error = caught.value
    what = {"flip": "rank 1's reduced rows differ", "drop": "contribution was dropped", "double": "was doubled"}
    assert (error.step, error.names, error.ranks, error.kind) == (7, [target], [1], "reduction"), str(error)
    assert what[kind] in str(error) and "exact: no tolerance" in str(error), str(error)
    assert (opt.integrity.checks, opt.integrity.failures, opt.integrity.last_verified) == (3, 1, 4)
    assert fault.fired == (EVERY * GLOBAL // world_size if rank == 1 else 0)  # every micro-batch of 3 steps
    after = _params(model, opt)
    assert all(torch.equal(after[n], p) for n, p in before.items()), "the failed step changed params"

    model = BranchyNet()  # the rollback: a fresh process's optimizer, from the last verified step
    opt = _optimizer(model)
    load_checkpoint(opt, f"{tmp}/{kind}-step4")
    opt.step_number = 5  # counting on from the checkpoint, as LowZeroTrainer does
    _train(model, opt, rank, world_size, range(4, 10))
    got = (opt.integrity.checks, opt.integrity.failures, opt.integrity.last_verified)
    assert got == (2, 0, 8), got  # the resumed run's first step, then EVERY steps later
    return _params(model, opt)


def _nonfinite(rank, world_size):
    """A NaN in rank 1's gradient at step 2: int64 holds no NaN, but what was sent is what was summed, so
    the checks raise nothing; the step is skipped on every rank, its skip naming the parameter."""
    model = BranchyNet()
    opt = _optimizer(model, verify_every=1)
    target = "embed.weight"
    dict(model.named_parameters())[target].register_hook(
        lambda g: g.clone().fill_(float("nan")) if rank == 1 and opt.integrity.step == 2 else g
    )
    reasons = []
    _train(model, opt, rank, world_size, range(3), after_step=lambda step: reasons.append(opt.last_skip_reason))
    assert (opt.skipped_steps, opt.integrity.checks, opt.integrity.failures) == (1, 3, 0)
    assert reasons[0] is None and reasons[2] is None and target in reasons[1], reasons


def _optimizer_body(rank, world_size, stages, kinds, tmp):
    for stage in stages:
        _clean(rank, world_size, stage, steps=5)
    _nonfinite(rank, world_size)
    model = BranchyNet()
    opt = _optimizer(model, verify_every="off")
    _train(model, opt, rank, world_size, range(10))
    clean = _params(model, opt)
    for kind in kinds:
        replayed = _fault(rank, world_size, kind, tmp)
        for name, p in clean.items():
            assert torch.equal(replayed[name], p), f"{kind}: {name} after the rollback"


@pytest.mark.parametrize(
    "stages, kinds", [((2,), ["flip"]), pytest.param((1,), ["drop", "double"], marks=pytest.mark.slow)]
)
def test_exact_checks_at_two_ranks_catch_faults_and_roll_back(stages, kinds, tmp_path):
    """Fast tier: stage 2, a flipped last bit; slow tier: stage 1, a dropped and a doubled contribution."""
    run_distributed(_optimizer_body, 2, stages=stages, kinds=kinds, tmp=str(tmp_path))
