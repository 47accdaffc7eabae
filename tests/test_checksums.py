"""The integrity checks' arithmetic (``hf_lowzero/zero/integrity/checksums.py``, ``verdict.py``), in one process.

W ranks are W ``IntegrityChecker`` objects fed the real packing (``pack_bucket``) and a reduction
done here, in the communication dtype, so that a fault can be put exactly where a test wants it: one
parameter's piece dropped or doubled on its way, one element of an owner's reduced rows changed.
Their tables are stacked as the all-gather would, and judged by ``verify_judge``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowzero.zero.integrity import checksums
from hf_lowzero.zero.integrity.checker import IntegrityChecker, IntegrityError
from hf_lowzero.zero.integrity.checksums import PERIOD, SCRATCH, bucket_plans, hash_weights, sign_table, tensor_hash
from hf_lowzero.zero.layout.buckets import plan_buckets
from hf_lowzero.zero.layout.packing import pack_bucket
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.layout.partition import ParamShard, assign_owners
from hf_lowzero.zero.runtime.shard_group import ShardGroup

CPU = torch.device("cpu")
# a 1-element param, a padded one (17 x 257 over 3 ranks), one whose pieces span several periods
SHAPES = [(1,), (7,), (17, 257), (3 * (2 * PERIOD + 5),), (384,)]
LONG = "p3"


def _bucket(shapes, world_size, whole=False, comm_dtype=None):
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    owners = assign_owners([p.numel() for p in params], world_size=world_size) if whole else [None] * len(params)
    slots = [
        ParamSlot(i, f"p{i}", p, ParamShard(p.numel(), world_size=world_size, owner=owners[i]))
        for i, p in enumerate(params)
    ]
    (bucket,) = plan_buckets(slots, 2**40, comm_dtype)
    return bucket


def _checkers(bucket, world_size, comm_dtype=None):
    tensors = [(s.name, s.param) for s in bucket.slots]
    return [  # no process group: the tables are stacked here
        IntegrityChecker(
            [bucket], tensors, comm_dtype=comm_dtype, every=1, on_mismatch="raise", shard=_shard(r, world_size)
        )
        for r in range(world_size)
    ]


def _shard(rank, world_size):
    return ShardGroup(group=None, rank=rank, world_size=world_size, device=CPU)


def _packed(bucket, grads, world_size, comm_dtype):
    """Each rank's packed bucket (pre-divided), from its gradients ``grads[rank][param]``."""
    flats = []
    for per_param in grads:
        for slot, g in zip(bucket.slots, per_param):
            slot.param.grad = g.clone()
        flat = torch.empty(bucket.packed_numel, dtype=comm_dtype or torch.float32)
        pack_bucket(bucket, flat, world_size=world_size)
        flats.append(flat)
    return flats


def _piece(bucket, world_size, dst, name):
    """Where ``name``'s piece for rank ``dst`` lies in the packed bucket."""
    start = sum(bucket.chunks[:dst])
    for slot in bucket.slots:
        n = slot.shard.piece_numel(dst)
        if slot.name == name:
            return start, start + n
        start += n
    raise KeyError(name)


def _step(bucket, grads, checkers, comm_dtype=None, faults=()):
    """One verify step of every rank (``checkers``), with ``faults``: (kind, rank, param name) each.
    Returns the finding (rank 0's; every rank judges alike) or raises ``IntegrityError``."""
    world_size = len(checkers)
    flats = _packed(bucket, grads, world_size, comm_dtype)
    sent = sent_with_faults(bucket, flats, faults)
    total = sent[0].clone()
    for f in sent[1:]:
        total += f  # in the communication dtype, rounding at every add, as a ring does
    for rank, checker in enumerate(checkers):
        checker.begin_step()
        checker.after_pack(bucket, flats[rank])
        start = sum(bucket.chunks[:rank])
        rows = total[start : start + bucket.chunks[rank]].clone()
        for kind, owner, name in faults:
            if kind == "corrupt" and owner == rank:
                # as a flipped high exponent bit would: far beyond a bf16 reduction's bound as well
                rows[_piece(bucket, world_size, rank, name)[0] - start] = 1e3 * (1.0 + rows.abs().max())
        checker.after_reduce(bucket, rows)
    return judged(checkers)


