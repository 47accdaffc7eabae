"""Integrity checks while training: every replica identical, every reduction right.

``IntegrityChecker`` is called at points the step already has: the first backward of a step
(``begin_step``), each bucket packed (``after_pack``) and reduced (``after_reduce``), and the step
(``verify``, before the norm; or ``verify_launch`` and ``verify_judge`` around one copy to the host
that the step shares). On a verify step ([Note: integrity checks]) it costs one read of the params
and of the gradients on each side of every reduction, on the device, with no host sync in the
hooks, and one all-gather of a few numbers per parameter; on other steps nothing. The arithmetic
is in ``checksums.py``.

Example::

    opt = LowLevelZeroOptimizer(model, inner, verify_every=10, on_mismatch="raise")
    ...                                     # a mismatch raises IntegrityError on every rank at once
    opt.integrity.checks, opt.integrity.failures

# [Note: integrity checks]
# The step is exact: after the all-gather every rank holds bit-identical params, and a reduction
# is a sum. Both can be checked exactly and cheaply.
# - Replicas. On a verify step each rank hashes every parameter (trainable and frozen) and
#   persistent buffer at the step, before the update, once every all-gather has landed ([Note:
#   overlapped all-gather] in update/allgather.py): the values this step's forward read, or had to read if
#   it read them at all. Two wrapping int64 sums of its bit patterns,
#   of the words and of the words weighted by position (``checksums.tensor_hash``; small tensors are
#   hashed with the others of their length at once). Any flipped bit changes the first; changes that
#   cancel in it, or words swapped, change the second. The ranks
#   compare the hashes; a parameter whose hash differs names the ranks that disagree with the
#   majority (with two ranks, both).
# - Reductions. For every bucket reduced on a verify step each rank takes, per destination rank
#   and parameter (a segment), the dot products of its packed gradients (divided by W, here or by the
#   collective: [Note: the divide in the collective] in runtime/comm.py) with P
#   vectors of random signs (+1/-1) that all ranks share, and their L2 norm; after the collective
#   the owner takes the same dot products of its reduced rows ([Note: segment checksums] in
#   checksums.py: how the signs are laid out and the dots computed). Summation is linear: the
#   owner's dot must equal the sum of the ranks' dots, up to the rounding of the reduction. That
#   rounding error e, whatever it is, does not depend on the signs v (the checks never change what
#   training computes), so sum(e_i v_i) is a sum of independent terms of random sign: by Hoeffding's
#   inequality it exceeds SIGMAS = 8 times sqrt(sum e_i^2) with probability below 2 exp(-32)
#   (1e-14) per probe. Each |e_i| <= gamma_{W-1} sum_src |g_src,i| (gamma_k = k u / (1 - k u), u the
#   communication dtype's unit roundoff, any order of summation), so sqrt(sum e_i^2) <= gamma_{W-1}
#   sum_src ||g_src||; a segment longer than the sign table's period repeats its signs, which costs
#   a factor sqrt(m) (m: the periods it touches). The bound is
#       sum_src ||g_src|| * (SIGMAS gamma_{W-1} sqrt(m) + 3 (m + min(n, PERIOD) + W) u64 sqrt(n))
#   where the second term covers the checks' own float64 arithmetic over the segment's n elements
#   (``checksums.bound_factors``). A dropped or doubled contribution moves the dot by that rank's
#   own dot, of standard deviation ||g_src||: far outside the bound in fp32; with bf16 reductions
#   the bound is wider (u = 2^-8), so 16-bit reductions use 8 probes instead of 2. The residual
#   against each rank's dots names the rank whose contribution explains it (dropped: -its dot,
#   doubled: +its dot); one no rank explains is corruption of the owner's rows.
# - Exact reductions (``reduction="exact"``: int64 sums) are checked by int64 checksums instead,
#   compared without any bound ([Note: exact checksums] in exact_sums.py).
# - Non-finite local gradients show as non-finite dots: they name their rank and parameter before
#   the reduction mixes them into every rank's rows (the step is then skipped, as always).
# - No host sync in the hooks: what the host needs is planned when the checker is made, and the
#   numbers stay on the device until the one copy of the gathered table (``verify``, or the step's own
#   copy between ``verify_launch`` and ``verify_judge``).
# Every rank gathers every rank's numbers and judges the same way, so all raise together, before the
# update (and before any checkpoint or snapshot of that state). What it cannot see: a gradient
# computed wrong but consistently on one rank (its dot agrees with what it sent), and masters
# corrupted on their owner (every rank then gathers the same wrong params); those need a replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from hf_lowzero.zero.auto_interval import AutoInterval
from hf_lowzero.zero.integrity import reduction_faults as faults
from hf_lowzero.zero.integrity.checksums import (
    PERIOD,
    SCRATCH,
    ReplicaHashes,
    SegmentPlan,
    bound_factors,
    bucket_plans,
    hash_weights,
    sign_table,
)
from hf_lowzero.zero.integrity.exact_sums import PROBES, SumPlan, exact_plans
from hf_lowzero.zero.integrity.verdict import Finding, Judged, judge, summary
from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.params import canonical_name
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.zero_config import VERIFY, VERIFY_AUTO, VERIFY_OFF, check_verify_every

SIGMAS = 8.0  # [Note: integrity checks]: the bound's standard deviations


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


def hashed_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What the replica check compares ([Note: integrity checks]): every parameter, trainable and
    frozen (tied ones once), and every persistent buffer, by name.

    Args:
        model: The model.

    Returns:
        ``(name, tensor)`` pairs, by canonical (uncompiled) name.
    """
    tensors = [(canonical_name(n), p) for n, p in model.named_parameters()]
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                tensors.append((canonical_name(f"{module_name}.{name}" if module_name else name), buffer))
    return tensors


