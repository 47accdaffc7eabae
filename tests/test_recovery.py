"""Recovery from peers' memory on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``: each
node a raylet of its own; removing one kills its processes, its snapshot holder included).

Every run takes a memory snapshot at every step, saves to storage every SAVE steps, and fails
between two storage checkpoints (after step KILL_AT). Each ends like the uninterrupted run (params,
optimizer state, loss curve: the same training in plain gloo ranks, without Ray) and says where it
resumed:
- a killed worker process resumes from its own node's memory (no piece crosses nodes), while a
  snapshot of another run sits newer on the same node, unseen;
- a failure while a snapshot is being taken (torn: landed, never marked) resumes the one before,
  whether the stop wrote the pieces (on the host) or a background thread did (as on a GPU);
- a killed node resumes from the buddy copies, its replacement worker on a fresh node fetching
  over the network;
- a node lost together with its buddy falls back to storage and says why;
- a corruption that an integrity check catches rolls back to the snapshot of the step before
  (verified), and the run ends like the uninterrupted one; a fault that repeats on one node
  stops the run, naming the rank and the node.
No holder outlives its run: after success, and after a run that fails for good.
(An elastic run that loses a node and goes on from memory, resharded 2 -> 1, then grows back to 2
from memory, is ``tests/test_exact_ray.py``'s, which checks it bit for bit.)
"""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_lowzero.ray import InjectWorkerFailure  # noqa: E402
from hf_lowzero.ray.holder import SnapshotHolder  # noqa: E402
from hf_lowzero.ray.holder_lifetime import NAMESPACE, all_holder_names  # noqa: E402
from hf_lowzero.ray.snapshots import snapshot_takers  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, build_trainer  # noqa: E402
from hf_lowzero.snapshot import encode_piece  # noqa: E402
from hf_lowzero.snapshot.protocol import HeldStep, StepMarks  # noqa: E402
from hf_lowzero.snapshot.segments import run_folders  # noqa: E402
from tests import ray_clusters  # noqa: E402
from tests.ray_clusters import with_slots  # noqa: E402
from tests.ray_holds import HOLD_TIMEOUT_S, final_tensors, loss_curve  # noqa: E402
from tests.ray_reference import checkpoint_without_ray  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster, pytest.mark.ray_nodes]  # tests/tiers.py
STEPS, SAVE, KILL_AT = 10, 4, 6


@pytest.fixture(scope="module")
def cluster():
    """A head node (no worker slot) and worker nodes of one worker slot each (``slot_nodes``), which
    the tests add and remove."""
    with ray_clusters.slot_cluster(0) as (cluster, nodes):
        cluster.slot_nodes = nodes
        yield cluster


def config(name: str, tmp_path: Path, model: tuple[str, str], **overrides) -> RayFinetuneConfig:
    model_dir, corpus = model
    fields = dict(num_workers=2, max_steps=STEPS, save_steps=SAVE, snapshot_every=1, per_device_train_batch_size=4,
                  global_batch_size=8, model_name_or_path=model_dir, train_file=corpus, num_to_keep=3,
                  resources_per_worker='{"worker_slot": 1}', storage_path=str(tmp_path), name=name,
                  resize_check_interval_s=1)  # fmt: skip
    return RayFinetuneConfig(**(fields | overrides))


class HoldForNodeKill(TrainerCallback):
    """Once per run, at step ``step`` after its snapshot landed on every holder: rank 0 writes every
    rank's node id to ``signal``, and every rank waits for the test to kill nodes."""

    def __init__(self, step: int, signal: Path) -> None:
        self.step, self.signal = step, signal

    def after_log_save_evaluate(self, trainer) -> None:
        if trainer.state.global_step != self.step or self.signal.exists():
            return
        # As InjectWorkerFailure: Ray registered the storage checkpoints so far, every snapshot landed.
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        for taker in snapshot_takers():
            taker.wait()
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
        if dist.get_rank() == 0:  # whole or not at all: the test reads it as soon as it exists
            written = self.signal.with_name(self.signal.name + ".partial")
            written.write_text(json.dumps(nodes))
            written.rename(self.signal)
        time.sleep(HOLD_TIMEOUT_S)
        raise RuntimeError(f"no node was killed within {HOLD_TIMEOUT_S} s of step {self.step}")


def fit_killing_nodes(cluster, trainer, signal: Path, kill_ranks: list[int], fresh_nodes: int):
    """Fit; when the run holds, kill the nodes of ``kill_ranks`` and add ``fresh_nodes`` new ones."""
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(trainer.fit)
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not signal.exists():
            assert not run.done(), f"the run ended before it held: {run.result()}"
            assert time.monotonic() < deadline, "the run never held"
            time.sleep(0.2)
        nodes = json.loads(signal.read_text())
        doomed = {nodes[r] for r in kill_ranks}
        for node in [n for n in cluster.slot_nodes if n.node_id in doomed]:
            cluster.slot_nodes.remove(node)
            cluster.remove_node(node)
        for _ in range(fresh_nodes):
            cluster.slot_nodes.append(ray_clusters.add_slot_node(cluster))
        return run.result(timeout=HOLD_TIMEOUT_S)


