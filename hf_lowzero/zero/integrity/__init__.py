"""Integrity checks while training ([Note: integrity checks] in ``checker.py``): replicas hashed and
compared, reductions checked by checksums; a room of its own, tapping the reduction through
``grads.reducer.ReductionTap``."""

from hf_lowzero.zero.integrity.checker import IntegrityChecker, IntegrityError

__all__ = ["IntegrityChecker", "IntegrityError"]
