"""Which Trainer features conflict with ZeRO's sharded optimizer state, checked at construction.

A conflicting flag raises a ``ValueError`` naming the flag and what to do, when the Trainer is
built, never as a crash mid-training.

Example::

    check_trainer_flags(trainer)   # called by LowZeroTrainer.__init__ when zero_stage > 0
"""

from __future__ import annotations

from transformers import Trainer

from hf_lowzero.zero.inner.policy import choose_partition, partition_for
from hf_lowzero.zero.layout.params import managed_slots
from hf_lowzero.zero.optimizer import check_inner_optimizer


def _conflict(flag: str, why: str, fix: str) -> ValueError:
    return ValueError(f"zero_stage>0 conflicts with {flag}: {why}. {fix}")


def check_trainer_flags(trainer: Trainer) -> None:
    """Raise a clear error for every Trainer setting that cannot work with ZeRO stage 1/2."""
    args = trainer.args
    if args.deepspeed:
        raise _conflict(
            "--deepspeed", "DeepSpeed brings its own ZeRO", "Use one of them: drop --deepspeed or set --zero_stage 0."
        )
    if args.fsdp:
        raise _conflict(
            "--fsdp", "FSDP shards parameters itself", "Use one of them: drop --fsdp or set --zero_stage 0."
        )
    if args.n_gpu > 1:
        raise _conflict(
            f"{args.n_gpu} GPUs in one process (nn.DataParallel)",
            "ZeRO needs one process per GPU",
            "Launch with torchrun --nproc-per-node N (or Ray), one process per GPU.",
        )
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise _conflict(
            "a model sharded at load time (tp_plan / device_mesh)",
            "its parameters are DTensors owned by tensor parallelism",
            "Load the model unsharded, or set --zero_stage 0.",
        )
    config = args.to_zero_config()
    if trainer.optimizer is not None:  # optimizers=(optimizer, scheduler)
        check_inner_optimizer(trainer.optimizer)
        partition_for(trainer.optimizer, config.partition, config.allow_untested_optimizer)
        managed_slots(trainer.model, trainer.optimizer, world_size=1)  # over this model's trainable params
        return
    if trainer.optimizer_cls_and_kwargs is not None:
        cls = trainer.optimizer_cls_and_kwargs[0]
    else:
        try:
            cls, _ = trainer.get_optimizer_cls_and_kwargs(args, trainer.model)
        except ImportError:  # the optimizer's package is missing: Trainer reports that itself at train()
            return
    optim = f"--optim {getattr(args.optim, 'value', args.optim)}"
    if not isinstance(cls, type):
        raise _conflict(
            optim,
            "it builds its optimizer through a factory over the whole model",
            "Use an optimizer class, such as --optim adamw_torch.",
        )
    try:
        choose_partition(cls, config.partition, config.allow_untested_optimizer)
    except ValueError as e:
        raise ValueError(f"zero_stage>0 conflicts with {optim}: {e}") from e
