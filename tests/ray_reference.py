"""The reference the Ray tests compare against: the fine-tune a Ray run's workers do, with the same
worker arguments, in plain gloo ranks without Ray (a Ray worker and a plain rank train bit for bit
alike, so a Ray run's losses must equal these exactly or within the test's tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_lowzero.recipes.clm import finetune_clm
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig
from hf_lowzero.testing import run_distributed


def _train_body(rank: int, world_size: int, config: RayFinetuneConfig, out: str) -> None:
    trainer, _ = finetune_clm(config.clm_arguments(), config.training_arguments(out, world_size))
    if rank == 0:
        Path(out, "losses.json").write_text(json.dumps([h for h in trainer.state.log_history if "loss" in h]))


def losses_without_ray(config: RayFinetuneConfig, out: Path, world_size: int) -> list[dict]:
    """The Trainer's loss log (one entry per logging step) of ``config``'s training at ``world_size``."""
    run_distributed(_train_body, world_size, config=config, out=str(out))
    return json.loads((out / "losses.json").read_text())


def checkpoint_without_ray(config: RayFinetuneConfig, out: Path, world_size: int, steps: int) -> Path:
    """``config``'s training of ``steps`` steps in plain ranks, as a reference worth matching (a loss at
    every step, falling by a tenth or more: a match means something); its final Trainer checkpoint."""
    curve = losses_without_ray(config, out, world_size)
    assert [h["step"] for h in curve] == list(range(1, steps + 1))
    assert curve[-1]["loss"] < 0.9 * curve[0]["loss"]
    checkpoint = out / f"checkpoint-{steps}"
    assert (checkpoint / "trainer_state.json").is_file(), f"no final checkpoint in {out}"
    return checkpoint