def _grads(bucket, world_size, seed, integers=False, spread=True):
    """Per rank, per param (packing order): integers, or normal values at a scale from 1e-4 to 1e4
    (per rank and param; per param only without ``spread``) with outliers."""
    g = torch.Generator().manual_seed(seed)
    scales = 10.0 ** (8 * torch.rand(world_size if spread else 1, len(bucket.slots), generator=g) - 4)
    out = []
    for rank in range(world_size):
        per_param = []
        for j, slot in enumerate(bucket.slots):
            shape = slot.param.shape
            if integers:  # multiples of W: exact after the pre-division, exact sums
                per_param.append(world_size * torch.randint(-8, 9, shape, generator=g).float())
            else:
                x = torch.randn(shape, generator=g) * scales[rank if spread else 0, j]
                x.view(-1)[::97] *= 1000
                per_param.append(x)
        out.append(per_param)
    return out


def _position(bucket, name):
    return next(j for j, s in enumerate(bucket.slots) if s.name == name)


# -------------------------------------------------------------------------- the checksums


@pytest.mark.parametrize("whole", [False, True])
def test_an_exact_reduction_checksums_to_the_sum_of_what_the_ranks_sent(whole):
    """Integer gradients make the reduction exact: the owner's dots equal the sum of the ranks' dots
    to the bit, for every segment (a 1-element one, padded rows, uneven whole-param chunks, pieces
    of several periods, folded)."""
    world_size = 3
    bucket = _bucket(SHAPES, world_size, whole)
    flats = _packed(bucket, _grads(bucket, world_size, 0, integers=True), world_size, None)
    total = sum(flats)
    signs, scratch = sign_table(2, CPU), torch.empty(SCRATCH, dtype=torch.float64)
    m = len(bucket.slots)
    sent = torch.zeros(world_size, m, 2, dtype=torch.float64)
    for rank in range(world_size):
        local, _ = bucket_plans(bucket, shard=_shard(rank, world_size))
        sent += local.sums(flats[rank], signs, 2, 12345, scratch)[0].view(world_size, m, 2)
    assert any(plan.folds for plan in bucket_plans(bucket, shard=_shard(0, world_size)))
    for rank in range(world_size):
        _, own = bucket_plans(bucket, shard=_shard(rank, world_size))
        rows = total[sum(bucket.chunks[:rank]) : sum(bucket.chunks[: rank + 1])]
        dots, norms = own.sums(rows, signs, 2, 12345, scratch, norms=False)
        assert norms is None and torch.equal(dots, sent[rank])
        assert sent[rank].abs().sum() > 0 or rows.abs().sum() == 0


# One segment each; then segments of one length at even and uneven spacing (runs of evenly spaced
# columns, layers repeating), between others, the last one at the end of the buffer.
SEGMENT_SHAPES = [
    [(5,), (2 * (2 * PERIOD + 77),), (300,)],
    [(6,), (300,), (6,), (300,), (6,), (300,), (6,), (6,), (8,), (300,), (6,), (3, 4), (6,), (300,), (6,)],
]


@pytest.mark.parametrize("shapes", SEGMENT_SHAPES)
def test_segment_sums_equal_the_dot_with_each_elements_sign(shapes):
    """The fold and the gathered products are the dot of each segment with S[(shift + q) mod PERIOD],
    also in a buffer that starts inside its storage."""
    world_size = 2
    bucket = _bucket(shapes, world_size)
    flat = torch.randn(bucket.packed_numel + 3)[3:]
    signs, scratch = sign_table(8, CPU), torch.empty(SCRATCH, dtype=torch.float64)
    shift = PERIOD - 100  # the signs wrap around the table
    dots, norms = bucket_plans(bucket, shard=_shard(0, world_size))[0].sums(flat, signs, 8, shift, scratch)
    m = len(bucket.slots)
    for dst in range(world_size):
        for j, slot in enumerate(bucket.slots):
            a, b = _piece(bucket, world_size, dst, slot.name)
            x = flat[a:b].double()
            expected = x @ signs[(shift + torch.arange(b - a)) % PERIOD]
            torch.testing.assert_close(dots[dst * m + j], expected, rtol=1e-12, atol=1e-9)
            torch.testing.assert_close(norms[dst * m + j], x.norm(), rtol=1e-12, atol=0)


def test_plans_keep_their_scratch_bounded():
    bucket = _bucket([(3,), (40 * PERIOD,), (PERIOD,), (1000,)] * 3, 8)
    for plan in bucket_plans(bucket, shard=_shard(3, 8)):
        for run in plan.runs:
            assert (run.rows[1] - run.rows[0]) * run.out.numel() // (run.rows[1] - run.rows[0]) * run.length <= SCRATCH
        for fold in plan.folds:
            rows = fold.rows[1] - fold.rows[0]
            assert all(rows * (PERIOD + b - a) <= SCRATCH for a, b in fold.chunks)


