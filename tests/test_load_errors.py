"""A bad checkpoint fails every rank together with one clear message, whatever the error and on
whichever rank it comes, and changes nothing; loading imports no class outside the allowlist.

Each W=2 body runs on a process group with a short timeout: a rank left waiting in a collective
fails the test in seconds with gloo's timeout instead of the expected CheckpointError.
"""

import contextlib
import datetime
import io
import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from hf_lowzero import CheckpointError, LowLevelZeroOptimizer, load_checkpoint, save_checkpoint
from hf_lowzero.checkpoint.reader import ShardReader
from hf_lowzero.testing import run_distributed
from tests.models import BranchyNet, make_inner
from tests.test_checkpoint import assert_unchanged, flip_data_byte, snapshot, train, tree

SHORT = datetime.timedelta(seconds=20)  # far above a load's time, far below the 120 s default
RANK1 = "zero_shard_rank00001_of_00002.safetensors"


def _edit_meta(folder: Path, edit) -> None:
    meta_path = folder / "zero_meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))


def _first_param(meta) -> dict:
    return meta["params"]["embed.weight"]


def _packed(cls_name):
    def edit(meta):
        _first_param(meta)["packed_state"] = {"exp_avg": {"class": cls_name, "attributes": [], "inner": {}}}

    return edit


def _py_beside(folder: Path) -> None:
    """A module shipped in the checkpoint's folder, and metadata that names a class of it."""
    (folder / "planted_beside.py").write_text(f"open({str(folder / 'ran')!r}, 'w').close()\nclass Thing: ...\n")
    _edit_meta(folder, _packed("planted_beside:Thing"))


def _version_1_flipped(folder: Path) -> None:
    _edit_meta(folder, lambda meta: meta.update(format_version=1))
    flip_data_byte(folder / RANK1, "state/embed.weight/exp_avg")


# damaged copy -> (how to damage it, the message every rank must raise)
DAMAGED = {
    "no_params": (lambda f: _edit_meta(f, lambda m: m.pop("params")), "field 'params' is missing"),
    "bad_dtype": (
        lambda f: _edit_meta(f, lambda m: _first_param(m)["row_state_dtypes"].update(exp_avg="float33")),
        "field 'params.embed.weight.row_state_dtypes.exp_avg' is 'float33', expected a torch dtype name",
    ),
    "world_size_0": (
        lambda f: _edit_meta(f, lambda m: m.update(world_size=0)),
        "field 'world_size' is 0, expected an integer from 1",
    ),
    "world_size_str": (
        lambda f: _edit_meta(f, lambda m: m.update(world_size="2")),
        "field 'world_size' is '2', expected an integer",
    ),
    "this_nope": (
        lambda f: _edit_meta(f, _packed("this:Nope")),
        r"packed state class 'this:Nope' is not one this hf_lowzero loads \(allowed: torchao.optim",
    ),
    "os_system": (lambda f: _edit_meta(f, _packed("os:system")), "packed state class 'os:system' is not one"),
    "py_beside": (_py_beside, "packed state class 'planted_beside:Thing' is not one"),
    "version_1_flipped": (_version_1_flipped, f"{RANK1}: tensor 'state/embed.weight/exp_avg' is corrupted"),
}


def build(group, inner="adamw"):
    model = BranchyNet(0)
    return model, LowLevelZeroOptimizer(model, make_inner(inner, model), stage=2, process_group=group)


def groups_of(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def damaged_metadata_body(rank, world_size, tmp):
    group = dist.new_group(list(range(world_size)), timeout=SHORT)
    model, opt = build(group)
    train(model, opt, rank, world_size, range(2), torch.float32)
    good = save_checkpoint(opt, f"{tmp}/good")
    if rank == 0:
        for name, (damage, _) in DAMAGED.items():
            shutil.copytree(good, f"{tmp}/{name}")
            damage(Path(f"{tmp}/{name}"))
    dist.barrier(group)
    files = tree(Path(tmp))
    sys.path.insert(0, f"{tmp}/py_beside")  # the folder on sys.path, as the working directory would be
    train(model, opt, rank, world_size, range(2, 3), torch.float32)  # so a wrong load would show
    for name, (_, message) in DAMAGED.items():
        before, groups = snapshot(model, opt), groups_of(opt)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), pytest.raises(CheckpointError, match=message) as raised:
            load_checkpoint(opt, f"{tmp}/{name}")
        assert f"{tmp}/{name}/zero_meta.json" in str(raised.value) or name == "version_1_flipped", name
        assert printed.getvalue() == "", name  # `this` prints the Zen of Python when imported
        assert_unchanged(before, model, opt)
        assert groups_of(opt) == groups, name
    assert "this" not in sys.modules and "planted_beside" not in sys.modules  # never imported
    assert tree(Path(tmp)) == files  # every file as it was: the planted module never ran ('ran' absent)

    # An AdamW checkpoint into SGD: refused, SGD's groups keep their own hyperparameters.
    sgd_model, sgd = build(group, inner="sgd")
    before, groups = snapshot(sgd_model, sgd), groups_of(sgd)
    with pytest.raises(CheckpointError, match="saved with inner optimizer torch.optim.adamw.AdamW, this one wraps "):
        load_checkpoint(sgd, good)
    assert_unchanged(before, sgd_model, sgd)
    assert groups_of(sgd) == groups and "betas" not in groups[0]
    load_checkpoint(opt, good)  # the intact one still loads


def one_rank_error_body(rank, world_size, tmp):
    group = dist.new_group(list(range(world_size)), timeout=SHORT)
    model, opt = build(group)
    train(model, opt, rank, world_size, range(2), torch.float32)
    good = save_checkpoint(opt, f"{tmp}/good")
    train(model, opt, rank, world_size, range(2, 3), torch.float32)
    expected = r"nothing was changed: rank 1: unexpected OSError: injected read failure \(a bug or an environment"

    # Raised outside the reader's own checks, of a type it does not catch, on rank 1 only.
    failing = mock.patch.object(ShardReader, "read", side_effect=OSError("injected read failure"))
    before = snapshot(model, opt)
    with failing if rank == 1 else contextlib.nullcontext(), pytest.raises(CheckpointError, match=expected):
        load_checkpoint(opt, good)
    assert_unchanged(before, model, opt)

    # A damaged file only rank 1 reads (W=2 -> W=2: rank 0 reads rank 0's file alone).
    if rank == 0:
        shutil.copytree(good, f"{tmp}/rank1-damaged")
        flip_data_byte(Path(f"{tmp}/rank1-damaged/{RANK1}"), "master/embed.weight")
    dist.barrier(group)
    with pytest.raises(CheckpointError, match=f"rank 1: .*{RANK1}: tensor 'master/embed.weight' is corrupted"):
        load_checkpoint(opt, f"{tmp}/rank1-damaged")
    assert_unchanged(before, model, opt)

    # Failing while the state is written, on rank 1 only: every rank raises, none waits in the
    # params' all-gather that follows.
    failing = mock.patch.object(opt, "load_state_dict", side_effect=RuntimeError("injected"))
    with failing if rank == 1 else contextlib.nullcontext(), pytest.raises(CheckpointError, match="some ranks only"):
        load_checkpoint(opt, good)
    load_checkpoint(opt, good)  # and a retry on every rank restores a consistent state


def test_damaged_metadata_fails_every_rank_with_the_file_and_field(tmp_path):
    run_distributed(damaged_metadata_body, 2, tmp=str(tmp_path))


def test_an_error_on_one_rank_fails_every_rank_together(tmp_path):
    run_distributed(one_rank_error_body, 2, tmp=str(tmp_path))
