"""The test tiers: ``python -m pytest -m "not slow"`` (the README's command, under 8 minutes on a
2-core machine) and ``-m slow`` (``.ci/run`` runs it after): long Ray runs, launcher subprocesses,
and the larger world sizes and longer parity runs of tests whose smaller cases stay fast.

``.ci/run`` runs the slow tier in two lanes at once: the tests marked ``ray_cluster`` (each starts a
Ray cluster, and spends most of its time waiting on Ray: worker starts, polls, restarts) one at a
time, beside the rest (ranks that keep the cores busy). Two Ray tests never run at once: they would
see each other's snapshot holders and folders. Mark every slow test that starts Ray ``@ray_run``."""

from __future__ import annotations

import pytest


def slow(value):
    """A ``parametrize`` case for the slow tier; a tuple is one case of several arguments."""
    values = value if isinstance(value, tuple) else (value,)
    return pytest.param(*values, marks=pytest.mark.slow)


def ray_run(test):
    """A slow test that starts a Ray cluster (or a job that does): the slow tier's Ray lane."""
    return pytest.mark.ray_cluster(pytest.mark.slow(test))
