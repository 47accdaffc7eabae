"""Resuming from the newest complete state, in memory or in storage (``resume_checkpoint()``).

Every rank asks the same question at the start of an attempt: is there a complete memory snapshot
([Note: complete snapshot] in ``hf_lowzero/snapshot/protocol.py``) newer than the checkpoint Ray hands this attempt? The
first rank asks the run's surviving holders, decides, and tells every rank which pieces to fetch
from which holder: its own node's when it holds them (a killed process), else a buddy's on another
node (a killed node; a replacement worker on a fresh node fetches over the network). Each node then
writes one Trainer ``checkpoint-N`` folder from the pieces, which ``trainer.train(resume_from_checkpoint=...)``
loads like any checkpoint, resharded when the world size changed (an elastic resize).

Example (inside a Ray Train worker)::

    source = newest_state(storage_folder)    # collective
    source.kind, source.step, source.folder  # ("memory", 15, "/tmp/.../checkpoint-15")
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch.distributed as dist

from hf_lowzero.checkpoint.layout import TRAINER_SUBDIR
from hf_lowzero.ray.holder_lifetime import NAMESPACE, current_run, run_holders
from hf_lowzero.snapshot.checkpoint_files import write_part, write_zero_metadata
from hf_lowzero.snapshot.checks import safetensors_error
from hf_lowzero.snapshot.frame import Manifest
from hf_lowzero.snapshot.protocol import HolderIndex, run_marks
from hf_lowzero.trainer.snapshot_files import write_trainer_files

logger = logging.getLogger(__name__)
_CHECKPOINT_STEP = re.compile(r"checkpoint-(\d+)$")
_last: ResumeSource | None = None


@dataclass
class ResumeSource:
    """Where this attempt resumes: ``kind`` "memory", "storage" or "none" (a fresh start), the step,
    the newest storage checkpoint's step, the folder to pass to ``Trainer.train``, and why memory was
    not used when a snapshot existed."""

    kind: str
    step: int
    storage_step: int
    folder: str | None
    reason: str | None = None
    remote_pieces: int = 0  # pieces fetched from a holder on another node than the reading rank's
    started_at: float = 0.0  # time.time() when resume_checkpoint() began

    def metrics(self) -> dict[str, Any]:
        """What the reports of this attempt carry (Ray's metrics)."""
        return {
            "resumed_from": self.kind,
            "newest_storage_step": self.storage_step,
            "memory_pieces_from_other_nodes": self.remote_pieces,
            "memory_not_used": self.reason or "",
        }


@dataclass
class _Plan:
    step: int
    saved_world_size: int
    folder: str
    manifests: dict[int, Manifest]
    fetch: dict[int, list[tuple[int, str, str]]] = field(default_factory=dict)  # rank -> [(rank, part, holder)]
    leaders: list[int] = field(default_factory=list)  # the ranks that write each node's common files
    remote_pieces: int = 0


def last_resume() -> ResumeSource | None:
    """What ``resume_checkpoint()`` decided in this process, or None if it was not called."""
    return _last


def newest_state(storage_folder: str | None) -> ResumeSource:
    """The newer of the newest complete memory snapshot and ``storage_folder`` (collective)."""
    global _last
    started_at = time.time()
    storage_step = step_of(storage_folder) if storage_folder else 0
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nodes: list[str] = [None] * world_size  # type: ignore[list-item]
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    decision: list[Any] = [None]
    if rank == 0:
        decision = [_decide(storage_step, nodes)]
    dist.broadcast_object_list(decision, src=0)
    plan, reason = decision[0]
    if plan is not None:
        error = _materialize(plan, rank)
        errors: list[str | None] = [None] * world_size
        dist.all_gather_object(errors, error)  # every node's folder is complete, or all ranks go to storage
        errors = [e for e in errors if e is not None]
        if errors:
            shutil.rmtree(plan.folder, ignore_errors=True)
            reason = f"the memory snapshot of step {plan.step} is damaged ({errors[0]}); resuming from storage"
            plan = None
    if plan is None:
        kind = "storage" if storage_folder else "none"
        _last = ResumeSource(kind, storage_step, storage_step, storage_folder, reason, started_at=started_at)
        if reason and rank == 0:
            logger.warning("[hf_lowzero] %s", reason)
        return _last
    folder = str(Path(plan.folder) / f"checkpoint-{plan.step}")
    _last = ResumeSource(
        "memory", plan.step, storage_step, folder, remote_pieces=plan.remote_pieces, started_at=started_at
    )
    return _last


def step_of(folder: str | Path) -> int:
    match = _CHECKPOINT_STEP.search(str(Path(folder)))
    return int(match.group(1)) if match else 0


def discard(source: ResumeSource | None) -> None:
    """Remove the folder a memory resume wrote (once the Trainer has loaded it)."""
    if source is not None and source.kind == "memory" and source.folder:
        shutil.rmtree(Path(source.folder).parent, ignore_errors=True)


def _decide(storage_step: int, nodes: list[str]) -> tuple[_Plan | None, str | None]:
    """Rank 0: the plan to resume from memory, or None and why not."""
    holders = run_holders(current_run().run_id)
    indexes: dict[str, HolderIndex] = {}
    for name, handle in holders.items():
        try:
            indexes[name] = ray.get(handle.index.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # its node is gone
    marks = run_marks(indexes.values())
    restorable = [s for s, m in marks.items() if m.restorable]  # [Note: complete snapshot] in protocol.py
    if not restorable:
        return None, None
    step = max(restorable)
    if step <= storage_step:
        return None, None
    saved_world = marks[step].world_size
    held = {r: [name for name, index in indexes.items() if r in index.pieces(step)] for r in range(saved_world)}
    lost = [r for r, names in held.items() if not names]
    if lost:
        return None, (
            f"the memory snapshot of step {step} lost the shards of ranks {lost} (their node and its buddy node "
            f"are both gone); resuming from storage, step {storage_step}"
        )
    node_of_holder = {name: index.node_id for name, index in indexes.items()}
    try:
        manifests = {r: ray.get(holders[held[r][0]].manifest.remote(step, r)) for r in range(saved_world)}
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:  # a piece's details, or its holder
        cause = getattr(e, "cause", None) or e
        why = f"the memory snapshot of step {step} could not be read ({cause})"
        return None, f"{why}; resuming from storage, step {storage_step}"
    plan = _Plan(step, saved_world, tempfile.mkdtemp(prefix=f"hf_lowzero_memory_step{step}_"), manifests)
    first_on_node: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first_on_node.setdefault(node, rank)
    plan.leaders = sorted(first_on_node.values())
    for rank, node in enumerate(nodes):
        on_node = [r for r, n in enumerate(nodes) if n == node]
        if len(nodes) == saved_world:
            pieces = [rank]  # same world size: each rank reads its own rows only
        else:  # a resize: a rank's new rows may overlap any saved rank's; the node's ranks share the fetching
            pieces = [j for j in range(saved_world) if j % len(on_node) == on_node.index(rank)]
        plan.fetch[rank] = [(j, "shard", _nearest(held[j], node, node_of_holder)) for j in pieces]
        if rank in plan.leaders and "extras" in manifests[0].frame.parts:  # rank 0's buffers, once per node
            plan.fetch[rank].append((0, "extras", _nearest(held[0], node, node_of_holder)))
    plan.remote_pieces = sum(
        node_of_holder[name] != nodes[rank] for rank, fetches in plan.fetch.items() for _, _, name in fetches
    )
    return plan, None


def _nearest(names: list[str], node: str, node_of_holder: dict[str, str]) -> str:
    """A holder on ``node`` if one holds the piece, else the first other."""
    return next((n for n in names if node_of_holder[n] == node), names[0])


def _materialize(plan: _Plan, rank: int) -> str | None:
    """Fetch this rank's parts, check every checksum, and write its share of its node's checkpoint
    folder; returns what was wrong instead, or None."""
    checkpoint = Path(plan.folder) / f"checkpoint-{plan.step}"
    zero_dir = checkpoint / TRAINER_SUBDIR
    fetches = plan.fetch[rank]
    try:
        handles = {name: ray.get_actor(name, namespace=NAMESPACE) for _, _, name in fetches}
        blobs = ray.get([handles[name].part.remote(plan.step, j, part) for j, part, name in fetches])
    except (ValueError, ray.exceptions.RayActorError) as e:  # its holder went away since rank 0 asked
        return f"a holder of rank {rank}'s pieces is gone: {e}"
    for (j, part, name), data in zip(fetches, blobs):
        error = safetensors_error(data)
        if error is not None:
            return f"part {part!r} of rank {j} held by {name}: {error}"
    for (j, part, _), data in zip(fetches, blobs):
        write_part(zero_dir, plan.manifests[j].frame, part, data)
    leader = rank in plan.leaders
    if leader:
        write_zero_metadata(zero_dir, plan.manifests)
    rng_ranks = [j for j, part, _ in fetches if part == "shard"]
    as_json = {j: manifest.as_json() for j, manifest in plan.manifests.items()}  # what trainer/ reads
    write_trainer_files(checkpoint, as_json, rng_ranks, common=leader)
    return None
