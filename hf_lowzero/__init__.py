"""hf_lowzero: ZeRO stage 1 and 2 for Hugging Face Trainer, on torch.distributed and Ray.

Example::

    from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2)
"""

from hf_lowzero.config import ZeroConfig
from hf_lowzero.zero import LowLevelZeroOptimizer, MemoryReport
from hf_lowzero.zero.checkpoint import CheckpointError, consolidate_checkpoint

__all__ = ["CheckpointError", "LowLevelZeroOptimizer", "MemoryReport", "ZeroConfig", "consolidate_checkpoint"]
__version__ = "0.1.0"
