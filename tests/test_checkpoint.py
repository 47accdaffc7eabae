"""Sharded checkpoints: resharding resume equals the uninterrupted run; bad checkpoints change
nothing; a crash during save leaves the previous checkpoint loadable; full export."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.multiprocessing import ProcessExitedException
from torch.nn.functional import mse_loss

from hf_lowzero import (
    CheckpointError,
    LowLevelZeroOptimizer,
    consolidate_checkpoint,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from hf_lowzero.checkpoint.layout import CHECKSUM_CHUNK_NUMEL, EXTRAS_FILE, checksum_error, chunk_checksums, chunk_span
from hf_lowzero.consolidate import main as consolidate_cli
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime.comm import all_gather_object
from tests.models import BranchyNet, assert_params_equal, ddp_reference, make_inner
from tests.tiers import slow

GLOBAL_BATCH = 12  # divisible by every world size we use, so each step sees the same global batch
# stage, params' dtype, inner optimizer, partition saved with, partition loaded into
COMBOS = [
    (1, torch.float32, "adamw", "rows", "rows"),
    (2, torch.float32, "adamw", "rows", "rows"),
    (1, torch.bfloat16, "adamw", "rows", "rows"),
    (2, torch.float16, "adamw", "rows", "rows"),
    (2, torch.float32, "adafactor", "params", "params"),  # factored state: saved and loaded whole
    (1, torch.bfloat16, "adamw", "params", "rows"),  # element-wise state moves between the layouts
    (2, torch.float16, "adamw", "rows", "params"),
]
BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps after it


def global_batch(rank: int, world_size: int, step: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 17, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    chunk = GLOBAL_BATCH // world_size
    return x[rank * chunk : (rank + 1) * chunk].to(dtype), y[rank * chunk : (rank + 1) * chunk].to(dtype)


def build(stage: int, dtype: torch.dtype, seed: int = 0, inner: str = "adamw", partition: str = "rows"):
    model = BranchyNet(seed).to(dtype)
    # fp16: a scale that does not overflow by itself (whether a borderline scale overflows depends
    # on rounding, so on the world size), growing every 2 clean steps, so the scaler state changes.
    fp16 = {"initial_scale": 2.0**10, "growth_interval": 2} if dtype is torch.float16 else {}
    opt = LowLevelZeroOptimizer(
        model, make_inner(inner, model), stage=stage, reduce_bucket_mb=0.001, partition=partition, **fp16
    )
    return model, opt


def overflow_once(model: nn.Module, rank: int) -> None:
    """An inf gradient in the first backward on rank 0: one skipped step before the checkpoint."""
    calls = []

    def hook(grad):
        calls.append(1)
        return grad.index_fill(0, torch.tensor([0]), float("inf")) if rank == 0 and len(calls) == 1 else grad

    model.head.bias.register_hook(hook)


def train(model, opt, rank, world_size, steps, dtype):
    for step in steps:
        x, y = global_batch(rank, world_size, step, dtype)
        opt.backward(mse_loss(model(x), y))
        opt.step()


def counters(opt) -> dict:
    """Loss scale, skips, and the step counts of the inner optimizer's state on any rank (with whole
    params each rank holds only its own)."""
    local = {float(s["step"]) for s in opt.state.values() if "step" in s}
    steps = sorted(set().union(*all_gather_object(local, None)))
    return {"loss_scale": opt.loss_scale, "skipped": opt.skipped_steps, "adam_steps": steps}


def save_then_continue(rank, world_size, tmp):
    for stage, dtype, inner, saved_partition, _ in COMBOS:
        tag = f"{stage}-{dtype}-{inner}-{saved_partition}"
        model, opt = build(stage, dtype, inner=inner, partition=saved_partition)
        overflow_once(model, rank)
        train(model, opt, rank, world_size, range(BEFORE), dtype)
        save_checkpoint(opt, f"{tmp}/ckpt-{tag}")
        saved = counters(opt)
        train(model, opt, rank, world_size, range(BEFORE, BEFORE + AFTER), dtype)
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{tmp}/final-{tag}.pt")
            with open(f"{tmp}/counters-{tag}.json", "w") as f:
                json.dump(saved, f)


def load_then_continue(rank, world_size, tmp):
    for stage, dtype, inner, saved_partition, partition in COMBOS:
        tag = f"{stage}-{dtype}-{inner}-{saved_partition}"
        # a different init: everything must come from the checkpoint
        model, opt = build(stage, dtype, seed=7, inner=inner, partition=partition)
        load_checkpoint(opt, f"{tmp}/ckpt-{tag}")
        saved = consolidate_checkpoint(f"{tmp}/ckpt-{tag}")
        for name, p in model.named_parameters():
            assert torch.equal(p, saved[name].to(dtype)), f"{tag} {name}: params must equal the saved masters"
        with open(f"{tmp}/counters-{tag}.json") as f:
            assert counters(opt) == json.load(f), tag
        train(model, opt, rank, world_size, range(BEFORE, BEFORE + AFTER), dtype)
        final = torch.load(f"{tmp}/final-{tag}.pt")
        # Same math at another world size: equal up to summation order (fp32), or up to two
        # units in the last place of a 16-bit param (Adam can turn a rounding flip into one ULP).
        tol = 1e-5 if dtype is torch.float32 else 2 * torch.finfo(dtype).eps
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, final[name], rtol=tol, atol=tol, msg=lambda m, n=name, t=tag: f"{t} {n}: {m}")


@pytest.mark.parametrize("saved_ws,loaded_ws", [slow((3, 2)), (2, 1), slow((1, 4))])  # fewer, fewer, more
def test_resume_at_another_world_size_continues_like_the_uninterrupted_run(tmp_path, saved_ws, loaded_ws):
    run_distributed(save_then_continue, saved_ws, tmp=str(tmp_path))
    if saved_ws == 2:  # one checkpoint per rank plus metadata and the unsharded extras, nothing pickled
        names = sorted(os.listdir(tmp_path / "ckpt-1-torch.float32-adamw-rows"))
        assert names == [
            "zero_meta.json",
            "zero_model_extras.safetensors",
            "zero_shard_rank00000_of_00002.safetensors",
            "zero_shard_rank00001_of_00002.safetensors",
        ]
    run_distributed(load_then_continue, loaded_ws, tmp=str(tmp_path))


class WiderHead(BranchyNet):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(13, 4)


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_unchanged(before, model, opt):
    params, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    now = opt.state_dict()
    assert now["zero"]["loss_scaler"] == state["zero"]["loss_scaler"]
    assert now["zero"]["skipped_steps"] == state["zero"]["skipped_steps"]
    for k, v in state["zero"]["master_rows"].items():
        assert torch.equal(v, now["zero"]["master_rows"][k])
    for k, v in state["state"].items():
        assert all(torch.equal(v[key], now["state"][k][key]) for key in v)


def flip_data_byte(file, key):
    """Invert one byte in the middle of tensor ``key``'s data (not the header) of a safetensors file."""
    with open(file, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        begin, end = json.loads(f.read(header_len))[key]["data_offsets"]
        f.seek(8 + header_len + (begin + end) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def corrupt(src, dst, how):
    shutil.copytree(src, dst)
    rank1 = os.path.join(dst, "zero_shard_rank00001_of_00002.safetensors")
    if how == "missing_rank_file":
        os.remove(rank1)
    elif how == "truncated":
        with open(rank1, "r+b") as f:
            f.truncate(os.path.getsize(rank1) - 100)
    elif how == "garbage_header":
        with open(rank1, "r+b") as f:
            f.write(b"\xff" * 16)
    elif how == "flipped_bytes":
        flip_data_byte(rank1, "state/embed.weight/exp_avg")
    elif how in ("unknown_version", "version_1"):
        meta_path = os.path.join(dst, "zero_meta.json")
        with open(meta_path) as f:
            meta = json.load(f)
        meta["format_version"] = 99 if how == "unknown_version" else 1
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    elif how == "no_metadata":
        os.remove(os.path.join(dst, "zero_meta.json"))


BAD = {
    "missing_rank_file": "zero_shard_rank00001_of_00002.safetensors: file missing",
    "truncated": "zero_shard_rank00001_of_00002.safetensors: truncated or corrupted",
    "garbage_header": "zero_shard_rank00001_of_00002.safetensors: truncated or corrupted",
    "flipped_bytes": "zero_shard_rank00001_of_00002.safetensors: tensor 'state/embed.weight/exp_avg' is corrupted",
    "unknown_version": "zero_meta.json: unknown format version 99",
    "no_metadata": "zero_meta.json: missing; not a complete hf_lowzero checkpoint",
}


def bad_checkpoint_body(rank, world_size, tmp):
    model, opt = build(2, torch.float32)
    train(model, opt, rank, world_size, range(2), torch.float32)
    good = save_checkpoint(opt, f"{tmp}/good")
    if rank == 0:
        for how in [*BAD, "version_1"]:
            corrupt(good, f"{tmp}/{how}", how)
    dist.barrier()
    files = tree(Path(tmp))
    train(model, opt, rank, world_size, range(2, 3), torch.float32)  # so a wrong load would show
    for how, message in BAD.items():
        before = snapshot(model, opt)
        with pytest.raises(CheckpointError, match=message):  # on every rank, also those that read no rank-1 file
            load_checkpoint(opt, f"{tmp}/{how}")
        assert_unchanged(before, model, opt)
    assert tree(Path(tmp)) == files  # no file changed, none removed: the damaged copies are the user's to inspect
    for other, message in [(WiderHead(), "shapes differ"), (nn.Linear(17, 3), "different model")]:
        other_opt = LowLevelZeroOptimizer(other, make_inner("adamw", other), stage=2)
        before = snapshot(other, other_opt)
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(other_opt, good)
        assert_unchanged(before, other, other_opt)
    load_checkpoint(opt, good)  # the good one still loads after all that
    loaded = snapshot(model, opt)
    train(model, opt, rank, world_size, range(2, 3), torch.float32)
    load_checkpoint(opt, f"{tmp}/version_1")  # saved before checksums existed: loads, unverified
    assert_unchanged(loaded, model, opt)


def corrupted_elsewhere_body(rank, world_size, tmp):
    """The checkpoint with flipped bytes in rank 1's file, saved at 2 ranks, loaded at 3: ranks 1
    and 2 read the corrupted slice, rank 0 does not; all raise and nothing changes."""
    model, opt = build(2, torch.float32)
    train(model, opt, rank, world_size, range(1), torch.float32)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=BAD["flipped_bytes"]):
        load_checkpoint(opt, f"{tmp}/flipped_bytes")
    assert_unchanged(before, model, opt)
    load_checkpoint(opt, f"{tmp}/good")  # every slice of the intact one verifies at 3 ranks


def test_bad_checkpoints_raise_on_every_rank_and_change_nothing(tmp_path):
    run_distributed(bad_checkpoint_body, 2, tmp=str(tmp_path))
    run_distributed(corrupted_elsewhere_body, 3, tmp=str(tmp_path))
    # Consolidation verifies what it reads too (master weights and extras), also through the CLI.
    for file, key in [
        ("zero_shard_rank00001_of_00002.safetensors", "master/embed.weight"),
        (EXTRAS_FILE, "extra/frozen.weight"),
    ]:
        shutil.copytree(tmp_path / "good", tmp_path / key)
        flip_data_byte(tmp_path / key / file, key)
        with pytest.raises(CheckpointError, match=f"{file}: tensor '{key}' is corrupted"):
            consolidate_checkpoint(tmp_path / key)
        with pytest.raises(CheckpointError, match=f"{file}: tensor '{key}' is corrupted"):
            consolidate_cli([str(tmp_path / key), str(tmp_path / "out")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksums_verify_only_the_chunks_a_slice_reads(dtype):
    numel = 2 * CHECKSUM_CHUNK_NUMEL + 5  # two whole chunks and a short one
    row = torch.randn(numel).to(dtype)
    stored = " ".join(f"{c:08x}" for c in chunk_checksums(row))
    assert len(stored.split()) == 3
    assert chunk_span(10, 20, numel) == (0, CHECKSUM_CHUNK_NUMEL)
    assert chunk_span(CHECKSUM_CHUNK_NUMEL - 1, CHECKSUM_CHUNK_NUMEL + 1, numel) == (0, 2 * CHECKSUM_CHUNK_NUMEL)
    assert chunk_span(numel - 1, numel, numel) == (2 * CHECKSUM_CHUNK_NUMEL, numel)
    damaged = row.clone()
    damaged.view(torch.uint8)[-3] ^= 1  # one bit in the short last chunk
    assert checksum_error(stored, damaged) == (
        f"is corrupted: elements [{2 * CHECKSUM_CHUNK_NUMEL}, {numel}) do not match their checksum "
        "(the file changed after saving)"
    )
    assert checksum_error(stored, damaged[: 2 * CHECKSUM_CHUNK_NUMEL]) is None  # a slice not reading it
    assert checksum_error(stored, damaged[CHECKSUM_CHUNK_NUMEL:], CHECKSUM_CHUNK_NUMEL) is not None
    assert checksum_error(stored, row[CHECKSUM_CHUNK_NUMEL:], CHECKSUM_CHUNK_NUMEL) is None
    assert checksum_error(None, row) == "has no checksum in the file's metadata"


def crash_during_save_body(rank, world_size, tmp):
    model, opt = build(1, torch.float32)
    train(model, opt, rank, world_size, range(2), torch.float32)
    save_checkpoint(opt, f"{tmp}/ckpt")
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{tmp}/saved.pt")
    train(model, opt, rank, world_size, range(2, 3), torch.float32)
    if rank == 1:
        os.environ["HF_LOWZERO_CRASH_POINT"] = "after_rank_files"  # dies mid-save, as a killed worker would
    save_checkpoint(opt, f"{tmp}/ckpt")


def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(ProcessExitedException, match="exit code 17"):
        run_distributed(crash_during_save_body, 2, tmp=str(tmp_path))
    assert (tmp_path / "ckpt.partial").is_dir()  # the half-written save is there...
    with pytest.raises(CheckpointError, match="not a complete hf_lowzero checkpoint"):
        consolidate_checkpoint(tmp_path / "ckpt.partial")  # ...and is refused
    weights = consolidate_checkpoint(tmp_path / "ckpt")
    for name, value in torch.load(tmp_path / "saved.pt").items():
        assert torch.equal(weights[name], value), name


def export_body(rank, world_size, tmp, partition="rows"):
    model = BranchyNet()
    ref = ddp_reference(model)
    ref_opt = make_inner("adamw", ref.module)
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2, reduce_bucket_mb=0.001, partition=partition)
    for step in range(3):
        x, y = global_batch(rank, world_size, step, torch.float32)
        opt.backward(mse_loss(model(x), y))
        opt.step()
        mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = full_state_dict(opt)
    if partition == "params":  # the owners' state, gathered on rank 0 (the files: the rows run's)
        tmp = f"{tmp}/params"
    save_checkpoint(opt, f"{tmp}/ckpt")
    save_checkpoint(opt, f"{tmp}/ckpt-trainable-only", model_extras=False)  # as the Trainer saves
    if rank == 0:
        save_file({n: t.contiguous() for n, t in model.state_dict().items()}, f"{tmp}/base.safetensors")
    if rank != 0:
        assert full is None
        return
    expected = ref_opt.state_dict()
    assert len(full["state"]) == len(expected["state"]) == 9  # 11 trainable; `never` has no state in either
    for idx, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(full["state"][idx][key], value, rtol=1e-5, atol=1e-6)
    plain = make_inner("adamw", copy.deepcopy(model))
    plain.load_state_dict(full)  # loads into a plain torch optimizer over the same groups
    assert_params_equal(model, ref.module, "export")


@pytest.mark.slow  # test tiers: tests/test_export.py keeps the full-state path in the fast tier
def test_full_state_dict_and_consolidation(tmp_path):
    run_distributed(export_body, 3, tmp=str(tmp_path), partition="params")
    run_distributed(export_body, 3, tmp=str(tmp_path))
    out = tmp_path / "pretrained"
    subprocess.run([sys.executable, "-m", "hf_lowzero.consolidate", str(tmp_path / "ckpt"), str(out)], check=True)
    weights = load_file(out / "model.safetensors")
    fresh = BranchyNet(seed=3)
    fresh.load_state_dict(weights, strict=True)  # complete: trainable, frozen and all
    assert all(torch.equal(v, consolidate_checkpoint(tmp_path / "ckpt")[k]) for k, v in weights.items())

    # Without the model's extras, the frozen layer comes from the base weights the CLI is given.
    trainable_only = tmp_path / "ckpt-trainable-only"
    assert "zero_model_extras.safetensors" not in os.listdir(trainable_only)
    with pytest.raises(CheckpointError, match="frozen.weight"):
        consolidate_checkpoint(trainable_only)
    base = tmp_path / "base.safetensors"
    subprocess.run(
        [sys.executable, "-m", "hf_lowzero.consolidate", str(trainable_only), str(out), "--base-weights", str(base)],
        check=True,
    )
    assert load_file(out / "model.safetensors").keys() == weights.keys()
    assert all(torch.equal(v, weights[k]) for k, v in load_file(out / "model.safetensors").items())
