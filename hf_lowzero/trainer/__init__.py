"""The Trainer layer: ``LowZeroTrainer`` and ``LowZeroTrainingArguments`` (needs transformers)."""

from hf_lowzero.trainer.arguments import LowZeroTrainingArguments
from hf_lowzero.trainer.trainer import LowZeroTrainer, ZeroTrainingModule

__all__ = ["LowZeroTrainer", "LowZeroTrainingArguments", "ZeroTrainingModule"]
