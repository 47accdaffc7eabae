"""The Trainer's part of a memory snapshot, as JSON, and the Trainer files it becomes again.

A Trainer ``checkpoint-N`` folder holds, beside the model and the optimizer shards,
``trainer_state.json``, ``scheduler.pt`` and one ``rng_state_<rank>.pth`` per rank. A snapshot keeps
the same state as JSON in its pieces' manifests (no pickle: [Note: snapshot point] says when it is
taken), and a restore writes those files back, so that ``Trainer.train(resume_from_checkpoint=...)``
resumes a snapshot exactly as it resumes the checkpoint saved at the same step.

Example::

    manifest |= trainer_manifest(trainer)                  # at the snapshot point, every rank
    write_trainer_files(folder, manifests, rng_ranks=[rank], common=is_node_leader)   # at restore

# [Note: snapshot point]
# A snapshot is taken where the Trainer saves a checkpoint: after the step's optimizer update, LR
# schedule, logging, evaluation and save (``_maybe_log_save_evaluate``), before the next step fetches
# its batch. The trainer state then holds this step's log entry, and the RNG is where the checkpoint
# of this step would find it (a collator that draws random numbers, e.g. masking, draws them for
# the next batch after this point). ``LowZeroTrainer`` calls ``after_log_save_evaluate`` of its
# callbacks there.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from hf_lowzero.checkpoint.atomic import atomic_write
from hf_lowzero.snapshot.format import MARKER_FILE
from hf_lowzero.snapshot.json_text import EncodedList

TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"


def trainer_manifest(trainer, include_state: bool, log: LogCopies | None = None) -> dict[str, Any]:
    """This rank's Trainer state at the snapshot point as JSON: its RNG states and, with
    ``include_state`` (rank 0), the trainer state and the LR scheduler's state; ``log``: the copies
    of the log entries earlier snapshots made (updated), or None to copy the whole log."""
    # Trainer._save_rng_state keeps every GPU's CUDA RNG state when the run is distributed (a
    # process group, even of one rank: an elastic Ray run at its minimum), the current GPU's
    # otherwise; its loader reads the same layout back.
    distributed = trainer.args.parallel_mode == ParallelMode.DISTRIBUTED
    manifest: dict[str, Any] = {"rng": rng_to_json(cuda_all=distributed)}
    if include_state:
        manifest["trainer_state"] = _trainer_state_json(trainer, log if log is not None else LogCopies())
        manifest["scheduler"] = _strict_json(trainer.lr_scheduler.state_dict(), "the LR scheduler's state_dict()")
    return manifest


def write_trainer_files(
    folder: str | Path, manifests: dict[int, dict[str, Any]], rng_ranks: list[int], common: bool
) -> None:
    """Write the Trainer files of a snapshot into ``folder`` (its ``checkpoint-N``): the RNG files of
    ``rng_ranks``, named as the saving world named them, and with ``common`` (one rank per node) the
    trainer state, the scheduler and the marker, from rank 0's manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    first = manifests[0]
    saved_world = first["world_size"]
    for rank in rng_ranks:
        name = "rng_state.pth" if saved_world == 1 else f"rng_state_{rank}.pth"
        rng = rng_from_json(manifests[rank]["rng"])
        atomic_write(folder / name, lambda f, rng=rng: torch.save(rng, f))
    if not common:
        return
    atomic_write(
        folder / TRAINER_STATE_NAME, lambda f: Path(f).write_text(json.dumps(first["trainer_state"], indent=2))
    )
    atomic_write(folder / SCHEDULER_NAME, lambda f: torch.save(first["scheduler"], f))
    marker = {"step": first["step"], "world_size": saved_world, "source": "memory"}
    atomic_write(folder / MARKER_FILE, lambda f: Path(f).write_text(json.dumps(marker)))


def is_memory_snapshot(folder: str | Path) -> bool:
    """Whether a ``checkpoint-N`` folder was written from a memory snapshot (it holds no model
    weights: the params come from the optimizer's master rows)."""
    return (Path(folder) / MARKER_FILE).is_file()