# ---------------------------------------------------------------------- no false alarm


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("whole", [False, True])
def test_random_gradients_raise_no_false_alarm(comm_dtype, whole):
    """Gradients of scales from 1e-4 to 1e4 with outliers, reduced with the communication dtype's
    rounding: no seed raises (the bound holds for any error; here it is exercised)."""
    world_size = 3
    bucket = _bucket([(1,), (7,), (17, 257), (3 * PERIOD + 9,)], world_size, whole, comm_dtype)
    checkers = _checkers(bucket, world_size, comm_dtype)
    for seed in range(4):
        grads = _grads(bucket, world_size, seed)
        if comm_dtype == torch.float16:
            grads = [[g.clamp(-3e3, 3e3) for g in per_param] for per_param in grads]
        finding = _step(bucket, grads, checkers, comm_dtype)
        assert finding.mismatches == [] and finding.nonfinite == []


# --------------------------------------------------------------------- faults, named


@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("whole", [False, True])
def test_a_dropped_doubled_or_corrupted_contribution_is_named(whole, comm_dtype):
    """Three faults at once, each on its own param, in turn on a 1-element param (rows: padding for
    ranks 1 and 2), a padded 17 x 257 one and one whose pieces span over two periods (folded); whole
    params: uneven chunks. Each is named, with the rank that explains it."""
    world_size = 3
    bucket = _bucket(SHAPES, world_size, whole, comm_dtype)
    owner = {s.name: s.shard.owner if whole else 0 for s in bucket.slots}  # rows: rank 0's piece is never padding
    grads = _grads(bucket, world_size, 1, spread=False)  # a contribution far below the others is lost in rounding
    checkers = _checkers(bucket, world_size, comm_dtype)
    params = ["p0", "p2", LONG]
    for turn in range(3):
        dropped, doubled, corrupted = params[turn:] + params[:turn]
        faults = [("drop", 1, dropped), ("double", 2, doubled), ("corrupt", owner[corrupted], corrupted)]
        with pytest.raises(IntegrityError) as caught:
            _step(bucket, grads, checkers, comm_dtype, faults)
        error = caught.value
        assert (sorted(error.names), error.kind) == (sorted(params), "reduction"), str(error)
        assert error.ranks == sorted({1, 2, owner[corrupted]}), str(error)
        for text, name in [
            ("rank 1's contribution was dropped", dropped),
            ("rank 2's contribution was doubled", doubled),
            (f"rank {owner[corrupted]}'s reduced rows differ", corrupted),
        ]:
            assert f"parameter {name!r} (rows of rank {owner[name]}): {text}" in str(error), str(error)


def test_a_non_finite_local_gradient_is_named_by_rank_and_param():
    world_size = 3
    bucket = _bucket(SHAPES, world_size)
    grads = _grads(bucket, world_size, 2)
    grads[1][_position(bucket, LONG)].view(-1)[PERIOD + 11] = float("nan")
    finding = _step(bucket, grads, _checkers(bucket, world_size))
    assert finding.nonfinite == [(1, LONG)] and finding.mismatches == []


# ------------------------------------------------------------------------- the verify split


def _split_body(rank, world_size):
    from hf_lowzero import LowLevelZeroOptimizer

    torch.manual_seed(0)  # the same params on every rank
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2, verify_every=2)
    checker = opt.integrity
    for step in range(1, 4):
        opt.backward(model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))).square().mean())
        table = checker.verify_launch()
        if step == 2:  # verify steps are 1 and 3
            assert table is None and checker.verify() is None
        else:
            assert table.shape[0] == world_size and checker.verify_launch() is table  # launched once
            with pytest.raises(ValueError, match="verify_launch"):  # the norm appended by mistake
                checker.verify_judge(torch.cat([table.flatten(), torch.ones(1, dtype=table.dtype)]).view(1, -1))
            finding = checker.verify_judge(table.cpu())  # the step's one copy to the host
            assert finding.mismatches == [] and checker.verify() is finding and checker.verify_launch() is None
        opt.step()
        opt.zero_grad()
    assert (checker.checks, checker.failures, checker.last_verified) == (2, 0, 3)


def test_verify_splits_into_a_launch_on_the_device_and_a_judgement_on_the_host():
    from hf_lowzero.testing import run_distributed

    run_distributed(_split_body, 2)


# ----------------------------------------------------------------------- replica hashes


def test_the_hash_sees_a_flip_a_cancelling_pair_and_a_swap():
    weights = hash_weights(CPU)
    x = torch.randn(3 * checksums.HASH_WIDTH + 6)
    base = tensor_hash(x, weights)
    assert torch.equal(tensor_hash(x.clone(), weights), base)
    words = x.clone().view(torch.int32)
    words[7] ^= 1 << 3
    assert not torch.equal(tensor_hash(words.view(torch.float32), weights)[0], base[0])
    pair = x.clone().view(torch.int64)  # the same change, up in one word and down in another: the sums agree
    pair[1] += 1 << 40
    pair[2] -= 1 << 40
    changed = tensor_hash(pair.view(torch.float32), weights)
    assert changed[0] == base[0] and changed[1] != base[1]
    swapped = x.clone()  # two elements in different words (the low halves of words 0 and 1) trade places
    swapped[[0, 2]] = swapped[[2, 0]]
    changed = tensor_hash(swapped, weights)
    assert changed[0] == base[0] and changed[1] != base[1]


