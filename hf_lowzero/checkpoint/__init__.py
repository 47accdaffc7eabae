"""Sharded checkpoints of a ``LowLevelZeroOptimizer``, built on its public state-dict surface.

The checkpoint layer sits above the optimizer, as torch's distributed checkpointing sits above
FSDP2: it reads ``opt.state_dict()`` (this rank's shard in torch's format), writes one safetensors
file per rank plus metadata, and restores through ``opt.load_state_dict()`` and
``opt.copy_master_to_params()``, resharding to any world size.

Example::

    from hf_lowzero import load_checkpoint, save_checkpoint
    save_checkpoint(opt, "out/step-100")   # collective: each rank writes its own shard
    load_checkpoint(opt, "out/step-100")   # collective: any saved world size -> the current one
"""

from typing import TYPE_CHECKING

from hf_lowzero.lazy_names import lazy_names

if TYPE_CHECKING:  # the exports, imported on first use (hf_lowzero/lazy_names.py)
    from hf_lowzero.checkpoint.export import consolidate_checkpoint, full_state_dict
    from hf_lowzero.checkpoint.load import load_checkpoint
    from hf_lowzero.checkpoint.save import save_checkpoint
    from hf_lowzero.checkpoint.shards import CheckpointError

__all__ = ["CheckpointError", "consolidate_checkpoint", "full_state_dict", "load_checkpoint", "save_checkpoint"]

__getattr__, __dir__ = lazy_names(__name__)
