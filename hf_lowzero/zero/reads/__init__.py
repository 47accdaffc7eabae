"""Every read of a param waits for its all-gather: the wait plan learned from the forward's reads,
and the check that names a read racing a gather ([Note: every read waits] in ``plan.py``)."""

from hf_lowzero.zero.reads.plan import OUR_HOOK, StaleParamRead, WaitPlan, WatchedParam, ours

__all__ = ["OUR_HOOK", "StaleParamRead", "WaitPlan", "WatchedParam", "ours"]
