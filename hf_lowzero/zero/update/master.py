"""This rank's master rows, and the copy from the model's params into them (the way back, the
all-gather, is ``allgather.py``).

The rows live in one flat tensor (fp32, or bf16: ``ZeroConfig.master_dtype`` and
[Note: bf16 masters] in ``master_precision.py``) in the owned-rows space (bucket after bucket), on the
params' device, or in host memory (pinned for CUDA params) with optimizer offload, where the
inner optimizer then steps them.

Example::

    master = MasterRows(slots, buckets, offload=False, pin_memory=True, shard=shard)
    master.rows[slot.index]        # 1D view (fp32 by default) of this rank's piece (padding included; may be empty)
    master.copy_from_params()      # re-read this rank's rows from the params (local)
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.layout.buckets import Bucket
from hf_lowzero.zero.layout.packing import piece_view
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime import device as dev
from hf_lowzero.zero.runtime.shard_group import ShardGroup
from hf_lowzero.zero.update.write_gate import WriteGate


class MasterRows:
    def __init__(
        self,
        slots: list[ParamSlot],
        buckets: list[Bucket],
        *,
        offload: bool,
        pin_memory: bool,
        dtype: torch.dtype = torch.float32,
        shard: ShardGroup,
    ) -> None:
        self.slots, self.shard = slots, shard
        total = sum(b.row_numel for b in buckets)
        if offload:
            self.flat = dev.host_buffer(total, dtype, shard.device if pin_memory else None)
        else:
            self.flat = torch.zeros(total, dtype=dtype, device=shard.device)
        # Every writer of the rows (and of the optimizer state beside them) passes this gate first.
        self.gate = WriteGate(device=shard.device, host_resident=offload)
        self.rows = [piece_view(self.flat, s) for s in slots]
        self.copy_from_params()

    @torch.no_grad()
    def copy_from_params(self) -> None:
        """Re-read every row from the model's params (this rank's slice of each). Local."""
        self.gate.before_write()
        for slot, row in zip(self.slots, self.rows):
            start, end = slot.shard.owned_range(self.shard.rank)
            row[: end - start].copy_(slot.param.view(-1)[start:end])
