"""The Ray layer: fault-tolerant multi-worker fine-tuning on Ray Train (needs ``ray[train]``)."""

from hf_lowzero.ray.launch import RayFinetuneConfig, build_trainer, run_finetune, train_loop_per_worker

__all__ = ["RayFinetuneConfig", "build_trainer", "run_finetune", "train_loop_per_worker"]
