"""Every read of a param waits for its all-gather: the wait plan learned from the forward's reads,
and the check that names a read racing a gather ([Note: every read waits] in ``plan.py``)."""

from hf_lowzero.zero.reads.plan import StaleParamRead, WaitPlan, WatchedParam

__all__ = ["StaleParamRead", "WaitPlan", "WatchedParam"]
