"""Judging a verify step ([Note: integrity checks] in ``checker.py``): every rank's numbers, gathered
into one table on the host, compared; what disagrees is named, with the rank that explains it.

Every (owner, parameter) of every bucket is compared at once; only a failure is looked at on its own,
so a model of thousands of tensors costs a few tensor operations per bucket, not a loop per tensor.

Example::

    finding = judge(table, step=7, world_size=2, buckets=judged, tensor_names=names)
    finding.mismatches, finding.nonfinite    # summary(finding): one line per kind of mismatch
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass(frozen=True, eq=False)
class Judged:
    """What judging one reduced bucket needs: its index, param names (packing order), probes, and
    per owner and param the factor of the sources' summed L2 norms that bounds the residual
    (``checksums.bound_factors``); with ``exact`` (int64 checksums: [Note: exact checksums] in
    ``exact_sums.py``) no norms and no bound: the residual must be zero."""

    index: int
    names: tuple[str, ...]
    probes: int
    factors: torch.Tensor | None  # [W, m] float64, on the host; None with exact
    exact: bool = False


def judge(
    table: torch.Tensor, step: int, *, world_size: int, buckets: list[Judged], tensor_names: list[str]
) -> Finding:
    """Judge a verify step's ``table`` (``[W, n]`` float64 on the host: each rank's row is, per
    reduced bucket in ``buckets``' order, its dots per destination, param and probe and their norms
    (exact: its int64 checksums per destination, param and probe, as float64 words); then per bucket
    the owner's dots (or checksums); then two int64 words per hashed tensor; then one number).
    """
    finding = Finding(step)
    world, offset = world_size, 0
    sizes = []
    for bucket in buckets:
        m, p = len(bucket.names), bucket.probes
        sizes.append((bucket, m, p, offset))
        offset += world * m * p + (0 if bucket.exact else world * m)
    own_at = offset
    for bucket, m, p, start in sizes:
        dots = table[:, start : start + world * m * p].reshape(world, world, m, p)  # [src, dst, param, probe]
        own = table[:, own_at : own_at + m * p].reshape(world, m, p)  # [owner, param, probe]
        own_at += m * p
        if bucket.exact:
            _judge_exact(finding, bucket, _words(dots), _words(own))
            continue
        norms = table[:, start + world * m * p : start + world * m * p + world * m].reshape(world, world, m)
        _judge_bucket(finding, bucket, dots, norms, own)
    _judge_replicas(finding, table[:, own_at:-1].contiguous(), tensor_names)
    return finding


def _judge_bucket(finding: Finding, bucket: Judged, dots, norms, own) -> None:
    finite = torch.isfinite(dots).all(3).all(1)  # [src, param]
    for j, src in (~finite).T.nonzero().tolist():
        finding.nonfinite.append((src, bucket.names[j]))
    residual = own - dots.sum(0)  # [owner, param, probe]
    bound = norms.sum(0) * bucket.factors  # [owner, param]
    failed = ~torch.isfinite(residual).all(2) | (residual.abs().amax(2) > bound)
    failed &= finite.all(0)  # a param with a non-finite source is named as such, not judged
    for j, owner in failed.T.nonzero().tolist():
        _explain(finding, bucket, owner, j, residual[owner, j], dots[:, owner, j], bound[owner, j].item())


def _words(numbers: torch.Tensor) -> torch.Tensor:
    """Float64 words of the table that hold int64 checksums, as those."""
    return numbers.contiguous().view(torch.int64)


def _judge_exact(finding: Finding, bucket: Judged, sent, own) -> None:
    """[Note: exact checksums]: the owner's checksums must equal the sum of the sources', bit for bit
    (``sent``: ``[src, dst, param, probe]``, ``own``: ``[owner, param, probe]``, int64, wrapping)."""
    residual = own - sent.sum(0)  # [owner, param, probe]
    for j, owner in (residual != 0).any(2).T.nonzero().tolist():
        _explain(finding, bucket, owner, j, residual[owner, j], sent[:, owner, j], None)


def _explain(finding: Finding, bucket: Judged, owner: int, j: int, residual, sent, bound: float | None) -> None:
    """Name the rank whose contribution explains ``residual``, or the owner's rows; ``bound``: the
    float bound, or None where the residual must be exactly zero ([Note: exact checksums])."""

    def explained(difference: torch.Tensor) -> bool:
        return bool((difference == 0).all()) if bound is None else difference.abs().max().item() <= 2 * bound

    what = None
    for src in range(sent.shape[0]):
        if explained(residual + sent[src]):
            what, rank = f"rank {src}'s contribution was dropped", src
            break
        if explained(residual - sent[src]):
            what, rank = f"rank {src}'s contribution was doubled", src
            break
    if what is None:
        what, rank = f"rank {owner}'s reduced rows differ from the sum the ranks sent (corrupted)", owner
    if bound is None:
        size = f"int64 checksums off by {residual.tolist()} (exact: no tolerance)"
    else:
        size = f"residual {residual.abs().max().item():.3g} against a bound of {bound:.3g}"
    finding.mismatches.append(
        f"bucket {bucket.index}, parameter {bucket.names[j]!r} (rows of rank {owner}): {what}; {size}"
    )
    finding.groups.append((bucket.index, what))
    finding.ranks.append(rank)
    finding.names.append(bucket.names[j])
    finding.kinds.append("reduction")


def _judge_replicas(finding: Finding, hashes: torch.Tensor, names: list[str]) -> None:
    world = hashes.shape[0]
    words = hashes.view(torch.int64).view(world, len(names), 2)
    for k in (words != words[0]).any(2).any(0).nonzero().flatten().tolist():
        values = [tuple(words[r, k].tolist()) for r in range(world)]
        counts = {v: values.count(v) for v in values}
        majority = max(counts.values())
        agreed = [v for v, c in counts.items() if c == majority]
        odd = [r for r, v in enumerate(values) if len(agreed) > 1 or v != agreed[0]]
        finding.mismatches.append(
            f"parameter {names[k]!r} differs across replicas: rank(s) {odd} disagree with "
            + ("each other (no majority)" if len(agreed) > 1 else "the majority")
        )
        finding.groups.append(("replica", tuple(odd), len(agreed) > 1))
        finding.ranks += odd
        finding.names.append(names[k])
        finding.kinds.append("replica")


def summary(finding: Finding) -> list[str]:
    """One entry per kind of mismatch (a bucket and what explains it, or the ranks a replica
    disagrees with): its first parameter in full, and how many more are alike (``.names`` has them all).
    """
    first: dict[tuple, str] = {}
    count: dict[tuple, int] = {}
    for group, text in zip(finding.groups, finding.mismatches):
        first.setdefault(group, text)
        count[group] = count.get(group, 0) + 1
    return [text + (f" (and {count[g] - 1} more alike)" if count[g] > 1 else "") for g, text in first.items()]
