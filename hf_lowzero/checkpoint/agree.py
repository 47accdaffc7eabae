"""Every rank's verdict on a step of a checkpoint's save or load, exchanged so that all raise together.

Example::

    try:
        write_my_file()
        failure = None
    except Exception as e:  # any type
        failure = e
    agree(failure, "cannot save checkpoint ck", group, device, describe=repr)   # raises on every rank, or none

# [Note: ranks agree on failure]
# A save or a load is collective: a rank that raised alone would leave its peers waiting in the next
# collective until the process group's timeout (a full disk on one node, a permission denied on one
# rank's file, a damaged file only one rank reads). So at each collective point every rank hands in a
# verdict, the error it caught or None, and the verdicts are gathered: when any rank failed, every rank
# raises one ``CheckpointError`` naming each failed rank and its error. The exchange is itself the
# ranks' meeting point: it takes a barrier's place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from hf_lowzero.checkpoint.shards import CheckpointError
from hf_lowzero.zero.runtime import comm


def agree(
    failure: Exception | None,
    summary: str,
    group: ProcessGroup | None,
    device: torch.device | None,
    describe: Callable[[Exception], str],
    payload: Any = None,
) -> list:
    """Exchange this rank's verdict with every rank of ``group`` ([Note: ranks agree on failure]).

    Args:
        failure: The error this rank caught in the step, or None.
        summary: What failed, said first in the error: ``"cannot load checkpoint ck; nothing was changed"``.
        group: The process group whose ranks take part (all must call this).
        device: The params' device (NCCL's object collectives run on it).
        describe: A failure in words, as the error gives it for its rank.
        payload: A small picklable value to gather along with the verdict.

    Returns:
        Every rank's ``payload``, in rank order, when no rank failed.

    Raises:
        CheckpointError: On every rank, when any rank failed: ``"<summary>: rank 1: <its error>"``, the
            ranks with the same error named together; chained to this rank's own error, if any.
    """
    verdict = None if failure is None else describe(failure)
    gathered = comm.all_gather_object((verdict, payload), group, device)
    by_error: dict[str, list[int]] = {}
    for rank, (error, _) in enumerate(gathered):
        if error is not None:
            by_error.setdefault(error, []).append(rank)
    if by_error:
        parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {e}" for e, r in by_error.items()]
        raise CheckpointError(f"{summary}: " + " | ".join(parts)) from failure
    return [value for _, value in gathered]
