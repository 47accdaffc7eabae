"""Integrity failures on Ray: rollback to a verified snapshot, and a fault that repeats on one node.

``prepare_trainer`` wraps the Trainer's ``train`` with ``guard_train``; nothing else changes in the
training function. What the checks are: [Note: integrity checks] in ``hf_lowzero/zero/integrity/checker.py``.

Example (inside a Ray Train training function)::

    trainer = prepare_trainer(LowZeroTrainer(model=model, args=args, train_dataset=ds))  # guards train()
    trainer.train(resume_from_checkpoint=resume_checkpoint())

# [Note: rollback]
# A failed check raises ``IntegrityError`` on every rank before the step's update, so no checkpoint
# or snapshot holds that state. Every rank's node is then recorded in the run's storage folder
# (``hf_lowzero_integrity/``), and the error ends the attempt. With ``on_mismatch="rollback"`` the
# first rank's one console line says so, and Ray prints no traceback ([Note: designed events] in
# ``events.py``); Ray restarts the worker group and ``resume_checkpoint()`` takes the newest memory
# snapshot taken at a verified step (snapshots of steps whose checks did not pass are never
# restored, and with rollback memory snapshots request a check of every step they are taken at:
# [Note: verified snapshots] in ``snapshots.py``), so a transient fault costs the steps since that
# snapshot and the run ends as it would have without it. With ``"raise"`` the console
# says the run stops; Ray's ``FailureConfig`` still decides whether it restarts. A fault that a
# second failure names on the same node again is not transient: the error then names the rank and
# the node (kind ``"repeated"``), and every later attempt that would run on that node fails at once
# with it, until the node is left out (drain it, or let the autoscaler replace it).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import pyarrow.fs
import ray
import ray.train
import torch.distributed as dist

from hf_lowzero.ray.events import designed
from hf_lowzero.zero.integrity.checker import IntegrityError

FAILURES_DIR = "hf_lowzero_integrity"
logger = logging.getLogger(__name__)


def guard_train(trainer) -> None:
    """Wrap ``trainer.train`` ([Note: rollback]); called by ``prepare_trainer``."""
    original = trainer.train

    def train(*args, **kwargs):
        nodes = _nodes()
        _refuse_excluded_nodes(nodes)
        try:
            return original(*args, **kwargs)
        except IntegrityError as error:
            raise _after_failure(trainer, error, nodes) from error

    trainer.train = train


def failures() -> list[dict[str, Any]]:
    """This run's recorded integrity failures, oldest first (every attempt's)."""
    fs, folder = _folder()
    infos = fs.get_file_info(pyarrow.fs.FileSelector(folder, allow_not_found=True))
    records = []
    for info in sorted(infos, key=lambda i: i.base_name):
        if info.base_name.startswith("failure-"):
            with fs.open_input_stream(info.path) as f:
                records.append(json.loads(f.read().decode()))
    return records


def rollback_metrics(resumed_step: int) -> dict[str, Any]:
    """What the reports of an attempt carry: ``integrity_failures`` (the run's so far) and
    ``rolled_back_to`` (the step this attempt resumed at, when the run's newest failure came after
    it: the attempt replays from there; 0 otherwise)."""
    records = failures()
    rolled = resumed_step if records and records[-1]["step"] > resumed_step else 0
    return {"integrity_failures": len(records), "rolled_back_to": rolled}


def _after_failure(trainer, error: IntegrityError, nodes: list[str]) -> IntegrityError:
    rank = dist.get_rank()
    named_nodes = sorted({nodes[r] for r in error.ranks if r < len(nodes)})
    box: list[Any] = [None]
    if rank == 0:
        earlier = failures()
        box = [[n for n in named_nodes if any(n in record["nodes"] for record in earlier)]]
    dist.broadcast_object_list(box, src=0)
    repeated = box[0]
    if repeated:
        ranks = [r for r in error.ranks if nodes[r] in repeated]
        error = IntegrityError(
            f"{error} This node failed a check before: rank(s) {ranks} on node(s) {repeated}. Stopping: the fault "
            "repeats there, so it is the hardware, not a transient. Leave those nodes out (drain them, or let the "
            "autoscaler replace them) and resume.",
            error.step,
            ranks,
            error.names,
            "repeated",
        )
        named_nodes = repeated
    if rank == 0:
        _record(error, named_nodes)
    if repeated:
        return error
    rollback = trainer.args.to_zero_config().on_mismatch == "rollback"
    if rank == 0:
        then = (
            "rolling back: the restart resumes from the newest memory snapshot taken at a verified step"
            if rollback
            else "stopping (on_mismatch='raise')"
        )
        logger.error("[hf_lowzero] %s; %s", error, then)
    return designed(error) if rollback else error  # [Note: designed events] in events.py


def _refuse_excluded_nodes(nodes: list[str]) -> None:
    """Fail at once where a repeated fault was seen: on the nodes it named."""
    repeated = [r for r in failures() if r.get("kind") == "repeated"]
    bad = sorted({n for record in repeated for n in record["nodes"]} & set(nodes))
    if bad:
        ranks = [r for r, n in enumerate(nodes) if n in bad]
        raise IntegrityError(
            f"ranks {ranks} were placed on node(s) {bad}, where an integrity fault repeated; leave them out",
            0,
            ranks,
            [],
            "repeated",
        )


def _record(error: IntegrityError, nodes: list[str]) -> None:
    fs, folder = _folder()
    fs.create_dir(folder, recursive=True)
    record = {
        "time": time.time(),
        "step": error.step,
        "ranks": error.ranks,
        "names": error.names,
        "kind": error.kind,
        "nodes": nodes,
        "message": str(error),
    }
    with fs.open_output_stream(f"{folder}/failure-{time.time_ns()}-{uuid.uuid4().hex[:8]}.json") as f:
        f.write(json.dumps(record).encode())


def _nodes() -> list[str]:
    nodes: list[str] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
    return nodes


def _folder() -> tuple[pyarrow.fs.FileSystem, str]:
    storage = ray.train.get_context().get_storage()
    return storage.storage_filesystem, f"{storage.experiment_fs_path}/{FAILURES_DIR}"
