"""``--reduction exact`` on Ray: a run whose worker group changes ends with the same bits as a run
that never changed, on a local multi-node cluster (``tests/ray_clusters.py``), with dropout on.

Every run trains the same 12 steps of 8 sequences (4 per micro-batch: 1 micro-batch per worker at 2
workers, 2 at 1), saves to storage every 4 steps and takes a memory snapshot at every step. Against
the fixed run, the same training in 2 plain gloo ranks without Ray:
- an elastic run that loses a node after step 4 and gets it back after step 8 (2 -> 1 -> 2 workers,
  each attempt resuming storage resharded: each checkpoint complete, saved at its attempt's size);
- an elastic run that does so after steps 6 and 9, between storage checkpoints, so each attempt
  resumes a memory snapshot, resharded (2 -> 1 from the lost node's buddy copies, 1 -> 2 with the
  new node's worker fetching over the network).
(A killed worker resuming its own node's memory at the same size is ``tests/test_recovery.py``'s;
the elastic run above with the default reduction was ``tests/test_ray_elastic.py``'s, whose
checks this file's first run now makes: the Ray layer's resize is the same for either reduction.)
Each ends with the fixed run's model weights, master weights and optimizer state, bit for bit, the
same fixed-point grid, the same gradient norm at every step, and the same loss at every step run
at 2 workers (the logged loss is a float mean over ranks, so at 1 worker it may differ in the last
bits: [Note: an exact Trainer step] in ``hf_lowzero/trainer/exact.py``).
"""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, build_trainer  # noqa: E402
from tests import ray_clusters  # noqa: E402
from tests.ray_checkpoints import missing_files, saved_world_size, step_of  # noqa: E402
from tests.ray_clusters import with_slots  # noqa: E402
from tests.ray_holds import HOLD_TIMEOUT_S, HoldAt, final_tensors, loss_curve, wait_for, zero_metadata  # noqa: E402
from tests.ray_reference import checkpoint_without_ray  # noqa: E402
from tests.tiers import ray_nodes_run  # noqa: E402

STEPS, SAVE, GLOBAL_BATCH = 12, 4, 8


@pytest.fixture(scope="module")
def cluster():
    """A head node (no worker slot) and two nodes with one worker slot each (``cluster.slot_nodes``)."""
    with ray_clusters.slot_cluster(2) as (cluster, nodes):
        cluster.slot_nodes = nodes
        yield cluster


@pytest.fixture(scope="module")
def dropout_model(no_dropout_model, tmp_path_factory) -> tuple[str, str]:
    """The tiny GPT-2 of ``no_dropout_model`` with GPT-2's dropout (0.1 everywhere), and its corpus."""
    _, corpus = no_dropout_model
    root = tmp_path_factory.mktemp("dropout_model")
    config = GPT2Config(vocab_size=257, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=256,
                        eos_token_id=256)  # fmt: skip
    assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == 0.1
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    return str(root / "model"), corpus


def config(name: str, tmp_path, model: tuple[str, str], **overrides) -> RayFinetuneConfig:
    model_dir, corpus = model
    fields = dict(num_workers=2, reduction="exact", max_steps=STEPS, save_steps=SAVE, global_batch_size=GLOBAL_BATCH,
                  per_device_train_batch_size=4, snapshot_every=1, model_name_or_path=model_dir, train_file=corpus,
                  num_to_keep=STEPS // SAVE, resources_per_worker='{"worker_slot": 1}', storage_path=str(tmp_path),
                  name=name, resize_check_interval_s=1)  # fmt: skip
    return RayFinetuneConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def fixed(dropout_model, tmp_path_factory) -> Path:
    """The reference: the same training in 2 plain gloo ranks from start to end, without Ray (a Ray
    worker trains bit for bit like a plain rank); its final Trainer checkpoint."""
    out = tmp_path_factory.mktemp("fixed")
    return checkpoint_without_ray(config("fixed", out, dropout_model), out, world_size=2, steps=STEPS)


def shrink_and_grow(cluster, trainer, signals, shrink_at: int, grow_at: int):
    """Fit ``trainer``; remove a worker node when it holds at ``shrink_at`` and add one at ``grow_at``."""
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(trainer.fit)
        wait_for(signals / f"hold_{shrink_at}", run)
        cluster.remove_node(cluster.slot_nodes.pop())  # capacity lost: the worker on that node dies with it
        wait_for(signals / f"hold_{grow_at}", run)
        cluster.slot_nodes.append(ray_clusters.add_slot_node(cluster))  # capacity back
        return run.result(timeout=HOLD_TIMEOUT_S)


