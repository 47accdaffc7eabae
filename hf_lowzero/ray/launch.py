"""Ray Train launch for the causal-LM fine-tune: TorchTrainer, sharded-checkpoint reporting, restore.

Example::

    ray.init(address="local", num_cpus=3)
    result = run_finetune(RayFinetuneConfig(num_workers=2, zero_stage=2, max_steps=20, save_steps=5,
                                            storage_path="/tmp/ray_results"))
    print(result.metrics, result.checkpoint.path)

# [Note: one checkpoint from every rank]
# ray.train.report is a barrier and every rank uploads its own directory into the same checkpoint
# folder in storage; files of the same name from different ranks overwrite each other. So each rank
# reports only the files it owns: rank r its own ZeRO shard and RNG state, rank 0 everything else
# (model, metadata, scheduler, trainer state). Ray registers the checkpoint only when every rank's
# report arrived, so a registered checkpoint always holds every shard, also across nodes that share
# no filesystem. A restarted run restores through ray.train.get_checkpoint(), never by scanning.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.train
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from transformers import TrainerCallback

from hf_lowzero.checkpoint.layout import owner_rank
from hf_lowzero.recipes.clm import ClmArguments, finetune_clm
from hf_lowzero.trainer.arguments import LowZeroTrainingArguments
from hf_lowzero.zero.config import check_stage

FAILURE_MARKER = ".hf_lowzero_failure_injected"


def _opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class RayFinetuneConfig:
    """Everything the Ray job needs; ``ray_jobs/finetune.py`` turns each field into a flag."""

    num_workers: int = _opt(2, "Ray workers, one process per rank (one GPU each with --use-gpu)")
    use_gpu: bool = _opt(False, "place one worker per GPU and use NCCL (gloo on CPU otherwise)")
    zero_stage: int = _opt(2, "0 = plain Trainer/DDP, 1 = shard optimizer states, 2 = also gradients")
    max_steps: int = _opt(40, "optimizer steps in total")
    save_steps: int = _opt(10, "checkpoint (and report to Ray) every N steps")
    learning_rate: float = _opt(3e-3, "peak learning rate")
    per_device_train_batch_size: int = _opt(4, "sequences per worker per micro-batch")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    bf16: bool = _opt(False, "bf16 params with fp32 master rows")
    offload_optimizer: bool = _opt(False, "fp32 master rows, optimizer state and gradient rows in host memory")
    zero_config: str | None = _opt(None, "other ZeroConfig fields as JSON")
    model_name_or_path: str | None = _opt(None, "local save_pretrained directory (default: a tiny GPT-2)")
    train_file: str | None = _opt(None, "plain-text corpus (default: the one shipped with hf_lowzero)")
    storage_path: str = field(
        default_factory=lambda: str(Path.home() / "ray_results"),
        metadata={"help": "where Ray keeps checkpoints: local, shared, or s3://... (default: ~/ray_results)"},
    )
    name: str = _opt("hf_lowzero_finetune", "run name; a rerun with the same name and storage resumes it")
    max_failures: int = _opt(3, "worker-group restarts before giving up")
    inject_failure_at_step: int | None = _opt(None, "kill one worker process once, at this step (demos, tests)")
    num_to_keep: int = _opt(2, "checkpoints Ray keeps")
    seed: int = _opt(0, "seed for model init and data order")

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers={self.num_workers} is invalid; expected at least 1")
        check_stage(self.zero_stage, "zero_stage", allow_off=True)
        if self.max_steps < 1 or self.save_steps < 1:
            raise ValueError("max_steps and save_steps must be >= 1")
        if self.inject_failure_at_step is not None and not 0 < self.inject_failure_at_step <= self.max_steps:
            raise ValueError(f"inject_failure_at_step must be in [1, max_steps={self.max_steps}]")


def run_finetune(config: RayFinetuneConfig, **trainer_overrides) -> ray.train.Result:
    """Fit the fine-tune on the connected Ray cluster; returns Ray's ``Result`` (metrics, checkpoint)."""
    trainer = build_trainer(config, **trainer_overrides)
    return trainer.fit()


