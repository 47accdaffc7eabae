"""The sharded optimizer layer: plain PyTorch + torch.distributed, no transformers or Ray."""

from hf_lowzero.zero.chain import ChainedOptimizer
from hf_lowzero.zero.config import ZeroConfig
from hf_lowzero.zero.memory import MemoryReport
from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer

__all__ = ["ChainedOptimizer", "LowLevelZeroOptimizer", "MemoryReport", "ZeroConfig"]
