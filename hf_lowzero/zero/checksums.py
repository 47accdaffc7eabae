"""The arithmetic of the integrity checks ([Note: integrity checks] in ``integrity.py``): random-sign
checksums of a bucket's segments and exact hashes of tensors' bits. Everything runs on the tensors'
device, in bounded scratch, and reads no device value on the host: what the host needs (where each
segment lies, how the work is tiled) is a ``SegmentPlan``, made once per bucket from its static layout.

Example::

    signs = sign_table(probes=2, device=device)             # [PERIOD, 2] float64 of +-1
    local, own = bucket_plans(bucket, world_size, rank)
    dots, norms = local.sums(flat, signs, probes=2, shift=7, scratch=scratch)  # [W * m, 2], [W * m]
    words = tensor_hash(param, hash_weights(device))        # [2] int64

# [Note: segment checksums]
# A segment (one parameter's piece for one destination rank) of n elements gives element q the
# signs S[(shift + q) mod PERIOD, :P] of a +-1 table drawn once, from a fixed seed, the same on
# every rank; shift depends on the step and the reduction, so each check sees other signs. Signs
# count from the segment's start, so every segment of one length uses the same rows of S: a run of
# such segments (the same param in every layer, biases, norms, LoRA adapters) is one gathered
# [segments, n] @ [n, P] product, however many there are. A segment longer than PERIOD repeats its
# signs every PERIOD elements, so its dot equals the dot of S with its fold (the sum of its
# PERIOD-long blocks, in float64): one add per element instead of P multiply-adds.
# The price is in the bound ([Note: integrity checks]): with e the rounding error of the reduction
# and E its fold, the residual is sum_t S_t E_t, so Hoeffding's bound is SIGMAS ||E||_2, and by
# Cauchy-Schwarz ||E||_2 <= sqrt(m) ||e||_2 for a segment touching m blocks.
# The checks' own float64 arithmetic: a dot of a fold of m blocks of length T errs by at most
# (m + T) u64 ||x||_1 <= (m + T) u64 sqrt(n) ||x||_2 (u64 = 2^-53; any summation order).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from hf_lowzero.zero.buckets import Bucket

PERIOD = 1 << 17  # rows of the sign table: a segment's signs repeat after this many elements
SCRATCH = 1 << 19  # float64 elements of scratch a bucket's sums use at most (4 MiB), whatever its size
HASH_WIDTH = 1 << 12  # positions weighted apart in a tensor's second hash
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
    """Segments of one length, gathered and multiplied at once: rows ``rows`` of the members
    (positions in the plan's split) ``members``; results go to output slots ``out`` (row-major)."""

    rows: tuple[int, int]
    members: operator.itemgetter
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
    bounds: tuple[int, ...]  # column splits: piece i of the split is segment i
    runs: tuple[_Run, ...]
    folds: tuple[_Fold, ...]

    @staticmethod
    def build(rows: int, cols: int, segments: list[tuple[int, int]], row_slots: int, slots: int, device):
        """``segments``: (length, slot of row 0) in column order, tiling ``[0, cols)``; row ``r``'s
        output slot is ``slot + r * row_slots``."""
        lengths = [n for n, _ in segments if n > 0]
        slot_of = [slot for n, slot in segments if n > 0]
        assert sum(lengths) == cols, (lengths, cols)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]

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
                    picker = operator.itemgetter(*chosen) if len(chosen) > 1 else _single(chosen[0])
                    runs.append(_Run(rr, picker, n, out(rr, chosen)))
        # a fold holds [rows, PERIOD] and reads [rows, periods * PERIOD] at a time, within SCRATCH
        fold_rows = max(1, SCRATCH // (4 * PERIOD))
        for i, n in enumerate(lengths):
            if n > PERIOD:
                for r in range(0, rows, fold_rows):
                    rr = (r, min(rows, r + fold_rows))
                    step = max(1, SCRATCH // (rr[1] - rr[0]) // PERIOD - 1) * PERIOD
                    chunks = tuple((a, min(a + step, n)) for a in range(0, n, step))
                    folds.append(_Fold(rr, tuple((starts[i] + a, starts[i] + b) for a, b in chunks), out(rr, [i])))
        runs.sort(key=lambda run: run.rows)  # one split of the buffer per row range
        return SegmentPlan(rows, cols, slots, tuple(starts[1:]), tuple(runs), tuple(folds))

    def sums(
        self, values: torch.Tensor, signs: torch.Tensor, probes: int, shift: int, scratch: torch.Tensor, norms=True
    ):
        """Every segment's dots with the signs from ``shift`` ([Note: segment checksums]) and, with
        ``norms``, its L2 norm: ``[slots, probes]`` and ``[slots]`` float64 (or None), on ``values``'
        device. ``values``: the 1D buffer; ``scratch``: SCRATCH float64 elements on its device."""
        view = values.view(self.rows, self.cols)
        dots = torch.zeros(self.slots, probes, dtype=torch.float64, device=values.device)
        squares = torch.zeros(self.slots, dtype=torch.float64, device=values.device)
        split_rows, pieces = None, ()
        for run in self.runs:
            if run.rows != split_rows:  # most plans split once
                split_rows, pieces = run.rows, view[run.rows[0] : run.rows[1]].tensor_split(self.bounds, dim=1)
            members = run.members(pieces)
            x = scratch[: (run.rows[1] - run.rows[0]) * len(members) * run.length]
            torch.cat(members, dim=1, out=x.view(run.rows[1] - run.rows[0], -1))  # cast to float64 on the way
            x = x.view(-1, run.length)  # [rows * members, length], row-major
            dots.index_add_(0, run.out, _signed(x, signs, probes, shift))
            if norms:
                squares.index_add_(0, run.out, torch.linalg.vector_norm(x, dim=1).square_())
        for fold in self.folds:
            rows = fold.rows[1] - fold.rows[0]
            total = scratch[: rows * PERIOD].view(rows, PERIOD).zero_()
            square = torch.zeros(rows, dtype=torch.float64, device=values.device)
            for a, b in fold.chunks:
                full, rest = (b - a) // PERIOD * PERIOD, (b - a) % PERIOD
                x = scratch[rows * PERIOD : rows * PERIOD + rows * (b - a)].view(rows, b - a)
                x.copy_(view[fold.rows[0] : fold.rows[1], a:b])
                total += x[:, :full].view(rows, -1, PERIOD).sum(1)
                if rest:
                    total[:, :rest] += x[:, full:]
                if norms:
                    square += torch.linalg.vector_norm(x, dim=1).square_()
            dots.index_add_(0, fold.out, _signed(total, signs, probes, shift))
            squares.index_add_(0, fold.out, square)
        return dots, squares.sqrt_() if norms else None


def _single(i: int):
    return lambda pieces: (pieces[i],)


def bucket_plans(bucket: Bucket, world_size: int, rank: int, device) -> tuple[SegmentPlan, SegmentPlan]:
    """The plans of a bucket's two sides: the packed bucket (outputs per destination rank and param,
    ``[W * m]``) and this rank's reduced chunk (outputs per param, ``[m]``)."""
    m = len(bucket.slots)
    if bucket.whole:  # chunk after chunk, each param whole in its owner's chunk (packing order)
        segments = [(s.shard.numel, s.shard.owner * m + j) for j, s in enumerate(bucket.slots)]
        local = SegmentPlan.build(1, bucket.packed_numel, segments, 0, world_size * m, device)
    else:  # [W, row_numel]: every chunk holds every param's piece at the same columns
        segments = [(s.shard.shard_numel, j) for j, s in enumerate(bucket.slots)]
        local = SegmentPlan.build(world_size, bucket.row_numel, segments, m, world_size * m, device)
    own = [(s.shard.piece_numel(rank), j) for j, s in enumerate(bucket.slots)]
    return local, SegmentPlan.build(1, bucket.chunks[rank], own, 0, m, device)


def bound_factors(bucket: Bucket, world_size: int, unit_roundoff: float, sigmas: float) -> torch.Tensor:
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


def hash_weights(device) -> torch.Tensor:
    """``[HASH_WIDTH]`` int64: the fixed random weights of a tensor's second hash."""
    g = torch.Generator().manual_seed(SIGN_SEED + 1)
    return torch.randint(-(2**62), 2**62, (HASH_WIDTH,), generator=g, dtype=torch.int64).to(device)


def tensor_hash(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Two wrapping int64 sums of ``t``'s bits, on its device: of its words, and of its words
    weighted by their position (mod HASH_WIDTH), so that a word changed, two changes that cancel
    in the first sum, or words swapped all show. One read of ``t``: 8-byte words where its bytes
    allow (no scratch), else 4- or 1-byte words widened by windows."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    for size, dtype in ((8, torch.int64), (4, torch.int32), (1, torch.uint8)):
        if raw.numel() % size == 0 and raw.storage_offset() % size == 0:
            words = raw.view(dtype)
            break
    window = words.numel() if words.dtype == torch.int64 else 64 * HASH_WIDTH
    fold = torch.zeros(HASH_WIDTH, dtype=torch.int64, device=t.device)
    for a in range(0, words.numel(), window):
        wide = words[a : a + window].to(torch.int64)
        full = wide.numel() // HASH_WIDTH * HASH_WIDTH
        fold += wide[:full].view(-1, HASH_WIDTH).sum(0)
        fold[: wide.numel() - full] += wide[full:]
    return torch.stack([fold.sum(), (fold * weights.to(t.device)).sum()])
