"""The arithmetic of the integrity checks ([Note: integrity checks] in ``checker.py``): random-sign
checksums of a bucket's segments, and exact hashes of tensors' bits. Everything runs on the tensors'
device, in bounded scratch, and reads no device value on the host: what the host needs (where each
segment lies, how the work is tiled, which tensors are hashed together) is planned once, from the
static layout, when the checker is made.

Example::

    signs = sign_table(probes=2, device=device)             # [PERIOD, 2] float64 of +-1
    local, own = bucket_plans(bucket, shard=shard)
    dots, norms = local.sums(flat, signs, probes=2, shift=7, scratch=scratch)  # [W * m, 2], [W * m]
    hashes = ReplicaHashes(named_tensors).compute()          # per device: [tensors, 2] int64

# [Note: segment checksums]
# A segment (one parameter's piece for one destination rank) of n elements gives its element q the
# signs S[(shift + q) mod PERIOD, :P] of a +-1 table drawn once from a fixed seed, the same on every
# rank; shift depends on the step and the reduction, so each check meets other signs. The rounding
# errors of a reduction never depend on S (training never reads it), so Hoeffding's bound holds for
# every check whatever the table. Signs count from the segment's start, so all segments of one
# length use the same rows of S: the segments of a length (the same param in every layer, biases,
# norms, LoRA adapters) are gathered, cast to float64 and multiplied at once, [segments, n] @ [n, P],
# in tiles of at most SCRATCH elements. A segment longer than PERIOD repeats its signs every PERIOD
# elements, so its dots are those of its fold (the sum of its PERIOD-long blocks, float64) with S:
# one add per element instead of P multiply-adds.
# The price is in the bound: with e the reduction's rounding error and E its fold, the residual is
# sum_t S_t E_t, so Hoeffding bounds it by SIGMAS ||E||_2, and by Cauchy-Schwarz
# ||E||_2 <= sqrt(m) ||e||_2 for a segment touching m blocks.
# The checks' own float64 arithmetic over a segment of n elements (x: one rank's piece, or the
# owner's rows): a fold of m blocks then a dot of min(n, PERIOD) terms errs by at most
# (m + min(n, PERIOD)) u64 ||x||_1 <= (m + min(n, PERIOD)) u64 sqrt(n) ||x||_2 in any summation
# order (u64 = 2^-53). Summed over the sources, the owner (||own|| <= 2 sum_src ||g_src|| when the
# reduction is right) and the judge's W-term sum, that is below
# 3 (m + min(n, PERIOD) + W) u64 sqrt(n) sum_src ||g_src|| (``bound_factors``). The norms themselves
# are float64 sums, low by a relative n u64 at most: immaterial to the bound's probability.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.runtime.shard_group import ShardGroup

PERIOD = 1 << 17  # rows of the sign table: a segment's signs repeat after this many elements
SCRATCH = 1 << 19  # float64 elements of scratch a bucket's sums use at most (4 MiB), whatever its size
HASH_WIDTH = 1 << 10  # positions weighted apart in a tensor's second hash
HASH_BATCH = 1 << 16  # words: a tensor up to this size is hashed together with the others of its length
SIGN_SEED = 20260101  # of the sign table: the same on every rank
U64 = 2.0**-53


def sign_table(probes: int, device: torch.device) -> torch.Tensor:
    """``[PERIOD, probes]`` float64 of independent random +-1, the same on every rank (a fixed seed)."""
    bits = torch.randint(0, 2, (PERIOD, probes), generator=torch.Generator().manual_seed(SIGN_SEED), dtype=torch.int8)
    return bits.to(device).to(torch.float64).mul_(2).sub_(1)


def _signed(x: torch.Tensor, signs: torch.Tensor, probes: int, shift: int) -> torch.Tensor:
    """``x`` ([rows, n] float64, n <= PERIOD) times the signs of positions 0..n-1 from ``shift``
    (wrapping around the table): ``[rows, probes]``."""
    n = x.shape[1]
    end = shift + n
    if end <= PERIOD:
        return x @ signs[shift:end, :probes]
    cut = PERIOD - shift
    return x[:, :cut] @ signs[shift:, :probes] + x[:, cut:] @ signs[: end - PERIOD, :probes]


@dataclass(frozen=True, eq=False)
class _Run:
    """Segments of one length, gathered and multiplied at once: rows ``rows`` of the members, read
    as ``strided`` runs of evenly spaced segments (``(first column, count, spacing)``, in member
    order: layers repeat, so a model's members of one length take a few); results go to output slots
    ``out`` (row-major)."""

    rows: tuple[int, int]
    strided: tuple[tuple[int, int, int], ...]
    length: int
    out: torch.Tensor  # [rows * members] int64, on the device


@dataclass(frozen=True, eq=False)
class _Fold:
    """One segment longer than PERIOD, for rows ``rows``: folded by ``chunks`` (column ranges, each
    a whole number of periods but the last), results to output slots ``out``."""

    rows: tuple[int, int]
    chunks: tuple[tuple[int, int], ...]
    out: torch.Tensor  # [rows] int64, on the device


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Where the segments of a 1D buffer lie, viewed as ``[rows, cols]`` (a packed bucket of row
    shards: one row per destination rank; otherwise one row), and how their sums are tiled.

    Build with ``bucket_plans``; ``sums`` computes every segment's dots and L2 norm.
    """

    rows: int
    cols: int
    slots: int  # outputs: segments times rows (empty segments stay zero)
    runs: tuple[_Run, ...]
    folds: tuple[_Fold, ...]

    @staticmethod
    def build(rows: int, cols: int, segments: list[tuple[int, int]], row_slots: int, slots: int, device):
        """``segments``: (length, slot of row 0) in column order, tiling ``[0, cols)``; row ``r``'s
        output slot is ``slot + r * row_slots``."""
        lengths = [n for n, _ in segments if n > 0]
        slot_of = [slot for n, slot in segments if n > 0]
        assert sum(lengths) == cols, (lengths, cols)
        starts = [0, *itertools.accumulate(lengths)][:-1]

        def out(rows_range, members):
            return torch.tensor(
                [slot_of[i] + r * row_slots for r in range(*rows_range) for i in members], dtype=torch.int64
            ).to(device)

        runs, folds = [], []
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            if n <= PERIOD:
                by_length.setdefault(n, []).append(i)
        for n, members in by_length.items():
            per_rows = rows if rows * n <= SCRATCH else max(1, SCRATCH // n)
            per_members = max(1, SCRATCH // (per_rows * n))
            for r in range(0, rows, per_rows):
                rr = (r, min(rows, r + per_rows))
                for k in range(0, len(members), per_members):
                    chosen = members[k : k + per_members]
                    runs.append(_Run(rr, _evenly_spaced([starts[i] for i in chosen], n), n, out(rr, chosen)))
        # a fold holds [rows, PERIOD] and reads [rows, periods * PERIOD] at a time, within SCRATCH
        fold_rows = max(1, SCRATCH // (4 * PERIOD))
        for i, n in enumerate(lengths):
            if n > PERIOD:
                for r in range(0, rows, fold_rows):
                    rr = (r, min(rows, r + fold_rows))
                    step = max(1, SCRATCH // (rr[1] - rr[0]) // PERIOD - 1) * PERIOD
                    chunks = tuple((a, min(a + step, n)) for a in range(0, n, step))
                    folds.append(_Fold(rr, tuple((starts[i] + a, starts[i] + b) for a, b in chunks), out(rr, [i])))
        return SegmentPlan(rows, cols, slots, tuple(runs), tuple(folds))

    def sums(
        self, values: torch.Tensor, signs: torch.Tensor, probes: int, shift: int, scratch: torch.Tensor, norms=True
    ):
        """Every segment's dots with the signs from ``shift`` ([Note: segment checksums]) and, with
        ``norms``, its L2 norm: ``[slots, probes]`` and ``[slots]`` float64 (or None), on ``values``'
        device. ``values``: the 1D buffer; ``scratch``: SCRATCH float64 elements on its device."""
        view = values.view(self.rows, self.cols)
        dots = torch.zeros(self.slots, probes, dtype=torch.float64, device=values.device)
        squares = torch.zeros(self.slots if norms else 0, dtype=torch.float64, device=values.device)
        for run in self.runs:
            rows = run.rows[1] - run.rows[0]
            first = values.storage_offset() + run.rows[0] * self.cols
            pieces = [
                values.as_strided((rows, count, run.length), (self.cols, spacing, 1), first + column)
                for column, count, spacing in run.strided
            ]  # [rows, count, length] each: views, nothing read yet
            gathered = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # [rows, members, length]
            x = scratch[: gathered.numel()]
            x.view(gathered.shape).copy_(gathered)  # one read in the buffer's dtype, one cast to float64
            x = x.view(-1, run.length)  # [rows * members, length], row-major
            dots.index_add_(0, run.out, _signed(x, signs, probes, shift))
            if norms:
                squares.index_add_(0, run.out, torch.linalg.vector_norm(x, dim=1).square_())
        for fold in self.folds:
            rows = fold.rows[1] - fold.rows[0]
            total = scratch[: rows * PERIOD].view(rows, PERIOD).zero_()
            square = torch.zeros(rows, dtype=torch.float64, device=values.device)
            for a, b in fold.chunks:
                x = scratch[rows * PERIOD : rows * PERIOD + rows * (b - a)].view(rows, b - a)
                x.copy_(view[fold.rows[0] : fold.rows[1], a:b])
                for c in range(0, b - a, PERIOD):  # contiguous adds: faster than a sum over a middle dim
                    block = x[:, c : c + PERIOD]
                    total[:, : block.shape[1]] += block
                if norms:
                    square += torch.linalg.vector_norm(x, dim=1).square_()
            dots.index_add_(0, fold.out, _signed(total, signs, probes, shift))
            if norms:
                squares.index_add_(0, fold.out, square)
        return dots, squares.sqrt_() if norms else None


def _evenly_spaced(starts: list[int], length: int) -> tuple[tuple[int, int, int], ...]:
    """``starts`` (increasing) as runs of evenly spaced columns, ``(first, count, spacing)``, in order."""
    runs: list[list[int]] = []  # [first, count, spacing]
    for start in starts:
        last = runs[-1] if runs else None
        if last is not None and (last[1] == 1 or start - last[0] == last[1] * last[2]):
            last[2] = start - last[0] if last[1] == 1 else last[2]
            last[1] += 1
        else:
            runs.append([start, 1, length])
    return tuple((first, count, spacing) for first, count, spacing in runs)


def bucket_plans(bucket: Bucket, *, shard: ShardGroup) -> tuple[SegmentPlan, SegmentPlan]:
    """The plans of a bucket's two sides: the packed bucket (outputs per destination rank and param,
    ``[W * m]``) and this rank's reduced chunk (outputs per param, ``[m]``), on the params' device."""
    m, world_size, rank, device = len(bucket.slots), shard.world_size, shard.rank, shard.device
    if bucket.whole:  # chunk after chunk, each param whole in its owner's chunk (packing order)
        segments = [(s.shard.numel, s.shard.owner * m + j) for j, s in enumerate(bucket.slots)]
        local = SegmentPlan.build(1, bucket.packed_numel, segments, 0, world_size * m, device)
    else:  # [W, row_numel]: every chunk holds every param's piece at the same columns
        segments = [(s.shard.shard_numel, j) for j, s in enumerate(bucket.slots)]
        local = SegmentPlan.build(world_size, bucket.row_numel, segments, m, world_size * m, device)
    own = [(s.shard.piece_numel(rank), j) for j, s in enumerate(bucket.slots)]
    return local, SegmentPlan.build(1, bucket.chunks[rank], own, 0, m, device)


def bound_factors(bucket: Bucket, *, world_size: int, unit_roundoff: float, sigmas: float) -> torch.Tensor:
    """``[W, m]`` float64 on the host: per owner and param, what the sum of the sources' L2 norms is
    multiplied by to bound the residual ([Note: integrity checks], [Note: segment checksums])."""
    spread = (world_size - 1) * unit_roundoff
    gamma = spread / (1 - spread) if spread < 1 else math.inf  # every element's sum: gamma_{W-1}
    factors = torch.zeros(world_size, len(bucket.slots), dtype=torch.float64)
    for owner in range(world_size):
        for j, slot in enumerate(bucket.slots):
            n = slot.shard.piece_numel(owner)
            blocks = -(-n // PERIOD)
            arithmetic = 3 * (blocks + min(n, PERIOD) + world_size) * U64 * math.sqrt(n)  # the checks' own
            factors[owner, j] = sigmas * gamma * math.sqrt(blocks) + arithmetic
    return factors


# ------------------------------------------------------------------------------ replica hashes


class ReplicaHashes:
    """The replica hashes of ``tensors`` (``(name, tensor)`` pairs; ``tensor_hash`` of each),
    planned once: device by device, contiguous tensors of up to HASH_BATCH words stacked with the
    others of their dtype and shape and hashed at once (thousands of biases, norms or adapters cost
    a few operations, and no Python work per tensor), the others one by one. ``names``: the order of
    ``compute()``'s rows.

    Example::

        hashes = ReplicaHashes(hashed_tensors(model))
        per_device = hashes.compute()  # [[tensors on device d, 2] int64 on d, ...], rows in names' order
    """

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        plan: dict[torch.device, tuple[dict[tuple, list], list]] = {}
        for name, t in tensors:
            nbytes, offset = t.numel() * t.element_size(), t.storage_offset() * t.element_size()
            stacked, single = plan.setdefault(t.device, ({}, []))
            if t.is_contiguous() and 0 < nbytes <= 8 * HASH_BATCH and nbytes % 8 == 0 and offset % 8 == 0:
                stacked.setdefault((t.dtype, tuple(t.shape)), []).append((name, t))
            else:
                single.append((name, t))
        self.names: list[str] = []
        self._devices = []  # per device: its weights, stacks (lists of tensors of one dtype and shape), singles
        for device, (stacked, single) in plan.items():
            stacks = []
            for members in stacked.values():
                words = members[0][1].numel() * members[0][1].element_size() // 8
                per = max(1, SCRATCH // words)  # what one stack copies
                stacks += [members[k : k + per] for k in range(0, len(members), per)]
            for pairs in [*stacks, single]:
                self.names += [name for name, _ in pairs]
            self._devices.append(
                (hash_weights(device), [[t for _, t in pairs] for pairs in stacks], [t for _, t in single])
            )

    @torch.no_grad()
    def compute(self) -> list[torch.Tensor]:
        """Every tensor's ``tensor_hash``, as ``[tensors, 2]`` int64 per device (no host sync). A
        stack's row holds its tensor's bytes in memory order (each is contiguous): its words."""
        out = []
        for weights, stacks, single in self._devices:
            rows = [
                _finish(_fold(torch.stack(stack).view(len(stack), -1).view(torch.int64)), weights) for stack in stacks
            ]
            rows += [torch.stack([tensor_hash(t, weights) for t in single])] if single else []
            out.append(torch.cat(rows))
        return out


def hash_weights(device) -> torch.Tensor:
    """``[HASH_WIDTH]`` int64: the fixed random weights of a tensor's second hash."""
    g = torch.Generator().manual_seed(SIGN_SEED + 1)
    return torch.randint(-(2**62), 2**62, (HASH_WIDTH,), generator=g, dtype=torch.int64).to(device)


def tensor_hash(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Two wrapping int64 sums of ``t``'s bits, on its device: of its words, and of its words
    weighted by their position (mod HASH_WIDTH), so that a word changed, two changes that cancel
    in the first sum, or words swapped all show. One read of ``t``, as 8-byte words where its bytes
    allow (no scratch); else as 4- or 1-byte words, widened by windows."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.numel() % 8 == 0 and raw.storage_offset() % 8 == 0:
        return _finish(_fold(raw.view(torch.int64).view(1, -1)), weights)[0]
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.storage_offset() % 4 == 0 else raw
    window = 64 * HASH_WIDTH
    folds = [_fold(words[a : a + window].to(torch.int64).view(1, -1)) for a in range(0, max(1, words.numel()), window)]
    total = folds[0]  # full width where more windows follow; the last may be narrower
    for fold in folds[1:]:
        total[:, : fold.shape[1]] += fold
    return _finish(total, weights)[0]


def _fold(words: torch.Tensor) -> torch.Tensor:
    """``[k, n]`` int64 words -> ``[k, min(n, HASH_WIDTH)]``: each row summed by position mod
    HASH_WIDTH (rows no longer than that are their own fold: the positions past n would be zeros)."""
    k, n = words.shape
    if n <= HASH_WIDTH:
        return words
    full = n // HASH_WIDTH * HASH_WIDTH
    fold = words[:, :full].view(k, -1, HASH_WIDTH).sum(1)
    fold[:, : n - full] += words[:, full:]
    return fold


def _finish(fold: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[k, 2]``: the two hashes of each row's fold (its positions weighted by the first weights)."""
    return torch.stack([fold.sum(1), (fold * weights[: fold.shape[1]]).sum(1)], dim=1)
