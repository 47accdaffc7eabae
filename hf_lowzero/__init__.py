"""hf_lowzero: ZeRO stage 1 and 2 for Hugging Face Trainer, on torch.distributed and Ray.

Example::

    from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2)
"""

from typing import TYPE_CHECKING

from hf_lowzero.lazy_names import lazy_names

if TYPE_CHECKING:  # the exports, imported on first use (hf_lowzero/lazy_names.py)
    from hf_lowzero.checkpoint.export import consolidate_checkpoint, full_state_dict
    from hf_lowzero.checkpoint.load import load_checkpoint
    from hf_lowzero.checkpoint.save import save_checkpoint
    from hf_lowzero.checkpoint.shards import CheckpointError
    from hf_lowzero.plan import plan_memory
    from hf_lowzero.trainer import LowZeroTrainer, LowZeroTrainingArguments, with_zero
    from hf_lowzero.zero.inner.chain import ChainedOptimizer
    from hf_lowzero.zero.integrity.checker import IntegrityError
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
    from hf_lowzero.zero.runtime.memory import MemoryReport
    from hf_lowzero.zero.zero_config import ZeroConfig

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


__getattr__, __dir__ = lazy_names(__name__)

__version__ = "0.1.0"