def build_trainer(config: RayFinetuneConfig, run_config: RunConfig | None = None, callbacks=None) -> TorchTrainer:
    """The ``TorchTrainer`` for ``config`` (also used by the Tune sweep, which passes its callbacks)."""
    run_config = run_config or RunConfig(
        name=config.name,
        storage_path=config.storage_path,
        failure_config=FailureConfig(max_failures=config.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=config.num_to_keep),
        callbacks=callbacks,
    )
    return TorchTrainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config=dataclasses.asdict(config),
        scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu),
        run_config=run_config,
    )


def train_loop_per_worker(config_dict: dict[str, Any]) -> None:
    """Runs on every Ray worker (process group already initialized by Ray Train)."""
    config = RayFinetuneConfig(**config_dict)
    output_dir = _shared_local_dir(config.name)
    args = LowZeroTrainingArguments(
        output_dir=output_dir,
        zero_stage=config.zero_stage,
        zero_config=config.zero_config,
        zero_offload_optimizer=config.offload_optimizer,
        max_steps=config.max_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.num_to_keep,
        learning_rate=config.learning_rate,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        bf16=config.bf16,
        use_cpu=not config.use_gpu,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
        seed=config.seed,
    )
    model_args = ClmArguments(model_name_or_path=config.model_name_or_path)
    if config.train_file:
        model_args.train_file = config.train_file
    callbacks = [ReportShardedCheckpoints()]
    if config.inject_failure_at_step:
        callbacks.append(InjectWorkerFailure(config.inject_failure_at_step, Path(config.storage_path) / config.name))

    checkpoint = ray.train.get_checkpoint()
    try:
        if checkpoint is None:
            finetune_clm(model_args, args, callbacks=callbacks)
        else:
            with checkpoint.as_directory() as restored:
                finetune_clm(model_args, args, callbacks=callbacks, resume=_trainer_checkpoint_in(restored))
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)  # everything worth keeping was reported


class ReportShardedCheckpoints(TrainerCallback):
    """Reports every Trainer checkpoint to Ray from every rank (see [Note: one checkpoint from every rank])."""

    def __init__(self) -> None:
        self._last_logs: dict[str, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._last_logs = {k: v for k, v in logs.items() if isinstance(v, (int, float))}

    def on_save(self, args, state, control, **kwargs):
        rank, world = dist.get_rank(), dist.get_world_size()
        source = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        staging = Path(tempfile.mkdtemp(prefix=f"hf_lowzero_report_r{rank}_"))
        _stage_owned_files(source, staging / source.name, rank, world)
        metrics = {**self._last_logs, "step": state.global_step}
        ray.train.report(
            metrics, checkpoint=Checkpoint.from_directory(str(staging)), delete_local_checkpoint_after_upload=True
        )

    def on_train_end(self, args, state, control, **kwargs):
        ray.train.report({**self._last_logs, "step": state.global_step, "done": True})


def _stage_owned_files(source: Path, target: Path, rank: int, world: int) -> None:
    """Hard-link (or copy) into ``target`` the files of ``source`` that ``rank`` reports."""
    for path in source.rglob("*"):
        if not path.is_file():
            continue
        if owner_rank(path) != rank:
            continue
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)


def _trainer_checkpoint_in(restored: str) -> str:
    found = sorted(Path(restored).glob("checkpoint-*"))
    if len(found) != 1:
        raise RuntimeError(f"expected one Trainer checkpoint-N folder in the Ray checkpoint {restored}, found {found}")
    return str(found[0])


def _shared_local_dir(name: str) -> str:
    """A fresh Trainer output directory for this attempt: the same path on every rank (rank 0
    picks it), created on every node (nodes may not share a filesystem)."""
    path = [tempfile.mkdtemp(prefix=f"hf_lowzero_{name}_")] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    os.makedirs(path[0], exist_ok=True)
    return path[0]


class InjectWorkerFailure(TrainerCallback):
    """Kills the last rank's process once, at ``step``, on the first attempt only (a marker file in
    the run's storage folder remembers that it happened). For demos and fault-tolerance tests."""

    def __init__(self, step: int, run_dir: Path) -> None:
        self.step = step
        self.marker = run_dir / FAILURE_MARKER

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.marker.exists():
            return
        dist.barrier()  # every rank checked the marker before it appears
        if dist.get_rank() == dist.get_world_size() - 1:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"worker of rank {dist.get_rank()} killed at step {state.global_step}\n")
            print(f"[hf_lowzero] injecting a failure: killing rank {dist.get_rank()} at step {state.global_step}")
            os._exit(1)
