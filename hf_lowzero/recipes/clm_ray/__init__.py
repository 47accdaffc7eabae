"""The causal-LM fine-tune job on Ray (``ray_jobs/finetune.py``), built from ``hf_lowzero.ray``'s public
pieces and the causal-LM recipe (``hf_lowzero/recipes/clm.py``): its configuration (every field a flag),
its ``TorchTrainer``, its driver's console and its closing summary.

Example::

    from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, run_finetune, run_with_summary

    result = run_finetune(RayFinetuneConfig(num_workers=2, zero_stage=2, max_steps=20))
    print(run_with_summary(RayFinetuneConfig(max_steps=20)))    # the block ray_jobs/finetune.py ends with
"""

from hf_lowzero.recipes.clm_ray.job import build_trainer, run_finetune, train_loop_per_worker
from hf_lowzero.recipes.clm_ray.job_config import RayFinetuneConfig
from hf_lowzero.recipes.clm_ray.summary import RunSummary, run_with_summary

__all__ = [
    "RayFinetuneConfig",
    "RunSummary",
    "build_trainer",
    "run_finetune",
    "run_with_summary",
    "train_loop_per_worker",
]
