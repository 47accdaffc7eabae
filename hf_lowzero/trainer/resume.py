"""Which Trainer checkpoint a ZeRO run resumes from: never one whose save was cut.

``Trainer`` writes ``checkpoint-N/`` in steps: the model, the optimizer shards (``zero_optimizer/``,
written as ``zero_optimizer.partial/`` and renamed: [Note: atomic save] in ``checkpoint/save.py``), the
scheduler and RNG states, and ``trainer_state.json`` last. A save cut midway leaves a folder that
``transformers.trainer_utils.get_last_checkpoint`` still picks, and resuming it would go on with a fresh
optimizer and LR schedule. ``resume_from_checkpoint=True`` therefore skips such a folder for the last
complete one, saying so in one line; a path given explicitly is refused, naming the complete copy.

Example::

    checkpoint = resolve_resume(True, "out")        # "out/checkpoint-2" when checkpoint-4 was cut
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from hf_lowzero.checkpoint.layout import META_FILE, TRAINER_SUBDIR, partial_dir
from hf_lowzero.checkpoint.reader import unfinished_save
from hf_lowzero.trainer.snapshot_files import TRAINER_STATE_NAME

logger = logging.getLogger(__name__)
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def incomplete_reason(checkpoint: str | os.PathLike) -> str | None:
    """Why Trainer checkpoint folder ``checkpoint`` is not a complete save, or None when it is.

    A folder without ``zero_optimizer/`` (``save_only_model=True``, ``zero_stage=0``) is complete when it
    holds ``trainer_state.json``.
    """
    folder = Path(checkpoint)
    zero = folder / TRAINER_SUBDIR
    partial = Path(partial_dir(zero))
    if not (zero / META_FILE).is_file() and (zero.exists() or partial.exists()):
        return f"its optimizer state is incomplete ({zero / META_FILE} missing{unfinished_save(zero)})"
    if not (folder / TRAINER_STATE_NAME).is_file():
        return f"it has no {TRAINER_STATE_NAME} (the save was cut before its end)"
    return None


def resolve_resume(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """The checkpoint to resume: the last complete one under ``output_dir`` for ``True`` (logging one
    line for those skipped), or the given path once it is known to be complete.

    Raises:
        ValueError: ``True`` and no complete checkpoint under ``output_dir``, or the given checkpoint is
            incomplete (the message names the last complete one and how to resume it).
    """
    if resume_from_checkpoint is True:
        skipped = []
        for folder in sorted(_checkpoints(output_dir), key=_step, reverse=True):
            reason = incomplete_reason(folder)
            if reason is None:
                if skipped:
                    logger.warning("resuming from %s: skipped incomplete %s", folder, "; ".join(skipped))
                return str(folder)
            skipped.append(f"{folder.name} ({reason})")
        raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir}; {'; '.join(skipped)}")
    reason = incomplete_reason(resume_from_checkpoint)
    if reason is None:
        return str(resume_from_checkpoint)
    folder = Path(resume_from_checkpoint)
    earlier = [p for p in _checkpoints(folder.parent) if _step(p) < _step(folder) and incomplete_reason(p) is None]
    alternative = "No complete checkpoint precedes it."
    if earlier:
        last = max(earlier, key=_step)
        alternative = (
            f"The last complete checkpoint before it is {last}: resume with resume_from_checkpoint='{last}' "
            "(or True, which skips incomplete ones)."
        )
    raise ValueError(f"cannot resume from {folder}: {reason}. {alternative}")


def _checkpoints(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)]


def _step(folder: Path) -> int:
    match = _CHECKPOINT.match(folder.name)
    return int(match.group(1)) if match else -1