def assert_like_uninterrupted(result, clean: Path) -> None:
    assert result.error is None
    curve, expected = loss_curve(result), loss_curve(clean)
    assert [h["step"] for h in curve] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in curve] == pytest.approx([h["loss"] for h in expected], rel=1e-6)
    tensors, expected_tensors = final_tensors(result), final_tensors(clean)
    assert set(tensors) == set(expected_tensors)
    for key, value in expected_tensors.items():
        torch.testing.assert_close(tensors[key], value, rtol=1e-5, atol=1e-7, msg=key)


def assert_no_holders_left(timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while all_holder_names() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all_holder_names() == [], "snapshot holders outlived their run"
    assert run_folders() == [], "snapshot files outlived their run"


@pytest.fixture(scope="module")
def clean(no_dropout_model, tmp_path_factory) -> Path:
    """The uninterrupted run: the same training in two plain gloo ranks, without Ray (so without
    snapshots either); its final Trainer checkpoint."""
    out = tmp_path_factory.mktemp("clean")
    return checkpoint_without_ray(config("clean", out, no_dropout_model), out, world_size=2, steps=STEPS)


def decoy_holder(node_id: str):
    """A holder of another run on ``node_id`` with a complete snapshot far newer than ours."""
    holder = SnapshotHolder.options(name=f"another-run:{node_id}", namespace=NAMESPACE, lifetime="detached",
                                    scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                                        node_id, soft=False)).remote(node_id, None, "another-run")  # fmt: skip
    piece = encode_piece({"master/w": torch.ones(4)}, {}, step=999, rank=0, world_size=1, details={"records": {}})
    assert ray.get(holder.put.remote(piece.manifest.frame, piece.payload)) is None
    ray.get(holder.mark.remote(999, 0, 1))
    return holder


def test_a_killed_process_resumes_from_its_own_nodes_memory_unseen_by_other_runs(cluster, clean, no_dropout_model,
                                                                                   tmp_path):  # fmt: skip
    with_slots(cluster, 2)
    decoy = decoy_holder(cluster.slot_nodes[0].node_id)
    try:
        result = build_trainer(config("process", tmp_path, no_dropout_model, inject_failure_at_step=KILL_AT)).fit()
        # Killed at the end of step KILL_AT, before its snapshot: step KILL_AT - 1's, from its own node.
        m = result.metrics
        assert (m["resumed_from"], m["resumed_from_step"], m["newest_storage_step"]) == ("memory", KILL_AT - 1, SAVE)
        assert m["memory_pieces_from_other_nodes"] == 0
        assert_like_uninterrupted(result, clean)
        assert ray.get(decoy.index.remote()).steps == {999: HeldStep(StepMarks(1, frozenset({0})), frozenset({0}))}
    finally:
        ray.get(decoy.close.remote())
        ray.kill(decoy)
    assert_no_holders_left()


class SnapshotWriter(TrainerCallback):
    """Who writes the pieces: the stop ([Note: written at the stop] in ``hf_lowzero/ray/snapshots.py``)
    or the background thread a GPU node uses; each worker records at step ``at`` whether a snapshot
    thread runs in its process."""

    def __init__(self, background: bool, record: Path, at: int) -> None:
        self.background, self.record, self.at = background, record, at

    def on_train_begin(self, args, state, control, **kwargs):
        for taker in snapshot_takers():
            taker.background_writes = self.background

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:  # snapshots of the steps before were taken
            threads = [t.name for t in threading.enumerate() if t.name.startswith("hf_lowzero_snapshot")]
            (self.record / f"rank{dist.get_rank()}-pid{os.getpid()}").write_text(json.dumps(bool(threads)))


@pytest.mark.parametrize("background", [False, True], ids=["written at the stop", "written in the background"])
def test_a_torn_snapshot_is_never_used(cluster, clean, no_dropout_model, tmp_path, background):
    with_slots(cluster, 2)
    tear = InjectWorkerFailure(KILL_AT, tmp_path / "marker", during="snapshot")
    record = tmp_path / "writers"
    record.mkdir()
    writer = SnapshotWriter(background, record, at=KILL_AT - 1)
    result = build_trainer(config("torn", tmp_path, no_dropout_model), trainer_callbacks=[writer, tear]).fit()
    assert (tmp_path / "marker").exists()
    threads = {f.name: json.loads(f.read_text()) for f in record.iterdir()}
    assert len(threads) >= 2 and set(threads.values()) == {background}, threads  # each attempt's workers
    assert (result.metrics["resumed_from"], result.metrics["resumed_from_step"]) == ("memory", KILL_AT - 1)
    assert_like_uninterrupted(result, clean)
    assert_no_holders_left()


