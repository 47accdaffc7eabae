"""Ray Train: every shard reaches the reported checkpoint, each file uploaded by one rank; a worker
killed while its checkpoint upload is in flight is restarted from the last complete checkpoint (Ray
never hands out the partial one) and the run ends exactly like an uninterrupted one; a rerun with
fewer workers resumes the same checkpoint, resharded."""

import json
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from hf_lowzero import LowZeroTrainer, consolidate_checkpoint  # noqa: E402
from hf_lowzero.ray import RayFinetuneConfig, run_finetune  # noqa: E402
from hf_lowzero.ray.launch import FAILURE_MARKER  # noqa: E402
from hf_lowzero.ray.reporting import stage_owned_files  # noqa: E402
from tests.hf_models import TokenDataset, tiny_gpt2  # noqa: E402
from tests.ray_checkpoints import missing_files, step_of  # noqa: E402
from tests.trainer_runs import make_args  # noqa: E402

STEPS, SAVE = 12, 4


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    root = str(Path(__file__).resolve().parents[1])  # workers import tests.* (model_init below)
    runtime_env = {"env_vars": {"PYTHONPATH": root}}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    yield
    ray.shutdown()


def final_state(result) -> tuple[Path, dict[str, torch.Tensor]]:
    trainer_ckpt = next(Path(result.checkpoint.path).glob("checkpoint-*"))
    return trainer_ckpt, consolidate_checkpoint(trainer_ckpt / "zero_optimizer")


def test_worker_failure_resumes_to_the_same_result(local_ray, tmp_path):
    clean = run_finetune(
        RayFinetuneConfig(num_workers=2, max_steps=STEPS, save_steps=SAVE, storage_path=str(tmp_path), name="clean")
    )
    faulty = run_finetune(
        RayFinetuneConfig(
            num_workers=2,
            max_steps=STEPS,
            save_steps=SAVE,
            storage_path=str(tmp_path),
            name="faulty",
            inject_failure_at_step=2 * SAVE,  # a checkpoint step: rank 1 dies while its upload is in flight
        )
    )
    assert clean.error is None and faulty.error is None
    assert (tmp_path / "faulty" / FAILURE_MARKER).exists(), "the failure was not injected"

    # Ray registered only complete checkpoints; the killed round's partial folder stays unregistered,
    # and the restart resumed the last complete checkpoint (step SAVE), not the partial one.
    registered = {Path(c.path) for c, _ in faulty.best_checkpoints}
    assert all(missing_files(c) == [] for c in registered)
    partial = [d for d in (tmp_path / "faulty").glob("checkpoint_*") if d.is_dir() and missing_files(d)]
    assert [step_of(d) for d in partial] == [2 * SAVE], "the killed rank's upload was not cut short"
    assert "zero_optimizer/zero_shard_rank00001_of_00002.safetensors" in missing_files(partial[0])
    assert not registered & set(partial)
    assert faulty.metrics["resumed_from_step"] == SAVE

    clean_dir, clean_weights = final_state(clean)
    faulty_dir, faulty_weights = final_state(faulty)
    assert clean_dir.name == faulty_dir.name == f"checkpoint-{STEPS}"
    # Each file of the final checkpoint is reported (uploaded) by exactly one rank.
    staged = [set(stage_owned_files(clean_dir, tmp_path / f"staged{r}", r)) for r in range(2)]
    assert not staged[0] & staged[1]
    assert staged[0] | staged[1] == {p.relative_to(clean_dir) for p in clean_dir.rglob("*") if p.is_file()}
    assert {"zero_optimizer/zero_shard_rank00001_of_00002.safetensors", "rng_state_1.pth"} == {
        str(p) for p in staged[1]
    }
    for ckpt in (clean_dir, faulty_dir):  # every rank's files reached the reported checkpoint
        names = set(os.listdir(ckpt)) | set(os.listdir(ckpt / "zero_optimizer"))
        assert {
            "rng_state_0.pth",
            "rng_state_1.pth",
            "model.safetensors",
            "trainer_state.json",
            "zero_meta.json",
            "zero_shard_rank00000_of_00002.safetensors",
            "zero_shard_rank00001_of_00002.safetensors",
        } <= names
    assert faulty.metrics["loss"] == pytest.approx(clean.metrics["loss"], rel=1e-6)
    for name, value in clean_weights.items():
        torch.testing.assert_close(faulty_weights[name], value, rtol=1e-6, atol=1e-7, msg=name)

    # A rerun of "clean" with one worker resumes its step-12 checkpoint, resharded 2 -> 1.
    resumed = run_finetune(
        RayFinetuneConfig(
            num_workers=1, max_steps=STEPS + SAVE, save_steps=SAVE, storage_path=str(tmp_path), name="clean"
        )
    )
    resumed_dir, _ = final_state(resumed)
    assert resumed_dir.name == f"checkpoint-{STEPS + SAVE}"
    assert sorted(os.listdir(resumed_dir / "zero_optimizer"))[-1] == "zero_shard_rank00000_of_00001.safetensors"
    history = json.loads((resumed_dir / "trainer_state.json").read_text())["log_history"]
    before = json.loads((clean_dir / "trainer_state.json").read_text())["log_history"]
    assert [h.get("loss") for h in history[:STEPS]] == [h.get("loss") for h in before[:STEPS]], "did not resume"


def model_init(trial=None):
    return tiny_gpt2(seed=3)


def test_ray_tune_hyperparameter_search_builds_a_zero_optimizer_per_trial(local_ray, tmp_path):
    """Trainer.hyperparameter_search(backend="ray"): each trial (a Ray actor, world size 1) builds
    its model with model_init and a ZeRO optimizer for it; every trial's objective equals the plain
    Trainer's for the same learning rate."""
    from ray import tune

    data = {"train_dataset": TokenDataset(), "eval_dataset": TokenDataset(n=8, seed=9)}
    rates = [1e-3, 3e-3]
    trainer = LowZeroTrainer(model_init=model_init, args=make_args(tmp_path / "search", 2), **data)
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.grid_search(rates)},
        backend="ray",
        n_trials=1,
        direction="minimize",
        resources_per_trial={"cpu": 1},
        storage_path=str(tmp_path / "tune"),
    )
    objectives = {t.config["learning_rate"]: t.last_result["objective"] for t in best.run_summary.trials}
    for lr in rates:
        args = make_args(tmp_path / f"plain-{lr}", 0, learning_rate=lr)
        plain = LowZeroTrainer(model_init=model_init, args=args, **data)
        plain.train()
        assert objectives[lr] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5), lr
    assert best.hyperparameters["learning_rate"] == min(objectives, key=objectives.get)
