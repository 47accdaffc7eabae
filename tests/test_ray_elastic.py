"""Elastic Ray Train on a local multi-node cluster: a run started at 2 workers loses a node, goes
on at 1 worker from its last checkpoint (resharded 2 -> 1), grows back to 2 when the node returns
(resharded 1 -> 2), and its loss curve is the one of a fixed 2-worker run, because
``global_batch_size`` keeps every step's samples the same. Plus the flags' parsing and validation.

Capacity is a custom resource: each worker needs one ``worker_slot`` and each extra node of a
``ray.cluster_utils.Cluster`` (a raylet of its own on this machine) has one. Removing a node kills
the worker on it; adding one lets Ray's elastic policy grow the group. A callback holds the workers
at a checkpoint step until the test changed capacity, so every change happens at a known step.
With ``--reduction exact`` the same run ends with the fixed run's bits: ``tests/test_exact_ray.py``.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")

from hf_lowzero.ray.elastic import accumulation_for_global_batch, parse_num_workers  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, build_trainer  # noqa: E402
from tests import ray_clusters  # noqa: E402
from tests.ray_checkpoints import missing_files, saved_world_size, step_of  # noqa: E402
from tests.ray_holds import HOLD_TIMEOUT_S, HoldAt, loss_curve, wait_for  # noqa: E402
from tests.ray_reference import losses_without_ray  # noqa: E402
from tests.tiers import ray_run  # noqa: E402

STEPS, SAVE, GLOBAL_BATCH = 12, 4, 8
SHRINK_AT, GROW_AT = SAVE, 2 * SAVE  # checkpoint steps after which capacity changes


@pytest.fixture(scope="module")
def slot_cluster():
    """A head node (no worker slot) and two nodes with one worker slot each."""
    with ray_clusters.slot_cluster(2) as (cluster, nodes):
        yield cluster, nodes


@ray_run
def test_elastic_run_shrinks_and_grows_back_with_a_continuous_loss_curve(slot_cluster, no_dropout_model, tmp_path):
    cluster, nodes = slot_cluster
    model_dir, corpus = no_dropout_model
    common = dict(max_steps=STEPS, save_steps=SAVE, global_batch_size=GLOBAL_BATCH, model_name_or_path=model_dir,
                  train_file=corpus, resources_per_worker='{"worker_slot": 1}', storage_path=str(tmp_path),
                  num_to_keep=STEPS // SAVE, resize_check_interval_s=1)  # fmt: skip
    # The reference: the same training at a fixed 2 workers, without Ray (the sweep test in
    # test_autoscaling.py shows a Ray worker and a plain gloo rank train bit for bit alike).
    reference = losses_without_ray(RayFinetuneConfig(num_workers=2, name="fixed", **common), tmp_path / "fixed", 2)

    signals = tmp_path / "signals"
    signals.mkdir()
    hold = HoldAt({SHRINK_AT, GROW_AT}, signals)
    trainer = build_trainer(RayFinetuneConfig(num_workers=(1, 2), name="elastic", **common), trainer_callbacks=[hold])
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(trainer.fit)
        wait_for(signals / f"hold_{SHRINK_AT}", run)
        cluster.remove_node(nodes.pop())  # capacity lost: the worker on that node dies with it
        wait_for(signals / f"hold_{GROW_AT}", run)
        nodes.append(ray_clusters.add_slot_node(cluster))  # capacity back
        elastic = run.result(timeout=HOLD_TIMEOUT_S)
    assert elastic.error is None

    # Each attempt resumed the previous one's last checkpoint, resharded to its own world size.
    registered = sorted(elastic.best_checkpoints, key=lambda cm: step_of(cm[0].path))
    assert all(missing_files(c.path) == [] for c, _ in registered)
    assert [(step_of(c.path), saved_world_size(c.path)) for c, _ in registered] == [(4, 2), (8, 1), (12, 2)]
    assert [(m["world_size"], m["resumed_from_step"]) for _, m in registered] == [(2, 0), (1, 4), (2, 8)]
    assert {m["global_batch_size"] for _, m in registered} == {GLOBAL_BATCH}

    # One continuous curve: every step once, in order, at the world size of its attempt, and the
    # same losses as the fixed-size run (same samples per step at either size).
    curve = loss_curve(elastic)
    assert [h["step"] for h in curve] == list(range(1, STEPS + 1))
    assert [h["world_size"] for h in curve] == [2] * SHRINK_AT + [1] * (GROW_AT - SHRINK_AT) + [2] * (STEPS - GROW_AT)
    assert [h["step"] for h in reference] == list(range(1, STEPS + 1))
    assert [h["loss"] for h in curve] == pytest.approx([h["loss"] for h in reference], rel=1e-4)
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"]  # a curve that moves, so the match means something


@pytest.mark.parametrize(
    ("given", "expected"),
    [("3", 3), ("1-4", (1, 4)), (" 2 - 8 ", (2, 8)), ((1, 2), (1, 2)), ([2, 3], (2, 3)), ("2-2", 2)],
)
def test_num_workers_takes_a_count_or_a_range(given, expected):
    assert parse_num_workers(given) == expected
    assert RayFinetuneConfig(num_workers=given).num_workers == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [("0", "expected at least 1"), ("3-1", "1 <= MIN <= MAX"), ("0-2", "1 <= MIN <= MAX"), ("two", "MIN-MAX"),
     ((1, 2, 3), "MIN-MAX"), (True, "MIN-MAX")],
)  # fmt: skip
def test_num_workers_rejects_what_is_not_a_count_or_a_range(given, message):
    with pytest.raises(ValueError, match=message):
        RayFinetuneConfig(num_workers=given)


def test_global_batch_size_sets_accumulation_per_world_size():
    config = RayFinetuneConfig(num_workers="1-4", per_device_train_batch_size=2, global_batch_size=24)
    assert [config.gradient_accumulation_for(w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    assert [2 * config.gradient_accumulation_for(w) * w for w in (1, 2, 3, 4)] == [24] * 4
    assert RayFinetuneConfig(num_workers=2, gradient_accumulation_steps=3).gradient_accumulation_for(1) == 3
    with pytest.raises(ValueError, match="not a positive multiple of .* 2 \\* 3 = 6"):
        accumulation_for_global_batch(8, per_device=2, world_size=3)
    with pytest.raises(ValueError, match="per_device_train_batch_size \\* world size = 4 \\* 3 = 12"):
        RayFinetuneConfig(num_workers="2-3", global_batch_size=16)  # fine at 2 workers, not at 3
    with pytest.raises(ValueError, match="give one"):
        RayFinetuneConfig(global_batch_size=16, gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("resources_per_worker", "{CPU: 1}"), ("resources_per_worker", '["CPU"]'), ("resources_per_worker", '{"CPU": -1}'),
     ("checkpoint_upload", "later"), ("resize_check_interval_s", -1.0)],
)  # fmt: skip
def test_bad_ray_flags_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        RayFinetuneConfig(**{field: value})
