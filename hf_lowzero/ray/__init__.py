"""The Ray layer (needs ``ray[train]``): public pieces for any training function on Ray Train.

Your own model and data, on every worker of a ``ray.train.torch.TorchTrainer``::

    from hf_lowzero.ray import local_output_dir, prepare_trainer, resume_checkpoint

    def train_func(config):
        args = LowZeroTrainingArguments(output_dir=local_output_dir(), zero_stage=2, save_steps=10, use_cpu=True)
        trainer = prepare_trainer(LowZeroTrainer(model=build_model(), args=args, train_dataset=ds))
        trainer.train(resume_from_checkpoint=resume_checkpoint())

``accumulation_for_global_batch`` keeps the global batch across elastic resizes, ``ConsoleProgress``
prints one line per step, ``InjectWorkerFailure`` kills a worker once (demos and tests),
``merge_run_config``, ``ReleaseSnapshots`` and ``ConsoleEvents`` build the ``RunConfig``. The
causal-LM fine-tune job built from these pieces, ``run_finetune(RayFinetuneConfig(...))``
(``ray_jobs/finetune.py``), is ``hf_lowzero.recipes.clm_ray``, above this package: import its names from there.
"""

from typing import TYPE_CHECKING

from hf_lowzero.lazy_names import lazy_names

if TYPE_CHECKING:  # the exports, imported on first use (hf_lowzero/lazy_names.py)
    from hf_lowzero.ray.console import ConsoleProgress, quiet_worker_console
    from hf_lowzero.ray.elastic import RecordWorldSize, accumulation_for_global_batch
    from hf_lowzero.ray.events import ConsoleEvents
    from hf_lowzero.ray.faults import InjectWorkerFailure
    from hf_lowzero.ray.holder_lifetime import ReleaseSnapshots
    from hf_lowzero.ray.prepare import local_output_dir, prepare_trainer, resume_checkpoint
    from hf_lowzero.ray.reporting import ReportShardedCheckpoints
    from hf_lowzero.ray.run_config import merge_run_config
    from hf_lowzero.ray.snapshots import MemorySnapshots


__all__ = [
    "ConsoleEvents",
    "ConsoleProgress",
    "InjectWorkerFailure",
    "MemorySnapshots",
    "RecordWorldSize",
    "ReleaseSnapshots",
    "ReportShardedCheckpoints",
    "accumulation_for_global_batch",
    "local_output_dir",
    "merge_run_config",
    "prepare_trainer",
    "quiet_worker_console",
    "resume_checkpoint",
]

__getattr__, __dir__ = lazy_names(__name__)
