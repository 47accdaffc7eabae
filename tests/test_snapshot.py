"""Memory snapshots without Ray: a snapshot is the checkpoint of the same step, kept as pieces.

A Trainer run at W=2 takes a snapshot's pieces at step SNAP (exactly what a holder keeps) and also
saves its storage checkpoint there. Each rank's shard in its piece is byte for byte the rank file of
that checkpoint. The pieces, written back into a folder as a restore does, resume at W=2 to the
uninterrupted run's params, optimizer state and loss curve (dropout on: the RNG states come back
too), and at W=1 (resharded) to what the storage checkpoint resumes to. A piece that changed on the
way is refused. Plus the pure decisions: buddy nodes, the snapshot schedule and its auto interval.
"""

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_lowzero import LowZeroTrainer, consolidate_checkpoint
from hf_lowzero.checkpoint.layout import CHECKSUM_CHUNK_NUMEL, META_FILE, TRAINER_SUBDIR, rank_file_name
from hf_lowzero.snapshot import MARKER_FILE, ShardStager, payload_error, write_part, write_zero_metadata
from hf_lowzero.snapshot.format import encode_piece, write_piece
from hf_lowzero.snapshot.frame import Frame, Manifest
from hf_lowzero.snapshot.stager import _staging_like
from hf_lowzero.testing import run_distributed
from hf_lowzero.trainer.snapshot_files import rng_from_json, rng_to_json, trainer_manifest, write_trainer_files
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.trainer_runs import make_args

STEPS, SNAP = 6, 3


