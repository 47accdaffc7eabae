"""Nothing outside hf_lowzero's own snapshot folders is ever removed or written: the root is a
folder of our own inside the one the user names, cleanup takes only folders that carry our marker,
and a holder refuses any path outside its folder ([Note: snapshot folder] in
hf_lowzero/snapshot/segments.py). No Ray: the holder's request handling runs on a bare holder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from hf_lowzero.snapshot import segments
from hf_lowzero.snapshot.format import write_piece
from tests.test_checkpoint import tree

TWO_HOURS_AGO = time.time() - 2 * 3600


def age(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (TWO_HOURS_AGO, TWO_HOURS_AGO))


@pytest.fixture
def named(tmp_path, monkeypatch) -> Path:
    """The folder a user names in HF_LOWZERO_SNAPSHOT_DIR, holding their own data, 2 h old."""
    named = tmp_path / "fast"
    for sub, name in [("my_dataset", "train.jsonl"), ("hf_cache", "model.safetensors")]:
        (named / sub).mkdir(parents=True)
        (named / sub / name).write_bytes(b"the user's " + name.encode())
        age(named / sub / name, named / sub)
    monkeypatch.setenv(segments.ENV, str(named))
    return named


def test_the_root_is_a_marked_folder_of_our_own_inside_the_named_one(named):
    folder = segments.node_folder("run-1", "node-a")
    root = named / "hf_lowzero_snapshots"
    assert segments.snapshot_root() == root
    assert folder == root / "run-1" / "node-a"
    assert (root / segments.ROOT_MARKER).is_file() and (root / "run-1" / segments.RUN_MARKER).is_file()
    assert sorted(p.name for p in named.iterdir()) == ["hf_cache", "hf_lowzero_snapshots", "my_dataset"]


def test_the_sweep_takes_only_our_stale_marked_run_folders(named):
    # The exact case that lost a user's data: their folders, 2 h old, beside our left-over runs.
    before = tree(named)
    for run in ["live-run", "left-over", "recent"]:
        piece = segments.node_folder(run, "node-a") / "step00000001-rank00000.piece"
        piece.write_bytes(b"x")
        if run != "recent":
            age(piece, piece.parent, piece.parent.parent, piece.parent.parent / segments.RUN_MARKER)
    root = segments.snapshot_root()
    unmarked = root / "not-ours"  # in our root, but without our marker: never taken either
    unmarked.mkdir()
    (unmarked / "keep.txt").write_text("someone else's")
    age(unmarked / "keep.txt", unmarked)

    removed = segments.sweep({"live-run"}, older_than_s=3600)

    assert removed == [root / "left-over"]
    assert [p.name for p in segments.run_folders()] == ["live-run", "recent"]
    assert (unmarked / "keep.txt").read_text() == "someone else's"
    assert {k: v for k, v in tree(named).items() if not k.startswith("hf_lowzero_snapshots")} == before


def test_a_run_folder_without_our_marker_is_never_removed(named):
    root = segments.snapshot_root()
    (root / "run-2").mkdir(parents=True)
    (root / "run-2" / "data.bin").write_bytes(b"not a piece")
    segments.remove_run_folder("run-2")
    assert (root / "run-2" / "data.bin").read_bytes() == b"not a piece"
    segments.node_folder("run-3", "node-a")
    segments.remove_run_folder("run-3")  # ours: gone
    assert not (root / "run-3").exists()


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_a_run_id_that_names_no_folder_of_its_own_is_refused(named, name):
    before = tree(named)
    with pytest.raises(ValueError, match="cannot name a snapshot folder; expected a run or node id"):
        segments.remove_run_folder(name)
    assert tree(named) == before


def test_a_relative_snapshot_dir_is_refused(monkeypatch):
    monkeypatch.setenv(segments.ENV, "snapshots")
    with pytest.raises(ValueError, match="HF_LOWZERO_SNAPSHOT_DIR='snapshots' is a relative path; expected an abs"):
        segments.snapshot_root()


# ------------------------------------------------------------------- a holder's requests


@pytest.fixture
def holder(named):
    """A holder's request handling without Ray: the actor's class, its state set as ``__init__`` sets it."""
    from hf_lowzero.ray.holder import SnapshotHolder
    from hf_lowzero.snapshot.held import HeldSnapshots

    h = object.__new__(SnapshotHolder.__ray_metadata__.modified_class)
    h.node_id, h.run_id = "node-a", "run-1"
    h.folder = segments.node_folder(h.run_id, h.node_id)
    h._held = HeldSnapshots(h.node_id, h.folder)
    return h


def piece(path: Path, step: int = 3) -> dict:
    """A piece of rank 0 in ``path``, and the request a rank sends for it (one node, no buddy)."""
    shard = {"w.master": torch.arange(64, dtype=torch.float32)}
    manifest = write_piece(shard, {}, path, step=step, rank=0, world_size=1, details={})
    return {"op": "land", "manifest": manifest.frame.wire(), "path": str(path), "buddy": None, "nodes": ["node-a"]}


def test_a_holder_keeps_a_piece_of_its_folder(holder):
    path = segments.piece_path(holder.folder, 3, 0)
    assert holder._land_request(piece(path))["error"] is None
    assert holder.index().steps[3].marks.complete and path.is_file()


def outside(named: Path) -> Path:
    return named / "my_dataset" / "train.jsonl"


def dotdot(named: Path) -> Path:
    return Path(str(segments.node_folder("run-1", "node-a")) + "/../../../my_dataset/train.jsonl")


def link(named: Path) -> Path:
    link = segments.node_folder("run-1", "node-a") / "step00000003-rank00000.piece"
    link.symlink_to(outside(named))
    return link


@pytest.mark.parametrize(
    "path, why",
    [
        (outside, "it resolves to "),
        (dotdot, "it has a '..'"),
        (link, "it is a link"),
        (lambda _: "x.piece", "not an absolute path"),
    ],
)
@pytest.mark.parametrize("frame", ["valid", "malformed"])
def test_a_holder_refuses_a_path_outside_its_folder_and_touches_nothing(holder, named, tmp_path, path, why, frame):
    request = piece(tmp_path / "elsewhere.piece")
    request["path"] = str(path(named))
    if frame == "malformed":
        request["manifest"] = {"format": "something else"}
    before = tree(named)
    error = holder._land_request(request)["error"]
    assert error.startswith(f"this holder takes only files directly in its folder {os.path.realpath(holder.folder)}; ")
    assert why in error and "A rank sends the path piece_path(" in error
    assert tree(named) == before and outside(named).read_bytes() == b"the user's train.jsonl"
    assert holder.index().steps == {}


def test_a_malformed_frame_in_its_folder_is_refused_and_its_file_freed(holder):
    path = segments.piece_path(holder.folder, 3, 0)
    request = piece(path)
    request["manifest"]["format_version"] = 99
    assert "snapshot format version" in holder._land_request(request)["error"]
    assert not path.exists() and holder.index().steps == {}
