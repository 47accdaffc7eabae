"""hf_lowzero: ZeRO stage 1 and 2 for Hugging Face Trainer, on torch.distributed and Ray.

Example::

    from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2)
"""

from hf_lowzero.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    full_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from hf_lowzero.zero import ChainedOptimizer, LowLevelZeroOptimizer, MemoryReport, ZeroConfig
from hf_lowzero.zero.integrity.checker import IntegrityError

__all__ = [
    "ChainedOptimizer",
    "CheckpointError",
    "IntegrityError",
    "LowLevelZeroOptimizer",
    "LowZeroTrainer",
    "LowZeroTrainingArguments",
    "MemoryReport",
    "ZeroConfig",
    "consolidate_checkpoint",
    "full_state_dict",
    "load_checkpoint",
    "plan_memory",
    "save_checkpoint",
    "with_zero",
]


def __getattr__(name: str):
    # The Trainer layer needs transformers; import it only when asked for, so that
    # `import hf_lowzero` (and hf_lowzero.zero) works with torch alone.
    if name in ("LowZeroTrainer", "LowZeroTrainingArguments", "with_zero"):
        from hf_lowzero import trainer

        return getattr(trainer, name)
    if name == "plan_memory":  # simulates transformers models
        from hf_lowzero.plan import plan_memory

        return plan_memory
    raise AttributeError(f"module 'hf_lowzero' has no attribute {name!r}")


__version__ = "0.1.0"