class KeepPieces(TrainerCallback):
    """At step ``step``, this rank's snapshot piece as ``MemorySnapshots`` makes it, kept in files.
    The piece is staged at ``step`` and encoded only once training ended, later than any background
    thread would: what it describes must be the state of ``step`` ([Note: described off the loop])."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def after_log_save_evaluate(self, trainer) -> None:
        if trainer.state.global_step != self.step:
            return
        self.stager = ShardStager(trainer.zero_optimizer)
        self.staged = self.stager.stage(self.step)
        self.fields = trainer_manifest(trainer, include_state=dist.get_rank() == 0)

    def on_train_end(self, args, state, control, **kwargs):
        assert state.global_step > self.step  # the steps after the snapshot ran before it is encoded
        rank = dist.get_rank()
        piece = self.staged.encode(**self.fields)
        self.stager.close()
        kept = {"frame": piece.manifest.frame.wire(), "details": piece.manifest.details}
        (self.out / f"manifest_{rank}.json").write_text(json.dumps(kept))
        (self.out / f"payload_{rank}.bin").write_bytes(piece.payload)


def _args(out: Path, **overrides):
    return make_args(out, 2, max_steps=STEPS, gradient_accumulation_steps=1, **overrides)


def _train(rank, world_size, out, resume=None, keep=None):
    out = Path(out)
    args = _args(out, save_strategy="steps", save_steps=SNAP)
    callbacks = [KeepPieces(SNAP, Path(keep))] if keep else []
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    if rank == 0:
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        (out / "losses.json").write_text(json.dumps(losses))


def _restore(rank, world_size, keep, folder):
    """What ``hf_lowzero.ray.restore`` does on each node, from pieces kept in files."""
    keep, checkpoint = Path(keep), Path(folder) / f"checkpoint-{SNAP}"
    manifests = {int(p.stem.split("_")[1]): _manifest(p) for p in keep.glob("manifest_*.json")}
    mine = [rank] if world_size == len(manifests) else sorted(manifests)  # a resize reads every saved rank
    for j in mine:
        write_part(checkpoint / TRAINER_SUBDIR, manifests[j].frame, "shard", _part(keep, manifests[j], "shard"))
    if rank == 0:
        if "extras" in manifests[0].frame.parts:
            write_part(checkpoint / TRAINER_SUBDIR, manifests[0].frame, "extras", _part(keep, manifests[0], "extras"))
        write_zero_metadata(checkpoint / TRAINER_SUBDIR, manifests)
    write_trainer_files(checkpoint, {j: m.as_json() for j, m in manifests.items()}, mine, common=rank == 0)
    dist.barrier()
    _train(rank, world_size, Path(folder) / "out", resume=str(checkpoint))


def _header_and_data(blob: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (its tensors and checksums) and data bytes: what must be equal
    (the header's key order is not fixed from one write to the next)."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]), blob[8 + size :]


def _manifest(path: Path) -> Manifest:
    kept = json.loads(path.read_text())
    return Manifest(Frame.from_wire(kept["frame"]), kept["details"])


def _part(keep: Path, manifest: Manifest, name: str) -> bytes:
    start, end = manifest.frame.parts[name]
    return (keep / f"payload_{manifest.frame.rank}.bin").read_bytes()[start:end]


@pytest.fixture(scope="module")
def snapshotted(tmp_path_factory):
    """The uninterrupted W=2 run, which also kept the pieces of step SNAP and its storage checkpoint."""
    root = tmp_path_factory.mktemp("snapshot")
    (root / "pieces").mkdir()
    run_distributed(_train, 2, out=str(root / "full"), keep=str(root / "pieces"))
    return root


def _final(out: Path) -> tuple[dict, dict]:
    params = consolidate_checkpoint(out / f"checkpoint-{STEPS}" / TRAINER_SUBDIR)
    return params, json.loads((out / "losses.json").read_text())


def test_a_pieces_shard_is_the_rank_file_of_the_checkpoint_of_the_same_step(snapshotted):
    checkpoint = snapshotted / "full" / f"checkpoint-{SNAP}" / TRAINER_SUBDIR
    for rank in range(2):
        manifest = _manifest(snapshotted / "pieces" / f"manifest_{rank}.json")
        assert (manifest.frame.step, manifest.frame.rank, manifest.frame.world_size) == (SNAP, rank, 2)
        piece = _header_and_data(_part(snapshotted / "pieces", manifest, "shard"))
        assert piece == _header_and_data((checkpoint / rank_file_name(rank, 2)).read_bytes())
    # No model weights in memory: params are the masters cast down (and frozen ones the model's as built).
    assert "model.safetensors" not in manifest.details and set(manifest.frame.parts) <= {"shard", "extras", "details"}
    # Described after training went on ([Note: described off the loop]): still step SNAP's state.
    stored = json.loads((checkpoint / META_FILE).read_text())
    described = _manifest(snapshotted / "pieces" / "manifest_0.json").details["zero_meta"]
    for key in ["params", "param_groups", "loss_scaler", "skipped_steps", "stage", "world_size"]:
        assert described[key] == stored[key], key
    steps = {json.dumps(record["scalar_state"]["step"]) for record in described["params"].values()}
    assert steps == {json.dumps({"tensor": float(SNAP), "dtype": "float32"})}  # AdamW's, advanced in place since


def test_pieces_resume_to_the_uninterrupted_run(snapshotted, tmp_path):
    run_distributed(_restore, 2, keep=str(snapshotted / "pieces"), folder=str(tmp_path))
    assert (tmp_path / f"checkpoint-{SNAP}" / MARKER_FILE).is_file()
    expected_params, expected_losses = _final(snapshotted / "full")
    params, losses = _final(tmp_path / "out")
    assert losses == expected_losses  # steps 1-SNAP from the snapshot's trainer state, the rest trained again
    assert len(losses) == STEPS
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=name)
    # The optimizer state too: the final checkpoints' shards hold the same tensors, bit for bit.
    for rank in range(2):
        name = f"checkpoint-{STEPS}/{TRAINER_SUBDIR}/{rank_file_name(rank, 2)}"
        resumed = _header_and_data((tmp_path / "out" / name).read_bytes())
        assert resumed == _header_and_data((snapshotted / "full" / name).read_bytes()), name


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_pieces_reshard_to_one_rank_like_the_storage_checkpoint(snapshotted, tmp_path):
    run_distributed(_restore, 1, keep=str(snapshotted / "pieces"), folder=str(tmp_path / "memory"))
    storage = snapshotted / "full" / f"checkpoint-{SNAP}"
    run_distributed(_train, 1, out=str(tmp_path / "storage"), resume=str(storage))
    memory_params, memory_losses = _final(tmp_path / "memory" / "out")
    storage_params, storage_losses = _final(tmp_path / "storage")
    # The params bit for bit; the logged losses to float32's rounding. Two fresh one-rank processes
    # (two threads each) have computed the first resumed forward one ulp apart, from params and a
    # batch equal bit for bit (about 1 run in 10 here, in CI too; the first output to differ was GPT-2's
    # GELU in the first block); the clipped AdamW step does not carry it into the params.
    assert memory_losses.keys() == storage_losses.keys()
    for step, loss in storage_losses.items():
        assert memory_losses[step] == pytest.approx(loss, rel=1e-6, abs=0), step
    for name, value in storage_params.items():
        torch.testing.assert_close(memory_params[name], value, rtol=0, atol=0, msg=name)


def test_a_piece_that_changed_on_the_way_is_refused(snapshotted):
    frame = _manifest(snapshotted / "pieces" / "manifest_1.json").frame
    payload = bytearray((snapshotted / "pieces" / "payload_1.bin").read_bytes())
    assert payload_error(frame, payload) is None
    for part in ["shard", "details"]:
        flipped = bytearray(payload)
        flipped[frame.parts[part][1] - 5] ^= 0x40
        error = payload_error(frame, flipped)
        assert error.startswith(f"part {part!r}: ") and error.endswith("does not match its checksum")
    assert "bytes, the manifest describes" in payload_error(frame, payload[:-10])
    for changed, error in [({"format": "pickle"}, "not an hf_lowzero snapshot piece"),
                           ({"format_version": 2}, "snapshot format version 2, expected 3"),
                           ({"parts": {"shard": frame.parts["shard"]}}, "a piece without its details"),
                           ({"step": None}, "not an hf_lowzero snapshot piece (TypeError")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(error)):
            Frame.from_wire({**frame.wire(), **changed})


def test_a_pieces_details_travel_in_its_file_and_only_its_frame_as_json(snapshotted, tmp_path):
    # [Note: details in the file]: what a holder is sent is a few hundred bytes, whatever the log's
    # length; the whole manifest comes back from the file, and changed details are refused.
    from hf_lowzero.snapshot.checks import piece_file_error
    from hf_lowzero.snapshot.format import DETAILS_ALIGN
    from hf_lowzero.snapshot.frame import read_manifest

    manifest = _manifest(snapshotted / "pieces" / "manifest_0.json")
    path = tmp_path / "piece"
    path.write_bytes((snapshotted / "pieces" / "payload_0.bin").read_bytes())
    frame = manifest.frame
    wire = frame.wire()
    assert set(wire) == {"format", "format_version", "step", "rank", "world_size", "parts", "details_crc32"}
    assert Frame.from_wire(json.loads(json.dumps(wire))) == frame
    assert len(json.dumps(wire)) < 400 < len(json.dumps(manifest.as_json()))
    assert piece_file_error(frame, path) is None
    assert read_manifest(frame, path) == manifest
    start, end = frame.parts["details"]
    assert (end - start) % DETAILS_ALIGN == 0 and end == path.stat().st_size
    data = bytearray(path.read_bytes())
    data[start + 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(ValueError, match="do not match their checksum"):
        read_manifest(frame, path)


def test_a_piece_staged_as_one_buffer_is_the_piece_written_tensor_by_tensor(tmp_path):
    """[Note: packed staging]: the staging buffer laid out as the file's data gives the same bytes
    (tensors, checksums, header) as the tensors written one by one; chunks and blocks of several
    megabytes, and dtypes of every size."""
    torch.manual_seed(0)
    shard = {
        "w.master": torch.randn(CHECKSUM_CHUNK_NUMEL * 2 + 7),  # three chunks, over a megabyte
        "w.exp_avg": torch.randn(513, 3),
        "b.master": torch.randn(5).to(torch.bfloat16),
        "b.count": torch.arange(3, dtype=torch.int64),
        "e.empty": torch.zeros(0),
    }
    stager_buffers, data = _staging_like(shard)
    assert data is not None
    for key, t in shard.items():
        stager_buffers[key].copy_(t)
    which = {"step": 3, "rank": 0, "world_size": 1, "details": {}}
    one_by_one = write_piece(shard, {}, tmp_path / "a.piece", **which)
    packed = write_piece(stager_buffers, {}, tmp_path / "b.piece", **which, shard_data=memoryview(data.numpy()))
    assert packed == one_by_one
    assert (tmp_path / "b.piece").read_bytes() == (tmp_path / "a.piece").read_bytes()
    assert payload_error(packed.frame, (tmp_path / "b.piece").read_bytes()) is None  # every checksum checked
    data[len(data) // 2] ^= 1  # a changed byte: the checksums of the staged data are its own
    piece = encode_piece(stager_buffers, {}, **which, shard_data=memoryview(data.numpy()))
    assert piece.payload != (tmp_path / "a.piece").read_bytes()
    assert payload_error(piece.manifest.frame, piece.payload) is None


def test_a_piece_written_from_the_live_shard_is_the_piece_written_tensor_by_tensor(tmp_path):
    """[Note: written from the live shard]: the live tensors' bytes copied into the mapped file in
    one call, then checksummed there, give the same file as the tensors written one by one, over a
    kept mapping written again with other values, and over a spare file; bytes that do not fill
    the file's data are refused, and no file is left."""
    from hf_lowzero.snapshot.copy_plan import _file_bytes
    from hf_lowzero.snapshot.mapped import MappedFiles
    from hf_lowzero.snapshot.segments import recycle

    torch.manual_seed(0)
    shard = {
        "w.master": torch.randn(CHECKSUM_CHUNK_NUMEL * 2 + 7),
        "w.exp_avg": torch.randn(513, 3),
        "b.master": torch.randn(5).to(torch.bfloat16),
        "b.count": torch.arange(3, dtype=torch.int64),
        "e.empty": torch.zeros(0),
    }
    live = _file_bytes(shard)
    which = {"rank": 0, "world_size": 1, "details": {}}
    files = MappedFiles()
    for step in range(3):  # the same file mapped again, then a spare taken over
        for t in shard.values():
            t.add_(1)  # the live shard changed in place: the views see it
        path = tmp_path / f"live{step}.piece"
        written = write_piece(shard, {}, path, step=step, **which, spares=tmp_path, files=files, shard_bytes=live)
        expected = write_piece(shard, {}, tmp_path / "expected.piece", step=step, **which)
        assert written == expected
        assert path.read_bytes() == (tmp_path / "expected.piece").read_bytes()
        assert payload_error(written.frame, path.read_bytes()) is None
        (tmp_path / "expected.piece").unlink()
        recycle(path, keep_at_most=1)  # the next write takes this file over
    assert _file_bytes({"t": torch.randn(4, 4).t()}) is None  # not contiguous: the shard is copied instead
    with pytest.raises(ValueError, match="shard's bytes"):
        write_piece(shard, {}, tmp_path / "short.piece", step=3, **which, shard_bytes=live[:-2])
    assert not (tmp_path / "short.piece").exists()
    files.close()


