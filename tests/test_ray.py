"""Ray Train: every shard reaches the reported checkpoint; a killed worker is restarted from the
last complete checkpoint and the run ends exactly like an uninterrupted one; a rerun with fewer
workers resumes the same checkpoint, resharded."""

import json
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from hf_lowzero import consolidate_checkpoint  # noqa: E402
from hf_lowzero.ray import RayFinetuneConfig, run_finetune  # noqa: E402
from hf_lowzero.ray.launch import FAILURE_MARKER  # noqa: E402

STEPS, SAVE = 12, 4


@pytest.fixture(scope="module")
def local_ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
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
            inject_failure_at_step=10,
        )
    )
    assert clean.error is None and faulty.error is None
    assert (tmp_path / "faulty" / FAILURE_MARKER).exists(), "the failure was not injected"

    clean_dir, clean_weights = final_state(clean)
    faulty_dir, faulty_weights = final_state(faulty)
    assert clean_dir.name == faulty_dir.name == f"checkpoint-{STEPS}"
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