def _hash_by_definition(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``tensor_hash`` as its docstring defines it, one word at a time in plain int64 arithmetic."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.numel() % 8 == 0:
        words = raw.view(torch.int64)
    else:
        words = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).to(torch.int64)
    positions = torch.arange(words.numel()) % checksums.HASH_WIDTH
    return torch.stack([words.sum(), (words * weights[positions]).sum()])


def test_hashes_stacked_equal_the_hashes_one_by_one_and_the_definition():
    width, batch = checksums.HASH_WIDTH, checksums.HASH_BATCH
    tensors = [torch.randn(n) for n in (2, 6, 6, 2 * width, 2 * width + 2, 2 * width + 4, 2 * batch + 2, 4, 3)]
    tensors += [torch.randn(8, dtype=torch.bfloat16), torch.randn(6, 6)[:, :4], torch.zeros(0)]
    tensors += [torch.randn(2, 3), torch.randn(3, 2), torch.randn(16, dtype=torch.bfloat16).view(4, 4)]  # 6 floats
    tensors += [torch.randn((), dtype=torch.float64), torch.randn(3, 4, requires_grad=True)]
    tensors += [torch.randn(64 * width + 3)]  # 4-byte words over two windows, the last one narrow
    tensors += [torch.randint(-(2**62), 2**62, (width + 1,)), torch.randint(-(2**62), 2**62, (width - 1,))]
    named = [(f"t{i}", t) for i, t in enumerate(tensors)]
    hashes = checksums.ReplicaHashes(named)
    (rows,) = hashes.compute()
    weights = hash_weights(CPU)
    expected = torch.stack([_hash_by_definition(t, weights) for t in tensors])
    assert torch.equal(torch.stack([tensor_hash(t, weights) for t in tensors]), expected)
    order = [int(name[1:]) for name in hashes.names]
    assert sorted(order) == list(range(len(tensors))) and torch.equal(rows, expected[order])
    assert not rows.requires_grad


@pytest.mark.parametrize("tensor", [torch.randn(7, dtype=torch.bfloat16), torch.arange(13, dtype=torch.uint8)])
def test_the_hash_reads_any_byte_count(tensor):
    weights = hash_weights(CPU)
    base = tensor_hash(tensor, weights)
    changed = tensor.clone()
    changed.view(torch.uint8)[-1] ^= 1
    assert not torch.equal(tensor_hash(changed, weights), base)


# -------------------------------------------------------------------------- no host sync


class _HostReads(TorchDispatchMode):
    """Records what makes the host wait for the device: reading a value (``.item()``, a Python
    branch on a tensor) or an op whose output shape depends on values."""

    WAITS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "repeat_interleave", "item")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.WAITS):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_hooks_make_no_host_sync(monkeypatch):
    """``begin_step``, ``after_pack`` and ``after_reduce`` read no device value on the host."""
    world_size = 2
    bucket = _bucket(SHAPES, world_size)
    flats = _packed(bucket, _grads(bucket, world_size, 3), world_size, None)
    checker = _checkers(bucket, world_size)[0]
    for method in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, lambda *a, _m=method, **k: pytest.fail(f"{_m}() in a hook"))
    with _HostReads() as reads:
        checker.begin_step()
        checker.after_pack(bucket, flats[0])
        checker.after_reduce(bucket, flats[0][: bucket.row_numel].clone())
    assert reads.seen == []


def judged(checkers):
    """Every rank's table of a verify step, judged as the step judges it; the checkers' step ended."""
    table = torch.stack([c.payload() for c in checkers])
    try:
        return checkers[0].verify_judge(table)
    finally:
        for checker in checkers:
            checker.end_step(skipped_nonfinite=False)


def sent_with_faults(bucket, flats, faults):
    """What each rank sends (``flats``, one packed bucket per rank) once the "drop" and "double"
    faults of ``faults`` ((kind, rank, param name) each) have changed the senders' pieces."""
    world_size = len(flats)
    sent = [f.clone() for f in flats]
    for kind, src, name in faults:
        for dst in range(world_size):
            a, b = _piece(bucket, world_size, dst, name)
            sent[src][a:b] *= {"drop": 0, "double": 2}.get(kind, 1)
    return sent
