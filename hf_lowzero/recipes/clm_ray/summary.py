"""The end of a Ray fine-tune as a person sees it: final loss, time, the measured step time against
the plan's, restarts survived, the final checkpoint, and that checkpoint consolidated into a
``from_pretrained`` directory.

Example::

    summary = run_with_summary(RayFinetuneConfig(max_steps=20), export_dir="/tmp/demo_export")
    print(summary)                                   # the block ray_jobs/finetune.py ends with
    model = AutoModelForCausalLM.from_pretrained(summary.export_dir)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import ray.train

from hf_lowzero.consolidate import export_pretrained
from hf_lowzero.ray.prepare import trainer_checkpoint_in
from hf_lowzero.recipes.clm_ray.attempts import count_attempts
from hf_lowzero.recipes.clm_ray.job import run_finetune
from hf_lowzero.recipes.clm_ray.job_config import RayFinetuneConfig
from hf_lowzero.trainer.step_clock import step_time_line

HEADER = "=== hf_lowzero fine-tune finished ==="


@dataclass(frozen=True)
class RunSummary:
    """What a finished run is worth telling: Ray's ``result``, the seconds ``fit`` took, the
    worker-group restarts it survived (attempts of the training function beyond the first), the
    Trainer checkpoint folder inside Ray's final checkpoint, and the export directory (or None).
    """

    result: ray.train.Result
    max_steps: int
    wall_time_s: float
    restarts: int
    trainer_checkpoint: str | None
    export_dir: Path | None

    def __str__(self) -> str:
        metrics = self.result.metrics or {}
        rows = [
            (
                "final loss",
                f"{metrics['loss']:.4f} at step {metrics['step']}/{self.max_steps}" if "loss" in metrics else "-",
            ),
            ("wall time", f"{self.wall_time_s:.1f} s"),
            *([("step time", self._step_time())] if "step_times_s" in self._returned() else []),
            ("restarts survived", self._restarts()),
            *([("integrity", self._integrity())] if "integrity_checks" in metrics else []),
            ("checkpoint", self.trainer_checkpoint or "-"),
            (
                "model",
                f"{self.export_dir}  (AutoModelForCausalLM.from_pretrained)" if self.export_dir else "not exported",
            ),
        ]
        return "\n".join([HEADER] + [f"{key:<18} {value}" for key, value in rows])

    def _returned(self) -> dict:
        """What the training function returned on the first rank of the last attempt ({} if nothing)."""
        return getattr(self.result, "return_value", None) or {}

    def _step_time(self) -> str:
        """``measured median 45.3 ms over 40 steps; the plan predicted 41.2 ms: measured/predicted 1.10``."""
        returned = self._returned()
        line = step_time_line(returned["step_times_s"], returned.get("predicted_step_s"))
        return f"{line} (last attempt)" if self.restarts else line

    def _integrity(self) -> str:
        """``12 checks in the last attempt, 1 failure (rolled back to step 14)``."""
        metrics = self.result.metrics or {}
        text = f"{metrics['integrity_checks']} checks in the last attempt"
        failures = metrics.get("integrity_failures", 0)
        if failures:
            text += f", {failures} failure{'s' * (failures > 1)}"
            if metrics.get("rolled_back_to"):
                text += f" (rolled back to step {metrics['rolled_back_to']})"
        return text

    def _restarts(self) -> str:
        """``1 (resumed from memory, step 15; newest storage checkpoint 10)``: where the last restart resumed."""
        metrics = self.result.metrics or {}
        source = metrics.get("resumed_from")
        if not self.restarts or source is None:
            return str(self.restarts)
        if source == "none":
            return f"{self.restarts} (no checkpoint yet: restarted from the start)"
        where = f"resumed from {source}, step {metrics['resumed_from_step']}"
        if source == "memory":
            where += f"; newest storage checkpoint {metrics['newest_storage_step'] or 'none'}"
        return f"{self.restarts} ({where})"


def run_with_summary(config: RayFinetuneConfig, export_dir: str | Path | None = None) -> RunSummary:
    """Fit ``config`` on the connected Ray cluster (see ``run_finetune``), count the restarts, and
    export the final checkpoint to ``export_dir`` (on this machine) if one is given.

    Restarts come from the attempt records the training function leaves in the run's storage
    folder (``hf_lowzero.recipes.clm_ray.attempts``): the records this fit added, minus one.

    Example::

        >>> summary = run_with_summary(RayFinetuneConfig(inject_failure_at_step=15), export_dir="out/final")
        >>> summary.restarts
        1
    """
    attempts_before = count_attempts(config.storage_path, config.name)
    start = time.perf_counter()
    result = run_finetune(config)
    wall_time_s = time.perf_counter() - start
    restarts = count_attempts(config.storage_path, config.name) - attempts_before - 1
    trainer_checkpoint, exported = None, None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as restored:
            source = trainer_checkpoint_in(restored)
            trainer_checkpoint = str(Path(result.checkpoint.path) / Path(source).name)
            if export_dir is not None:
                exported = export_pretrained(source, export_dir, tokenizer_from=config.model_name_or_path)
    return RunSummary(
        result=result,
        max_steps=config.max_steps,
        wall_time_s=wall_time_s,
        restarts=restarts,
        trainer_checkpoint=trainer_checkpoint,
        export_dir=exported,
    )
