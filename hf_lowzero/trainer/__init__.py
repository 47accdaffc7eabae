"""The Trainer layer: ``LowZeroTrainer``, ``LowZeroTrainingArguments`` and ``with_zero`` (needs transformers)."""

from hf_lowzero.trainer.arguments import LowZeroTrainingArguments, ZeroArguments
from hf_lowzero.trainer.trainer import LowZeroTrainer
from hf_lowzero.trainer.twins import with_zero

__all__ = ["LowZeroTrainer", "LowZeroTrainingArguments", "ZeroArguments", "with_zero"]