def rng_to_json(cuda_all: bool) -> dict[str, Any]:
    """The RNG states ``Trainer._save_rng_state`` saves, as JSON ([Note: RNG states as bytes])."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {
        "python": [version, _b64_words(internal), gauss],
        "numpy": [kind, _b64_words(keys), pos, has_gauss, cached],
        "cpu": _b64(torch.random.get_rng_state()),
    }
    if torch.cuda.is_available():
        rng["cuda"] = (
            [_b64(s) for s in torch.cuda.random.get_rng_state_all()]
            if cuda_all
            else _b64(torch.cuda.random.get_rng_state())
        )
    return rng


def rng_from_json(rng: dict[str, Any]) -> dict[str, Any]:
    """The dict ``Trainer._load_rng_state`` reads, from ``rng_to_json``'s output."""
    version, internal, gauss = rng["python"]
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    out = {
        "python": (version, tuple(_words(internal).tolist()), gauss),
        "numpy": (kind, _words(keys), pos, has_gauss, cached),
        "cpu": _unb64(rng["cpu"]),
    }
    if "cuda" in rng:
        cuda = rng["cuda"]
        out["cuda"] = [_unb64(s) for s in cuda] if isinstance(cuda, list) else _unb64(cuda)
    return out


# [Note: RNG states as bytes]
# Python's and numpy's Mersenne Twister states are 625 and 624 32-bit words. As JSON lists of
# ints they were 15 kB of each piece's details, and building and encoding them took 0.27 ms of
# every rank's stop on the main job (``benchmarks/snapshot_write.py``), about as much as the copy
# of its shard. They are kept as base64 of the words (little-endian uint32), as torch's states
# already were: 6.6 kB, and no Python per word (snapshot format version 3).


def _b64_words(words: Any) -> str:
    return base64.b64encode(np.asarray(words, dtype="<u4").tobytes()).decode()


def _words(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<u4").astype(np.uint32)


class LogCopies:
    """JSON copies of a Trainer's log entries, each entry copied and encoded once, by the first
    snapshot that sees it ([Note: lists encoded once] in ``hf_lowzero/snapshot/json_text.py``)."""

    def __init__(self) -> None:
        self._ends: tuple[Any, Any] | None = None  # the first and the last live entry copied so far
        self._copies = EncodedList()

    def of(self, log: list[Any]) -> EncodedList:
        """The copy of ``log``: the entries copied before (while ``log`` has the same first entry
        object and the same one where the last copy ended: the Trainer appends, and never changes
        an entry it logged) and copies of the new ones."""
        n, (first, last) = len(self._copies), self._ends or (None, None)
        if n and (len(log) < n or log[0] is not first or log[n - 1] is not last):  # another log (a resume)
            n, self._ends, self._copies = 0, None, EncodedList()
        new = log[n:]
        try:
            self._copies.extend_copied(new)  # the copy and the text, one encoding
        except (TypeError, ValueError) as e:
            raise _not_json("the trainer state's log", e) from e
        if log:
            self._ends = (log[0], log[-1])
        return self._copies.copy_encoded()  # the next snapshot extends this one's list


def _trainer_state_json(trainer, log: LogCopies) -> dict[str, Any]:
    # What _save_checkpoint writes: the state with every ExportableState callback's state, without
    # changing the live state (a checkpoint appends to list-valued entries). The fields are taken as
    # they are (``dataclasses.asdict`` deep-copies the log entry by entry, most of a snapshot's stop
    # on the main job); the JSON round trip below is the copy, and the log's entries are copied
    # once each (``log``).
    state = {f.name: getattr(trainer.state, f.name) for f in dataclasses.fields(trainer.state)}
    stateful = state["stateful_callbacks"] = dict(state.get("stateful_callbacks") or {})
    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control] if isinstance(c, ExportableState)]:
        name = type(cb).__name__
        if isinstance(stateful.get(name), list):
            stateful[name] = stateful[name] + [cb.state()]
        else:
            stateful[name] = cb.state()
    copied = _strict_json({k: v for k, v in state.items() if k != "log_history"}, "the trainer state")
    return {k: log.of(state["log_history"]) if k == "log_history" else copied[k] for k in state}


def _strict_json(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise _not_json(what, e) from e


def _not_json(what: str, error: Exception) -> ValueError:
    return ValueError(
        f"{what} is not JSON ({error}); memory snapshots hold JSON and tensors only. Use a scheduler whose "
        "state_dict() is plain numbers and lists, or turn snapshots off (snapshot_every=None)"
    )


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
