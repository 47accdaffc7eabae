"""Integrity checks while training: every replica identical, every reduction right.

``IntegrityChecker`` is called at points the step already has: the first backward of a step
(``begin_step``), each bucket packed (``after_pack``) and reduced (``after_reduce``), and the step
(``verify``, before the norm). On a verify step ([Note: integrity checks]) it costs one read of the
params and a few of the gradients, on the device, and one all-gather of a few numbers per parameter;
on other steps nothing.

Example::

    opt = LowLevelZeroOptimizer(model, inner, verify_every=10, on_mismatch="raise")
    ...                                     # a mismatch raises IntegrityError on every rank at once
    opt.integrity.checks, opt.integrity.failures

# [Note: integrity checks]
# The step is exact: after the all-gather every rank holds bit-identical params, and a reduction
# is a sum. Both can be checked exactly and cheaply.
# - Replicas. On a verify step each rank hashes every parameter (trainable and frozen) and
#   persistent buffer as the step's forward sees them: two int64 sums of its bit patterns, words
#   and squared words, wrapping. Any flipped bit changes the first. The ranks compare the hashes;
#   a parameter whose hash differs names the ranks that disagree with the majority (with two
#   ranks, both).
# - Reductions. For every bucket reduced on a verify step each rank draws P vectors of random
#   signs (+1/-1) over the packed bucket from a seed all ranks share (the step and the reduction's
#   place in it), and takes, per destination rank and parameter, the dot product of its packed
#   (pre-divided) gradients with each, and their L2 norm. After the collective the owner takes the
#   same dot products of its reduced rows. Summation is linear: the owner's dot must equal the sum
#   of the ranks' dots, up to the rounding of the reduction. That rounding error e, whatever it is,
#   does not depend on the random signs v, so sum(e_i v_i) is a sum of independent terms of random
#   sign: by Hoeffding's inequality it exceeds 8 standard deviations with probability below
#   2 exp(-32) (1e-14), and its standard deviation is at most (W - 1) eps ||sum of |g_src|||, bounded
#   by (W - 1) eps sum_src ||g_src|| (eps: the communication dtype's unit roundoff). That is the
#   bound. A dropped or doubled contribution moves the dot by that rank's own dot, of standard
#   deviation ||g_src||: far outside the bound in fp32; with bf16 reductions the bound is wider
#   (eps = 2^-8), so 16-bit reductions use 8 probes instead of 2. The residual against each rank's
#   dots names the rank whose contribution explains it (dropped: -its dot, doubled: +its dot);
#   one no rank explains is corruption of the owner's rows.
# - Non-finite local gradients show as non-finite dots: they name their rank and parameter before
#   the reduction mixes them into every rank's rows (the step is then skipped, as always).
# Every rank gathers every rank's numbers and judges the same way, so all raise together, before the
# update (and before any checkpoint or snapshot of that state). What it cannot see: a gradient
# computed wrong but consistently on one rank (its dot agrees with what it sent), and masters
# corrupted on their owner (every rank then gathers the same wrong params); those need a replay.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_lowzero.zero import comm, faults
from hf_lowzero.zero.buckets import Bucket
from hf_lowzero.zero.config import AUTO_OVERHEAD, VERIFY_AUTO, VERIFY_OFF, check_verify_every

MAX_INTERVAL = 1000
SIGMAS = 8.0  # [Note: integrity checks]: the bound's standard deviations
SLACK = 1e-9  # float64 summation of the dots themselves, relative


class IntegrityError(RuntimeError):
    """A check found training state that is not what exact data parallelism computes.

    Raised on every rank together, before the step's update (``on_mismatch="raise"``), so that no
    checkpoint or snapshot is written from that state.

    Args:
        message: What was found: per kind of mismatch, its first parameter in full and how many more.
        step: The optimizer step (the Trainer's numbering).
        ranks: The ranks named (with 2 ranks and no majority, both).
        names: Every parameter that failed its check.
        kind: "replica" (replicas differ), "reduction" (a reduction's checksum) or "repeated" (a
            fault that repeats on one node, on Ray).
    """

    def __init__(self, message: str, step: int, ranks: list[int], names: list[str], kind: str) -> None:
        super().__init__(message)
        self.step, self.ranks, self.names, self.kind = step, ranks, names, kind

    def __reduce__(self):  # picklable with its fields (Ray sends exceptions across processes)
        return (type(self), (str(self), self.step, self.ranks, self.names, self.kind))


@dataclass
class Finding:
    """What a verify step found: mismatches (raise) and non-finite local gradients (reported)."""

    step: int
    mismatches: list[str] = field(default_factory=list)
    groups: list[tuple] = field(default_factory=list)  # per mismatch: alike ones are reported together
    ranks: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    nonfinite: list[tuple[int, str]] = field(default_factory=list)  # (rank, parameter)


@dataclass
class _Record:
    """One bucket's reduction on a verify step: this rank's numbers for it."""

    bucket: Bucket
    local: torch.Tensor  # [W * m * P + W * m] float64: dots per (destination, param, probe), norms
    seed: int  # of the signs (the step and the reduction's place in it: the same on every rank)
    own: torch.Tensor | None = None  # [m * P] float64: dots of the reduced rows


class IntegrityChecker:
    """See the module docstring. ``names``: each bucket's param names (packing order); ``tensors``:
    what the replica check hashes, ``(name, tensor)``: every param and persistent buffer.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        names: dict[int, str],
        tensors: list[tuple[str, torch.Tensor]],
        comm_dtype: torch.dtype | None,
        group,
        rank: int,
        world_size: int,
        device: torch.device,
        every: int | str,
        on_mismatch: str,
    ) -> None:
        self.buckets, self.names, self.tensors = buckets, names, tensors
        self.comm_dtype = comm_dtype
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.every = check_verify_every(every)
        self.on_mismatch = on_mismatch
        self.enabled = self.every != VERIFY_OFF and world_size > 1
        self.interval = self.every if isinstance(self.every, int) else 1
        self.step = 1  # the step being taken (the Trainer sets its own numbering)
        self.last_verified = 0  # the newest step whose checks all passed
        self.checks = 0
        self.failures = 0
        self.verify_seconds = 0.0
        self.bytes_gathered = 0
        self._forced: set[int] = set()
        self._next = 1  # the next step to verify
        self._verifying = False
        self._began = False
        self._hashes: torch.Tensor | None = None
        self._records: list[_Record] = []
        self._pending: dict[int, _Record] = {}
        self._spent = 0.0  # seconds of checks in this step
        self._step_started: float | None = None
        self._step_seconds: float | None = None
        self._finding: Finding | None = None
        self._segment_ends: dict[tuple[int, bool], torch.Tensor] = {}
        self.last_nonfinite: list[tuple[int, str]] = []  # (rank, parameter) of the newest verify step

    # ------------------------------------------------------------------------ the schedule

    def request(self, step: int) -> None:
        """Verify ``step`` whatever the interval (memory snapshots ask for the steps they keep).
        Every rank must request the same steps.
        """
        self._forced.add(step)

    @property
    def verifying(self) -> bool:
        """This step is a verify step (checks on and due)."""
        return self._verifying

    def begin_step(self) -> None:
        """The step's first backward (or first bucket): decide, and hash the params as its
        forward saw them. Idempotent within a step.
        """
        if self._began:
            return
        self._began = True
        self._step_started = time.perf_counter()
        self._verifying = self.enabled and (self.step >= self._next or self.step in self._forced)
        if self._verifying:
            start = time.perf_counter()
            self._hashes = torch.stack([_hash(t).to(self.device) for _, t in self.tensors])
            self._spent += time.perf_counter() - start

    # ------------------------------------------------------------------------ reductions

    def after_pack(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """A bucket packed (1D, rank-major, pre-divided), before its collective."""
        self.begin_step()
        if self._verifying:
            start = time.perf_counter()
            record = self._local(bucket, flat)
            self._records.append(record)
            self._pending[bucket.index] = record
            self._spent += time.perf_counter() - start
        if faults.active():
            faults.transport(self.rank, self.step, bucket.index, flat)

    def after_reduce(self, bucket: Bucket, rows: torch.Tensor) -> None:
        """This rank's reduced rows of ``bucket``, right after its collective."""
        if faults.active():
            faults.reduced(self.rank, self.step, bucket.index, rows)
        record = self._pending.pop(bucket.index, None)
        if record is not None:
            start = time.perf_counter()
            offset = sum(bucket.chunks[: self.rank])  # where this rank's chunk sits in the packed bucket
            sums, _ = _segment_sums(rows, offset, self._ends(bucket, own=True), self._probes(bucket), record.seed)
            record.own = sums.flatten()
            self._spent += time.perf_counter() - start

    def _probes(self, bucket: Bucket) -> int:
        return 2 if (self.comm_dtype or bucket.dtype) == torch.float32 else 8

    def _lengths(self, bucket: Bucket) -> list[list[int]]:
        """Per rank (chunk), each param's piece length, in packing order."""
        return [[s.shard.piece_numel(r) for s in bucket.slots] for r in range(self.world_size)]

    def _local(self, bucket: Bucket, flat: torch.Tensor) -> _Record:
        probes = self._probes(bucket)
        seed = _seed(self.step, len(self._records))
        sums, norms = _segment_sums(flat, 0, self._ends(bucket, own=False), probes, seed, with_norms=True)
        return _Record(bucket, torch.cat([sums.flatten(), norms]), seed)

    def _ends(self, bucket: Bucket, own: bool) -> torch.Tensor:
        """Where each segment (param piece) ends: over the packed bucket (per destination rank, per
        param) or over this rank's chunk. Made once per bucket on the device: no copy from the
        host, so no wait for the device, on a verify step.
        """
        key = (bucket.index, own)
        if key not in self._segment_ends:
            lengths = self._lengths(bucket)
            flat = lengths[self.rank] if own else [n for per_rank in lengths for n in per_rank]
            self._segment_ends[key] = torch.tensor(flat, dtype=torch.int64).cumsum(0).to(self.device)
        return self._segment_ends[key]

    # ------------------------------------------------------------------------ the verdict

    def verify(self) -> Finding | None:
        """At the step, after every reduction: gather every rank's numbers and judge; raise
        ``IntegrityError`` (every rank at once) on a mismatch. None on a step that checks nothing.
        Once per step (a second call returns the first's finding).
        """
        if not self._verifying or self._finding is not None:
            return self._finding
        start = time.perf_counter()
        parts = [r.local for r in self._records] + [r.own for r in self._records if r.own is not None]
        parts += [self._hashes.view(torch.float64).flatten().to(self.device)]
        parts += [torch.full((1,), float(self._proposal()), dtype=torch.float64, device=self.device)]
        payload = torch.cat([p.to(self.device) for p in parts])
        gathered = torch.empty(self.world_size * payload.numel(), dtype=torch.float64, device=self.device)
        comm.all_gather(gathered, payload, self.group)
        self.bytes_gathered += gathered.numel() * 8
        table = gathered.view(self.world_size, -1).cpu()
        # A simulation on fake tensors (hf_lowzero.simulation) runs the checks' work and collective;
        # there is no data to judge.
        finding = self._finding = Finding(self.step) if is_fake(table) else self._judge(table)
        self.last_nonfinite = list(dict.fromkeys(finding.nonfinite))
        self.checks += 1
        self._spent += time.perf_counter() - start
        self.verify_seconds += self._spent
        proposals = table[:, -1]
        if self.every == VERIFY_AUTO and not is_fake(table):
            self.interval = int(min(MAX_INTERVAL, max(1, proposals.max().item())))
        self._next = self.step + self.interval
        if finding.mismatches:
            self.failures += 1
            raise IntegrityError(
                f"integrity check failed at step {finding.step}: " + "; ".join(_summary(finding)),
                finding.step,
                sorted(set(finding.ranks)),
                list(dict.fromkeys(finding.names)),
                finding.kinds[0],
            )
        if not finding.nonfinite:
            self.last_verified = self.step
        return finding

    def _proposal(self) -> int:
        """This rank's interval for "auto": checks within AUTO_OVERHEAD of the step time."""
        if self.every != VERIFY_AUTO or not self._step_seconds:
            return self.interval
        return math.ceil(self._spent / (AUTO_OVERHEAD * self._step_seconds))

    def end_step(self, skipped_nonfinite: bool) -> None:
        """After the step (applied or skipped). A skip that no check attributed makes the next
        step a verify step, so a recurring non-finite gradient gets its rank and parameter named.
        """
        now = time.perf_counter()
        if self._step_started is not None:
            seconds = now - self._step_started - self._spent
            self._step_seconds = seconds if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * seconds
        if skipped_nonfinite and not self._verifying and self.enabled:
            self._forced.add(self.step + 1)
        self._forced.discard(self.step)
        self.step += 1
        self.discard()

    def discard(self) -> None:
        """Forget this step's records (``zero_grad``: its gradients are gone); the step number
        and the schedule stay.
        """
        self._began = self._verifying = False
        self._hashes, self._records, self._pending, self._spent = None, [], {}, 0.0
        self._finding = None

    def nonfinite_text(self) -> str | None:
        """Where this step's non-finite gradients came from, if a check of this step named it."""
        finding = self._finding
        if finding is None or not finding.nonfinite:
            return None
        named = ", ".join(f"rank {r}: {n!r}" for r, n in dict.fromkeys(finding.nonfinite))
        return f"Non-finite local gradients at step {finding.step}: {named}."

    def _judge(self, table: torch.Tensor) -> Finding:
        finding = Finding(self.step)
        world, offset = self.world_size, 0
        sizes = []
        for record in self._records:
            m, p = len(record.bucket.slots), self._probes(record.bucket)
            sizes.append((record.bucket, m, p, offset))
            offset += world * m * p + world * m
        own_at = offset
        for bucket, m, p, start in sizes:
            dots = table[:, start : start + world * m * p].reshape(world, world, m, p)  # [src, dst, param, probe]
            norms = table[:, start + world * m * p : start + world * m * p + world * m].reshape(world, world, m)
            own = table[:, own_at : own_at + m * p].reshape(world, m, p)  # [owner, param, probe]
            own_at += m * p
            self._judge_bucket(finding, bucket, dots, norms, own)
        self._judge_replicas(finding, table[:, own_at:-1].contiguous())
        return finding

    def _judge_bucket(self, finding: Finding, bucket: Bucket, dots, norms, own) -> None:
        names = [self.names[id(s)] for s in bucket.slots]
        eps = torch.finfo(self.comm_dtype or bucket.dtype).eps / 2  # unit roundoff
        for j, name in enumerate(names):
            bad = [src for src in range(self.world_size) if not torch.isfinite(dots[src, :, j]).all()]
            if bad:
                finding.nonfinite += [(src, name) for src in bad]
                continue
            for owner in range(self.world_size):
                expected = dots[:, owner, j].sum(0)  # [probes]
                residual = own[owner, j] - expected
                scale = norms[:, owner, j].sum().item()
                bound = SIGMAS * (self.world_size - 1) * eps * scale
                bound += SLACK * (own[owner, j].abs().max().item() + dots[:, owner, j].abs().sum(0).max().item())
                if not torch.isfinite(residual).all() or residual.abs().max().item() > bound:
                    self._explain(finding, bucket, owner, j, name, residual, dots[:, owner, j], bound)

    def _explain(self, finding: Finding, bucket, owner: int, j: int, name: str, residual, sent, bound) -> None:
        """Name the rank whose contribution explains ``residual``, or the owner's rows."""
        what = None
        for src in range(self.world_size):
            if (residual + sent[src]).abs().max().item() <= 2 * bound:
                what, rank = f"rank {src}'s contribution was dropped", src
                break
            if (residual - sent[src]).abs().max().item() <= 2 * bound:
                what, rank = f"rank {src}'s contribution was doubled", src
                break
        if what is None:
            what, rank = f"rank {owner}'s reduced rows differ from the sum the ranks sent (corrupted)", owner
        finding.mismatches.append(
            f"bucket {bucket.index}, parameter {name!r} (rows of rank {owner}): {what}; residual "
            f"{residual.abs().max().item():.3g} against a bound of {bound:.3g}"
        )
        finding.groups.append((bucket.index, what))
        finding.ranks.append(rank)
        finding.names.append(name)
        finding.kinds.append("reduction")

    def _judge_replicas(self, finding: Finding, hashes: torch.Tensor) -> None:
        words = hashes.view(torch.int64).view(self.world_size, len(self.tensors), 2)
        for k, (name, _) in enumerate(self.tensors):
            values = [tuple(words[r, k].tolist()) for r in range(self.world_size)]
            if len(set(values)) == 1:
                continue
            counts = {v: values.count(v) for v in values}
            majority = max(counts.values())
            agreed = [v for v, c in counts.items() if c == majority]
            odd = [r for r, v in enumerate(values) if len(agreed) > 1 or v != agreed[0]]
            finding.mismatches.append(
                f"parameter {name!r} differs across replicas: rank(s) {odd} disagree with "
                + ("each other (no majority)" if len(agreed) > 1 else "the majority")
            )
            finding.groups.append(("replica", tuple(odd), len(agreed) > 1))
            finding.ranks += odd
            finding.names.append(name)
            finding.kinds.append("replica")


def _summary(finding: Finding) -> list[str]:
    """One entry per kind of mismatch (a bucket and what explains it, or the ranks a replica
    disagrees with): its first parameter in full, and how many more are alike (``.names`` has them all).
    """
    first: dict[tuple, str] = {}
    count: dict[tuple, int] = {}
    for group, text in zip(finding.groups, finding.mismatches):
        first.setdefault(group, text)
        count[group] = count.get(group, 0) + 1
    return [text + (f" (and {count[g] - 1} more alike)" if count[g] > 1 else "") for g, text in first.items()]


def _hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of ``t``'s bit patterns (words, squared words; wrapping), on its device, by
    windows (a 2 GiB embedding needs no 4 GiB of int64 scratch).
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for a in range(0, words.numel(), 4 * WINDOW):
        wide = words[a : a + 4 * WINDOW].to(torch.int64)
        total += torch.stack([wide.sum(), (wide * wide).sum()])
    return total


def _seed(step: int, reduction: int) -> int:
    return (step * 1_000_003 + reduction * 7919 + 12345) % (2**31)


WINDOW = 1 << 17  # elements processed at once: bounds the checks' scratch (~20 MiB at 8 probes), whatever the bucket


def _signs(positions: torch.Tensor, seed: int) -> torch.Tensor:
    """Random sign bits of packed ``positions`` (int64; bit p + 7: probe p's sign is +1), from
    ``seed``: a counter-based hash (splitmix64's finalizer) of the position, so any window of the
    bucket gets the same bits on every rank without a generator or a bucket-sized buffer.
    """
    x = positions + seed * 0x9E3779B9
    x = x * -7046029254386353131  # 0x9E3779B97F4A7C15 as an int64: wraps, as splitmix64 does
    x = x ^ (x >> 30)
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ (x >> 31)


def _segment_sums(values: torch.Tensor, offset: int, ends: torch.Tensor, probes: int, seed: int, with_norms=False):
    """Per segment (``values`` split at the positions ``ends``; ``values`` sits at packed position
    ``offset``): the dot with each probe's signs, ``[segments, probes]`` float64, and with
    ``with_norms`` the L2 norms. By windows of WINDOW elements, so the scratch stays small; each
    segment sums only its own elements (float64), so a small segment's error is its own.
    """
    device = values.device
    fake = is_fake(values)  # fake tensors (the plan, the GPU simulation) have no values to look at
    acc = torch.zeros(ends.numel(), probes + 1, dtype=torch.float64, device=device)
    for a in range(0, values.numel(), WINDOW):
        b = min(a + WINDOW, values.numel())
        wide = values[a:b].to(torch.float64)
        positions = torch.arange(a, b, dtype=torch.int64, device=device)
        bits = _signs(positions + offset, seed)
        first, last = (0, 1) if fake else torch.searchsorted(ends, positions[[0, -1]], right=True).tolist()
        if first == last:  # the window lies in one segment (most of a large param): plain dot products
            for p in range(probes):
                signs = ((bits >> (p + 7)) & 1).to(torch.float64).mul_(2).sub_(1)
                acc[first, p] += torch.dot(wide, signs)
            acc[first, probes] += torch.dot(wide, wide)
            continue
        columns = [torch.where((bits >> (p + 7)) & 1 == 1, wide, -wide) for p in range(probes)] + [wide * wide]
        acc.index_add_(0, torch.searchsorted(ends, positions, right=True), torch.stack(columns, dim=1))
    return acc[:, :probes], (acc[:, probes].clamp(min=0).sqrt() if with_norms else None)
