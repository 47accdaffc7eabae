"""The tests' multi-process harness (lives in the library so the benchmarks share it)."""

from hf_lowzero.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