@dataclass
class _Record:
    """One bucket's reduction on a verify step: this rank's numbers for it."""

    bucket: Bucket
    local: torch.Tensor  # [W * m * P + W * m] float64: dots per (destination, param, probe), norms
    shift: int  # where the signs start (the step and the reduction's place in it: the same on every rank)
    own: torch.Tensor | None = None  # [m * P] float64: dots of the reduced rows
    # exact: [W * m * P] and [m * P] int64 checksums, as float64 words ([Note: exact checksums])


@dataclass(frozen=True, eq=False)
class _BucketChecks:
    """What a bucket's checks need, made once: its plans, and what judging it needs."""

    local: SegmentPlan | SumPlan  # the packed bucket (SumPlan: an exact reduction's int64)
    own: SegmentPlan | SumPlan  # this rank's reduced chunk
    judged: Judged


class IntegrityChecker:
    """See the module docstring. ``tensors``: what the replica check hashes, ``(name, tensor)``:
    every param and persistent buffer (``hashed_tensors``). A ``ReductionTap`` of the reducer
    (``after_pack``, ``after_reduce``). ``exact``: the reductions are ``reduction="exact"``'s int64
    sums, checked by exact checksums ([Note: exact checksums] in ``exact_sums.py``).
    """

    def __init__(
        self,
        buckets: list[Bucket],
        tensors: list[tuple[str, torch.Tensor]],
        *,
        comm_dtype: torch.dtype | None,
        every: int | str,
        on_mismatch: str,
        shard: ShardGroup,
        exact: bool = False,
    ) -> None:
        self.buckets = buckets
        self.comm_dtype = comm_dtype
        self.exact = exact
        self.shard = shard
        self.every = check_verify_every(every)
        self.on_mismatch = on_mismatch
        self.enabled = self.every != VERIFY_OFF and shard.world_size > 1
        self.schedule = AutoInterval(self.every, VERIFY)  # "auto": within VERIFY's budget
        self.step = 1  # the step being taken (the Trainer sets its own numbering)
        self.last_verified = 0  # the newest step whose checks all passed
        self.checks = 0
        self.failures = 0
        self.verify_seconds = 0.0
        self.bytes_gathered = 0
        self.tensors = tensors
        self._forced: set[int] = set()
        self._verifying = False
        self._began = False
        self._hashes: list[torch.Tensor] = []
        self._records: list[_Record] = []
        self._pending: dict[int, _Record] = {}
        self._gathered: torch.Tensor | None = None
        self._spent = 0.0  # seconds of checks in this step
        self._step_started: float | None = None
        self._finding: Finding | None = None
        self.last_nonfinite: list[tuple[int, str]] = []  # (rank, parameter) of the newest verify step
        if self.enabled:  # everything the hooks need, made here: they read nothing back from the device
            self._checks = [self._bucket_checks(bucket) for bucket in buckets]
            if exact:
                self._weights = hash_weights(shard.device)
            else:
                self._signs = sign_table(max((c.judged.probes for c in self._checks), default=2), shard.device)
                self._scratch = torch.empty(SCRATCH, dtype=torch.float64, device=shard.device)
            self._replicas = ReplicaHashes(tensors)

    def _bucket_checks(self, bucket: Bucket) -> _BucketChecks:
        names = tuple(s.name for s in bucket.slots)
        if self.exact:
            local, own = exact_plans(bucket, shard=self.shard)
            return _BucketChecks(local, own, Judged(bucket.index, names, PROBES, None, exact=True))
        dtype = self.comm_dtype or bucket.dtype
        local, own = bucket_plans(bucket, shard=self.shard)
        factors = bound_factors(
            bucket, world_size=self.shard.world_size, unit_roundoff=torch.finfo(dtype).eps / 2, sigmas=SIGMAS
        )
        return _BucketChecks(local, own, Judged(bucket.index, names, 2 if dtype == torch.float32 else 8, factors))

    # ------------------------------------------------------------------------ the schedule

    def request(self, step: int) -> None:
        """Verify ``step`` whatever the interval (memory snapshots ask for the steps they keep).
        Every rank must request the same steps.
        """
        self._forced.add(step)

    @property
    def interval(self) -> int:
        """The steps between verify steps (for "auto", the ranks' latest agreement)."""
        return self.schedule.interval

    @property
    def verifying(self) -> bool:
        """This step is a verify step (checks on and due)."""
        return self._verifying

    def begin_step(self) -> None:
        """The step's first backward (or first bucket): decide whether it is a verify step.
        Idempotent within a step.
        """
        if self._began:
            return
        self._began = True
        self._step_started = time.perf_counter()
        self._verifying = self.enabled and (self.schedule.due(self.step) or self.step in self._forced)

    # ------------------------------------------------------------------------ reductions

    def after_pack(self, bucket: Bucket, flat: torch.Tensor, divided: bool = True) -> None:
        """A bucket packed (1D, rank-major), before its collective; ``divided``: by W already, or
        (False) the collective divides ([Note: the divide in the collective] in ``runtime/comm.py``).
        """
        self.begin_step()
        if self._verifying:
            start = time.perf_counter()
            checks = self._checks[bucket.index]
            shift = _shift(self.step, len(self._records))
            if self.exact:  # int64 words carried as float64 through the gather, compared bit for bit
                local = checks.local.checksums(flat, self._weights).view(torch.float64).flatten()
            else:
                dots, norms = checks.local.sums(flat, self._signs, checks.judged.probes, shift, self._scratch)
                local = torch.cat([dots.flatten(), norms])
                if not divided:  # W is a power of two there: exact in float64, as the collective's scaling is
                    local.mul_(1.0 / self.shard.world_size)
            record = _Record(bucket, local, shift)
            self._records.append(record)
            self._pending[bucket.index] = record
            self._spent += time.perf_counter() - start
        if faults.active():
            faults.transport(flat, rank=self.shard.rank, step=self.step, bucket=bucket.index)

    def after_reduce(self, bucket: Bucket, rows: torch.Tensor) -> None:
        """This rank's reduced rows of ``bucket``, right after its collective."""
        if faults.active():
            faults.reduced(rows, rank=self.shard.rank, step=self.step, bucket=bucket.index)
        record = self._pending.pop(bucket.index, None)
        if record is not None:
            start = time.perf_counter()
            checks = self._checks[bucket.index]
            if self.exact:
                record.own = checks.own.checksums(rows, self._weights).view(torch.float64).flatten()
            else:
                probes = checks.judged.probes
                dots, _ = checks.own.sums(rows, self._signs, probes, record.shift, self._scratch, norms=False)
                record.own = dots.flatten()
            self._spent += time.perf_counter() - start

    # ------------------------------------------------------------------------ the verdict

    def verify(self) -> Finding | None:
        """At the step, after every reduction: gather every rank's numbers and judge; raise
        ``IntegrityError`` (every rank at once) on a mismatch. None on a step that checks nothing.
        Once per step (a second call returns the first's finding). ``verify_launch``, one copy of
        its table to the host, then ``verify_judge``.
        """
        gathered = self.verify_launch()
        if gathered is None:
            return self._finding
        start = time.perf_counter()
        table = gathered.cpu()
        self._spent += time.perf_counter() - start
        return self.verify_judge(table)

    def verify_launch(self) -> torch.Tensor | None:
        """The first half of ``verify``: start the all-gather of this rank's numbers, on the device.

        Returns:
            ``[world_size, n]`` float64 on the device, every rank's numbers, to copy to the host
            (with whatever else the step copies) and pass to ``verify_judge``; the same tensor if
            called again before that. None on a step that checks nothing or was judged already.
        """
        if not self._verifying or self._finding is not None:
            return None
        if self._gathered is None:
            start = time.perf_counter()
            payload = self.payload()
            world_size = self.shard.world_size
            gathered = torch.empty(world_size * payload.numel(), dtype=torch.float64, device=self.shard.device)
            comm.all_gather(gathered, payload, self.shard.group)
            self.bytes_gathered += gathered.numel() * 8
            self._gathered = gathered.view(world_size, -1)
            self._spent += time.perf_counter() - start
        return self._gathered

    def payload(self) -> torch.Tensor:
        """This rank's numbers of this verify step (what ``verify_launch`` all-gathers).

        Returns:
            1D float64 on the device: per reduced bucket its dots per destination, param and probe
            and their norms; then per bucket the owner's dots; the hashes; its interval for "auto".
        """
        if not self._hashes:
            self._hashes = self._replicas.compute()  # per device (a buffer may live elsewhere)
        parts = [r.local for r in self._records] + [r.own for r in self._records if r.own is not None]
        parts += [h.to(self.shard.device).view(torch.float64).flatten() for h in self._hashes]
        self.schedule.add_cost(self._spent)
        parts += [
            torch.full((1,), float(self.schedule.proposed_interval()), dtype=torch.float64, device=self.shard.device)
        ]
        return torch.cat(parts)

    def verify_judge(self, table: torch.Tensor) -> Finding | None:
        """The second half of ``verify``: judge ``table`` (``verify_launch``'s tensor, on the host).

        Returns:
            What the checks found; None on a step that checks nothing. Once per step: later calls
            return the first's finding.

        Raises:
            IntegrityError: A replica or reduction check failed (on every rank at once).
            ValueError: ``table`` is not shaped as ``verify_launch``'s tensor.
        """
        if not self._verifying or self._finding is not None:
            return self._finding
        numbers = sum(r.local.numel() + (0 if r.own is None else r.own.numel()) for r in self._records)
        expected = (self.shard.world_size, numbers + 2 * len(self._replicas.names) + 1)
        if tuple(table.shape) != expected:
            raise ValueError(
                f"verify_judge expects verify_launch()'s table on the host, of shape {expected}; got "
                f"{tuple(table.shape)}: pass it as it came (after .cpu()), with nothing appended"
            )
        start = time.perf_counter()
        # A simulation on fake tensors (hf_lowzero.simulation) runs the checks' work and collective;
        # there is no data to judge.
        judged = [self._checks[r.bucket.index].judged for r in self._records]
        names = self._replicas.names
        fake = is_fake(table)
        if fake:
            finding = Finding(self.step)
        else:
            finding = judge(table, self.step, world_size=self.shard.world_size, buckets=judged, tensor_names=names)
        self._finding = finding
        self.last_nonfinite = list(dict.fromkeys(finding.nonfinite))
        self.checks += 1
        self._spent += time.perf_counter() - start
        self.verify_seconds += self._spent
        auto = self.every == VERIFY_AUTO and not fake
        self.schedule.taken(self.step, self.schedule.agreed(table[:, -1].tolist()) if auto else self.interval)
        if finding.mismatches:
            self.failures += 1
            raise IntegrityError(
                f"integrity check failed at step {finding.step}: " + "; ".join(summary(finding)),
                finding.step,
                sorted(set(finding.ranks)),
                list(dict.fromkeys(finding.names)),
                finding.kinds[0],
            )
        if not finding.nonfinite:
            self.last_verified = self.step
        return finding

    def end_step(self, skipped_nonfinite: bool) -> None:
        """After the step (applied or skipped). A skip that no check attributed makes the next
        step a verify step, so a recurring non-finite gradient gets its rank and parameter named.
        """
        now = time.perf_counter()
        if self._step_started is not None:
            self.schedule.add_step(now - self._step_started - self._spent)
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
        self._hashes, self._records, self._pending, self._spent = [], [], {}, 0.0
        self._gathered = self._finding = None

    def nonfinite_text(self) -> str | None:
        """Where this step's non-finite gradients came from, if a check of this step named it."""
        finding = self._finding
        if finding is None or not finding.nonfinite:
            return None
        named = ", ".join(f"rank {r}: {n!r}" for r, n in dict.fromkeys(finding.nonfinite))
        return f"Non-finite local gradients at step {finding.step}: {named}."


def _shift(step: int, reduction: int) -> int:
    """Where a reduction's signs start in the table: from the step and its place in it (a hash)."""
    return (step * 1_000_003 + reduction * 7919 + 12345) % (2**31) * 40503 % PERIOD
