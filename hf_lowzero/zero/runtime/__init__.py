"""The runtime every layer stands on: the collectives (the only calls to ``torch.distributed``), CUDA
streams, events and pinned memory, pooled communication buffers, and memory accounting."""
