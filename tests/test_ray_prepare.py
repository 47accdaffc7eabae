"""``hf_lowzero.ray.prepare_trainer`` for any Trainer: the files of a plain Trainer's checkpoint (DDP,
``optimizer.pt``) are partitioned among the ranks that report them, and the public pieces refuse to
run where they cannot work. (On Ray itself: ``tests/test_ray.py``.)"""

import pytest

pytest.importorskip("ray")

from transformers import Trainer, TrainingArguments  # noqa: E402

from hf_lowzero.ray import local_output_dir, prepare_trainer, resume_checkpoint  # noqa: E402
from hf_lowzero.ray.reporting import stage_owned_files  # noqa: E402
from tests.hf_models import tiny_gpt2  # noqa: E402

# What transformers 5.23's Trainer writes into checkpoint-N at world size 2 with DDP.
PLAIN_TRAINER_FILES = ["config.json", "generation_config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                       "trainer_state.json", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth"]  # fmt: skip


def test_a_plain_trainer_checkpoint_is_reported_once_by_the_ranks_that_own_its_files(tmp_path):
    source = tmp_path / "checkpoint-4"
    source.mkdir()
    for name in PLAIN_TRAINER_FILES:
        (source / name).write_text(name)
    staged = [set(map(str, stage_owned_files(source, tmp_path / f"rank{r}" / source.name, r))) for r in range(2)]
    assert staged[1] == {"rng_state_1.pth"}
    assert staged[0] == set(PLAIN_TRAINER_FILES) - staged[1]  # optimizer.pt with rank 0's files, reported once
    assert (tmp_path / "rank0" / "checkpoint-4" / "optimizer.pt").read_text() == "optimizer.pt"


def test_the_public_pieces_refuse_to_run_outside_a_ray_train_worker(tmp_path):
    trainer = Trainer(model=tiny_gpt2(), args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    for call, name in [(lambda: prepare_trainer(trainer), "prepare_trainer"), (resume_checkpoint, "resume_checkpoint"),
                       (local_output_dir, "local_output_dir")]:  # fmt: skip
        with pytest.raises(RuntimeError, match=rf"{name}\(\) must be called inside the training function"):
            call()
    assert not any(type(cb).__module__.startswith("hf_lowzero") for cb in trainer.callback_handler.callbacks)
