"""A save that fails on one rank fails every rank together, with one message naming the rank and its
cause, and leaves the previous checkpoint in place and loadable ([Note: ranks agree on failure] in
``hf_lowzero/checkpoint/agree.py``).

The W=2 body runs on a process group with a short timeout: a rank left waiting in a collective fails
the test in seconds with gloo's timeout instead of the expected CheckpointError.
"""

import contextlib
import errno
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from hf_lowzero import CheckpointError, load_checkpoint, save_checkpoint
from hf_lowzero.checkpoint import save
from hf_lowzero.checkpoint.atomic import replace_synced
from hf_lowzero.testing import run_distributed
from tests.test_checkpoint import assert_unchanged, snapshot, train, tree
from tests.test_load_errors import SHORT, build


def one_rank_save_error_body(rank, world_size, tmp):
    group = dist.new_group(list(range(world_size)), timeout=SHORT)
    model, opt = build(group)
    train(model, opt, rank, world_size, range(2), torch.float32)
    ck = Path(save_checkpoint(opt, f"{tmp}/ck"))
    saved, files = snapshot(model, opt), tree(ck)
    train(model, opt, rank, world_size, range(2, 3), torch.float32)  # so that a wrong load would show

    # Rank 1's disk is full: its rank file's write fails, rank 0's succeeds.
    disk_full = mock.patch.object(save, "save_file", side_effect=OSError(errno.ENOSPC, "No space left on device"))
    expected = (
        rf"^cannot save checkpoint {re.escape(str(ck))}; the previous checkpoint there, if any, is unchanged: "
        r"rank 1: OSError: \[Errno 28\] No space left on device$"
    )
    with disk_full if rank == 1 else contextlib.nullcontext(), pytest.raises(CheckpointError, match=expected):
        save_checkpoint(opt, ck)
    assert tree(ck) == files  # not a byte of the previous checkpoint changed
    left = sorted(p.name for p in Path(tmp).iterdir())
    assert left == ["ck", "ck.partial"], left  # the unfinished save, as a crash leaves it: loading refuses it

    # A path rank 0 cannot create (its parent is a file): rank 1 raises too instead of waiting.
    dist.barrier(group)  # every rank has looked at the folder
    if rank == 0:
        Path(f"{tmp}/a_file").write_text("not a folder")
    dist.barrier(group)
    with pytest.raises(CheckpointError, match=r": rank 0: NotADirectoryError: \[Errno 20\] Not a directory"):
        save_checkpoint(opt, f"{tmp}/a_file/ck")
    assert Path(f"{tmp}/a_file").read_text() == "not a folder"

    load_checkpoint(opt, ck)  # the earlier checkpoint loads, to the values it was saved with
    assert_unchanged(saved, model, opt)
    assert tree(ck) == files

    # Rank 0's second rename (the new copy into place) is denied, after the first moved ck aside.
    renames = []

    def second_denied(source, target):
        renames.append(target)
        if len(renames) == 2:
            raise OSError(errno.EACCES, "Permission denied")
        replace_synced(source, target)

    denied = mock.patch.object(save, "replace_synced", second_denied)
    with denied if rank == 0 else contextlib.nullcontext(), pytest.raises(CheckpointError) as raised:
        save_checkpoint(opt, ck)
    old = Path(f"{tmp}/ck.old")
    assert str(raised.value) == (
        f"cannot save checkpoint {ck}: moving it into place failed; the new checkpoint is at {ck} or {ck}.partial, "
        f"the previous one at {ck} or {old} (load_checkpoint({str(ck)!r}) names what is left and how to restore it): "
        "rank 0: PermissionError: [Errno 13] Permission denied"
    )
    assert tree(old) == files  # the previous checkpoint, moved aside whole
    with pytest.raises(CheckpointError, match=f"Restore it with: mv {ck}.partial {ck}"):
        load_checkpoint(opt, ck)
    load_checkpoint(opt, old)
    assert_unchanged(saved, model, opt)

    save_checkpoint(opt, ck)  # and the next save, on every rank, succeeds and clears what was left
    assert sorted(p.name for p in Path(tmp).iterdir()) == ["a_file", "ck"]


def test_a_save_error_on_one_rank_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    run_distributed(one_rank_save_error_body, 2, tmp=str(tmp_path))
