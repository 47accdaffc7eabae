"""Our host kernels: the offloaded step on the host in one pass over the rows (docs/offload.md)."""