def test_a_killed_node_resumes_from_the_buddy_copies_on_a_fresh_node(cluster, clean, no_dropout_model, tmp_path):
    with_slots(cluster, 2)
    signal = tmp_path / "held"
    trainer = build_trainer(
        config("node", tmp_path, no_dropout_model), trainer_callbacks=[HoldForNodeKill(KILL_AT, signal)]
    )
    result = fit_killing_nodes(cluster, trainer, signal, kill_ranks=[1], fresh_nodes=1)
    m = result.metrics
    assert (m["resumed_from"], m["resumed_from_step"], m["newest_storage_step"]) == ("memory", KILL_AT, SAVE)
    assert m["memory_pieces_from_other_nodes"] >= 1  # the worker on the fresh node fetched over the network
    assert_like_uninterrupted(result, clean)
    assert_no_holders_left()


def test_a_node_lost_with_its_buddy_falls_back_to_storage(cluster, no_dropout_model, tmp_path):
    with_slots(cluster, 3)  # nodes A, B, C keep their copies on B, C, A: losing A and B loses A's shard
    signal = tmp_path / "held"
    three = config("buddies", tmp_path, no_dropout_model, num_workers=3, global_batch_size=None)
    trainer = build_trainer(three, trainer_callbacks=[HoldForNodeKill(KILL_AT, signal)])
    result = fit_killing_nodes(cluster, trainer, signal, kill_ranks=[0, 1], fresh_nodes=2)
    assert result.error is None
    m = result.metrics
    assert (m["resumed_from"], m["resumed_from_step"]) == ("storage", SAVE)
    assert "their node and its buddy node are both gone" in m["memory_not_used"]
    assert [h["step"] for h in loss_curve(result)] == list(range(1, STEPS + 1))
    assert_no_holders_left()


def test_a_holder_exits_once_its_runs_controller_is_gone(cluster):
    """The last line of [Note: holder lifetime]: a driver killed with its run leaves no holder."""
    with_slots(cluster, 1)
    controller = ray.remote(num_cpus=0)(_StandIn).remote()
    node = cluster.slot_nodes[0].node_id
    holder = SnapshotHolder.options(name=f"watched:{node}", namespace=NAMESPACE, lifetime="detached").remote(
        node, controller._actor_id.hex(), run_id="watched", watch_interval_s=0.2
    )
    assert ray.get(holder.index.remote()).steps == {}
    time.sleep(2)
    assert all_holder_names() == [f"watched:{node}"], "a holder of a live run exited"
    ray.kill(controller)
    assert_no_holders_left()


class _StandIn:
    """Stands in for a run's Ray Train controller."""


def test_an_integrity_failure_rolls_back_to_the_verified_snapshot_and_ends_like_the_clean_run(
    cluster, clean, no_dropout_model, tmp_path
):
    with_slots(cluster, 2)
    run = config("rollback", tmp_path, no_dropout_model, verify_every=1, on_mismatch="rollback",
                 inject_corruption_at_step=KILL_AT)  # fmt: skip
    result = build_trainer(run).fit()
    m = result.metrics
    assert (m["resumed_from"], m["resumed_from_step"]) == ("memory", KILL_AT - 1)  # the step before the fault
    assert (m["integrity_failures"], m["rolled_back_to"]) == (1, KILL_AT - 1)
    assert m["integrity_checks"] == STEPS - (KILL_AT - 1)  # every step of the replay was checked
    assert_like_uninterrupted(result, clean)
    assert_no_holders_left()


class CorruptEveryAttempt(TrainerCallback):
    """A fault that is not transient: a bad GPU on node ``node``. Whichever rank runs there has its
    reduced rows go wrong at ``step``, on every attempt that reaches it (Ray may place the ranks on
    the nodes in another order when it restarts the group: the fault stays with the node)."""

    def __init__(self, step: int, node: str) -> None:
        self.step, self.node = step, node

    def on_train_begin(self, args, state, control, **kwargs):
        from hf_lowzero.zero.integrity.reduction_faults import Fault, inject

        if ray.get_runtime_context().get_node_id() == self.node:
            self.injecting = inject(Fault("flip", rank=dist.get_rank(), step=self.step, bucket=0, bit=28, times=99))
            self.injecting.__enter__()


def test_a_fault_that_repeats_on_one_node_stops_the_run_and_names_it(cluster, no_dropout_model, tmp_path):
    with_slots(cluster, 2)
    bad = cluster.slot_nodes[1].node_id
    run = config("repeats", tmp_path, no_dropout_model, verify_every=1, on_mismatch="rollback", max_failures=1)
    with pytest.raises(ray.train.TrainingFailedError) as failed:
        build_trainer(run, trainer_callbacks=[CorruptEveryAttempt(KILL_AT, bad)]).fit()
    message = str(failed.value)
    named = re.search(r"failed a check before: rank\(s\) \[\d\] on node\(s\) \['(\w+)'\]", message)
    assert named is not None and named.group(1) == bad and "Leave those nodes out" in message, message
    # A run that failed for good: its holders were released by the run's ReleaseSnapshots callback,
    # while the error (and through its traceback the run's controller) is still alive here.
    assert_no_holders_left()