def assert_same_bits(result, fixed) -> None:
    """``result`` ended where ``fixed`` did, bit for bit, and took the same steps on the way."""
    assert result.error is None
    curve, reference = loss_curve(result), loss_curve(fixed)
    assert [h["step"] for h in curve] == list(range(1, STEPS + 1))
    assert [h["grad_norm"] for h in curve] == [h["grad_norm"] for h in reference]  # exact at any world size
    for h, r in zip(curve, reference):
        assert h["loss"] == (r["loss"] if h["world_size"] == 2 else pytest.approx(r["loss"], rel=1e-6)), h
    tensors, expected = final_tensors(result), final_tensors(fixed)
    assert set(tensors) == set(expected)
    assert any(k.startswith("zero_shard_") for k in expected) and any(k.startswith("model/") for k in expected)
    different = [k for k, v in expected.items() if not torch.equal(tensors[k], v)]
    assert different == [], f"{len(different)} of {len(expected)} tensors differ from the fixed run's"
    grid = zero_metadata(fixed)["exact_grid"]
    assert grid is not None and zero_metadata(result)["exact_grid"] == grid


@ray_nodes_run
def test_an_elastic_run_ends_with_the_fixed_runs_bits(cluster, fixed, dropout_model, tmp_path):
    with_slots(cluster, 2)
    signals = tmp_path / "signals"
    signals.mkdir()
    elastic = config("elastic", tmp_path, dropout_model, num_workers=(1, 2))
    trainer = build_trainer(elastic, trainer_callbacks=[HoldAt({SAVE, 2 * SAVE}, signals)])
    result = shrink_and_grow(cluster, trainer, signals, SAVE, 2 * SAVE)
    assert (result.metrics["resumed_from"], result.metrics["resumed_from_step"]) == ("storage", 2 * SAVE)
    # Each attempt resumed the previous one's last checkpoint, resharded to its own world size.
    registered = sorted(result.best_checkpoints, key=lambda cm: step_of(cm[0].path))
    assert all(missing_files(c.path) == [] for c, _ in registered)
    assert [(step_of(c.path), saved_world_size(c.path)) for c, _ in registered] == [(4, 2), (8, 1), (12, 2)]
    assert [(m["world_size"], m["resumed_from_step"]) for _, m in registered] == [(2, 0), (1, 4), (2, 8)]
    assert {m["global_batch_size"] for _, m in registered} == {GLOBAL_BATCH}
    curve = loss_curve(result)
    assert [h["world_size"] for h in curve] == [2] * SAVE + [1] * SAVE + [2] * (STEPS - 2 * SAVE)
    assert_same_bits(result, fixed)


@ray_nodes_run
def test_an_elastic_run_resumed_from_memory_snapshots_ends_with_the_fixed_runs_bits(
    cluster, fixed, dropout_model, tmp_path
):
    with_slots(cluster, 2)
    signals = tmp_path / "signals"
    signals.mkdir()
    shrink_at, grow_at = SAVE + 2, 2 * SAVE + 1  # between storage checkpoints: memory is newer
    elastic = config("elastic_memory", tmp_path, dropout_model, num_workers=(1, 2))
    trainer = build_trainer(elastic, trainer_callbacks=[HoldAt({shrink_at, grow_at}, signals)])
    result = shrink_and_grow(cluster, trainer, signals, shrink_at, grow_at)
    m = result.metrics
    assert (m["resumed_from"], m["resumed_from_step"], m["newest_storage_step"]) == ("memory", grow_at, 2 * SAVE)
    assert m["memory_pieces_from_other_nodes"] >= 1  # the new node's worker fetched over the network
    curve = loss_curve(result)
    assert [h["world_size"] for h in curve] == [2] * shrink_at + [1] * (grow_at - shrink_at) + [2] * (STEPS - grow_at)
    assert_same_bits(result, fixed)


def test_a_global_batch_that_a_possible_worker_count_does_not_divide_is_refused_up_front():
    """Exact mode keeps the global batch through resizes, so every worker count of the range must
    divide it (times the per-device batch); a run that could grow to 3 workers with 8 sequences per
    step is refused before it starts, naming the numbers, rather than failing at the resize."""
    fits = RayFinetuneConfig(num_workers=(1, 2), reduction="exact", global_batch_size=8)
    assert [fits.gradient_accumulation_for(w) for w in (1, 2)] == [2, 1]
    for per_device, numbers in ((4, "4 \\* 3 = 12"), (1, "1 \\* 3 = 3")):
        with pytest.raises(ValueError, match=f"global_batch_size=8 is not a positive multiple of .* = {numbers}"):
            RayFinetuneConfig(num_workers=(2, 3), reduction="exact", global_batch_size=8,
                              per_device_train_batch_size=per_device)  # fmt: skip
    with pytest.raises(ValueError, match="global_batch_size=8 is not .* 4 \\* 3 = 12"):
        RayFinetuneConfig(num_workers=3, reduction="exact", global_batch_size=8)  # a rerun at 3 workers
