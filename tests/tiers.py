"""The test tiers: ``python -m pytest -m "not slow"`` (the README's command, under 8 minutes on a
2-core machine) and ``-m slow`` (``.ci/run`` runs it after): long Ray runs, launcher subprocesses,
and the larger world sizes and longer parity runs of tests whose smaller cases stay fast.

``.ci/run`` runs the slow tier in three lanes at once, each printing its 15 slowest tests:

- the tests marked ``ray_cluster`` (each starts Ray, and spends most of its time waiting on it:
  worker starts, polls, restarts), in two lanes: those marked ``ray_nodes`` too (a multi-node
  cluster on this machine: ``tests/ray_clusters.py``, the fake autoscaling cluster), and the others
  (the jobs and guides on a local Ray instance);
- the rest (ranks that keep the cores busy), then, in the same lane, the Ray tests marked
  ``ray_late``: the rest ends well before the Ray lanes, so a share of their tests runs there, and
  the three lanes end near the same time.

Within a lane the Ray tests run one at a time. Each group of Ray tests (the two Ray lanes and the
``ray_late`` ones) has its own ``HF_LOWZERO_SNAPSHOT_DIR`` and ``RAY_TMPDIR``: otherwise one's tests
would see another's snapshot folders, and a ``ray.init()`` without an address would join another's
newest cluster. Mark every slow test that starts Ray ``@ray_run`` (``@ray_nodes_run`` on a
multi-node cluster). ``ray_late`` moves tests that share no cluster with the others of their lane:
a whole module (``pytestmark = pytest.mark.ray_late``, as ``tests/test_autoscaling.py``: its
module-scoped cluster starts once), or tests that each start their own (the Ray guides' examples
in ``tests/test_docs.py``). A module's fast tests stay in the fast tier: every lane selects ``slow``."""

from __future__ import annotations

import pytest


def slow(value):
    """A ``parametrize`` case for the slow tier; a tuple is one case of several arguments."""
    values = value if isinstance(value, tuple) else (value,)
    return pytest.param(*values, marks=pytest.mark.slow)


def ray_run(test):
    """A slow test that starts a Ray cluster (or a job that does): the slow tier's first Ray lane."""
    return pytest.mark.ray_cluster(pytest.mark.slow(test))


def ray_nodes_run(test):
    """A slow test on a multi-node Ray cluster of this machine: the slow tier's second Ray lane."""
    return pytest.mark.ray_nodes(ray_run(test))