def test_rng_states_survive_json():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = rng_to_json(cuda_all=False)
    json.loads(json.dumps(state))  # plain JSON
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restored = rng_from_json(state)
    random.setstate(restored["python"]), np.random.set_state(restored["numpy"])
    torch.random.set_rng_state(restored["cpu"])
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_buddy_nodes_put_each_ranks_copy_on_the_next_node():
    from hf_lowzero.ray.snapshot_plan import buddy_nodes

    assert buddy_nodes(["a", "a", "b", "b"]) == ["b", "b", "a", "a"]
    assert buddy_nodes(["a", "b", "c"]) == ["b", "c", "a"]
    assert buddy_nodes(["b", "a", "b"]) == ["a", "b", "a"]  # order of first appearance
    assert buddy_nodes(["a", "a"]) == [None, None]
    for nodes in (["a", "b"], ["x", "y", "x", "z", "y"]):
        assert all(own != buddy for own, buddy in zip(nodes, buddy_nodes(nodes)))


def test_snapshot_schedule_fixed_and_auto():
    from hf_lowzero.ray.snapshot_plan import AUTO_OVERHEAD, PROBE_GAP, WARMUP, SnapshotSchedule, check_every

    fixed = SnapshotSchedule(5)
    assert [s for s in range(1, 21) if fixed.due(s)] == [5, 10, 15, 20]
    assert fixed.settled and not any(fixed.decides(s) for s in range(1, 21))
    auto = SnapshotSchedule("auto")
    auto.start(10)  # resumed after step 10: it measures its own steps again
    warmup, probe = 10 + WARMUP + 1, 10 + WARMUP + 1 + PROBE_GAP
    assert not any(auto.due(s) for s in range(11, warmup)) and auto.due(warmup)
    for seconds in (0.50, 0.10, 0.11, 0.09):  # the first (compilation) is not the median
        auto.observe_step(seconds, busy=False)
    assert auto.step_s == pytest.approx(0.105)
    auto.taken(warmup, auto.proposed_interval())
    assert [s for s in range(warmup + 1, probe + 1) if auto.due(s)] == [probe]  # the probe
    auto.observe_snapshot(0.5, busy_step_s=[1.0])  # the warm-up snapshot: one-time costs, not counted
    assert auto.cost_s is None
    auto.taken(probe, auto.proposed_interval())
    assert not auto.due(probe + 1) and auto.decides(probe + 1)  # waits for the probe, then decides
    auto.observe_snapshot(0.004, busy_step_s=[0.125, 0.105])  # 4 ms stopped + 20 ms slower steps
    assert auto.cost_s == pytest.approx(0.024)
    assert auto.proposed_interval() == math.ceil(0.024 / (AUTO_OVERHEAD * 0.105)) == 12
    auto.decided(12)
    assert auto.settled and [s for s in range(probe + 2, 60) if auto.due(s)][:1] == [probe + 12]  # from the probe
    assert auto.overhead() == pytest.approx(0.024 / (12 * 0.105))
    quick = SnapshotSchedule("auto")
    quick.observe_step(0.1, busy=False)
    quick.observe_snapshot(1.0, busy_step_s=[])  # the warm-up one
    quick.observe_snapshot(0.0005, busy_step_s=[0.095, 0.1])  # faster than the median: noise, not a gain
    assert quick.cost_s == pytest.approx(0.0005)
    quick.decided(quick.proposed_interval())
    assert quick.interval == 1 and [s for s in range(1, 12) if quick.due(s)][:1] == [WARMUP + 1 + PROBE_GAP + 2]
    assert check_every("7") == 7 and check_every(None) is None and check_every("auto") == "auto"
    assert check_every("off") is None and check_every("None") is None
    for bad in (0, -1, "often", 2.5, True):
        with pytest.raises(ValueError, match="snapshot_every"):
            check_every(bad)


def test_the_ray_jobs_snapshot_flag():
    pytest.importorskip("ray")
    from hf_lowzero.recipes.clm_ray import RayFinetuneConfig

    assert RayFinetuneConfig().snapshots == "auto"
    assert RayFinetuneConfig(snapshot_every="off").snapshots is None
    assert RayFinetuneConfig(snapshot_every="4").snapshots == 4
    assert RayFinetuneConfig(zero_stage=0).snapshots is None  # no shards to keep without ZeRO
    with pytest.raises(ValueError, match="snapshot_every"):
        RayFinetuneConfig(snapshot_every="0")
