"""The sharded optimizer layer: plain PyTorch + torch.distributed, no transformers or Ray."""

from hf_lowzero.zero.inner.chain import ChainedOptimizer
from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
from hf_lowzero.zero.runtime.memory import MemoryReport
from hf_lowzero.zero.zero_config import ZeroConfig

__all__ = ["ChainedOptimizer", "LowLevelZeroOptimizer", "MemoryReport", "ZeroConfig"]
