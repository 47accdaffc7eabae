"""The one gate every writer of this rank's shard (master rows and optimizer state) passes.

Example::

    gate = WriteGate(device=params_device, host_resident=offload)
    gate.read_by(record_event(stream))     # a reader queued asynchronous copies of the shard
    gate.before_write()                    # a writer waits for every such reader first

# [Note: one gate for the shard's writers]
# Two kinds of asynchronous readers copy this rank's shard while the host goes on:
# - a memory snapshot copies the master rows and optimizer state to pinned host buffers on a side
#   stream (``snapshot/stager.py``), overlapping the next forward and backward;
# - with offload, ``ParamGather.issue`` (``allgather.py``) sends the host-resident rows to the device with
#   non-blocking copies from pinned memory, ordered before the all-gather on the compute stream.
# Four things write the shard: the inner optimizer's step, its switch between training and
# evaluation points (schedule-free optimizers: ``optimizer.train()``/``eval()``), re-reading the
# masters from the params (``copy_params_to_master``) and ``load_state_dict`` (which also replaces
# state tensors whose memory a copy may still read). Each calls ``before_write()`` first; each
# reader registers the event its copies complete with (``read_by``). Device-resident shards make
# the params' compute stream wait for the events (the writers' kernels run there); host-resident
# ones (offload) block the host, which writes them itself. Without the gate a copy in flight reads
# rows half-updated: a corrupt snapshot, or stale or torn params after the all-gather.
"""

from __future__ import annotations

import torch

from hf_lowzero.zero.runtime import device as dev


class WriteGate:
    """Orders every write of the shard after the asynchronous reads in flight ([Note: one gate for
    the shard's writers])."""

    def __init__(self, *, device: torch.device, host_resident: bool) -> None:
        self.device = device  # the params' device: its compute stream runs device-side writes
        self.host_resident = host_resident
        self._readers: list = []  # events of copies that may still read the shard

    def read_by(self, event) -> None:
        """A reader queued copies of the shard that complete with ``event`` (None: synchronous)."""
        if event is not None:
            self._readers.append(event)

    def before_write(self) -> None:
        """Wait, as the writer must, for every reader registered so far."""
        readers, self._readers = self._readers, []
        for event in readers:
            if self.host_resident:
                if not dev.event_done(event):  # mostly done long ago: the step's one sync came after it
                    dev.host_waits(event)
            else:
                dev.stream_waits(dev.current_stream(self.device), event)
