"""A local multi-node Ray cluster for the tests: ``ray.cluster_utils.Cluster`` (each node a raylet of
its own on this machine; removing one kills its processes) with a head node that runs no training
worker and worker nodes of one ``worker_slot`` each (``resources_per_worker='{"worker_slot": 1}'``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster


def add_slot_node(cluster: Cluster):
    """A new worker node with one worker slot."""
    return cluster.add_node(num_cpus=1, resources={"worker_slot": 1})


def with_slots(cluster: Cluster, n: int) -> None:
    """Exactly ``n`` worker nodes in ``cluster.slot_nodes``, fresh ones added as needed."""
    while len(cluster.slot_nodes) > n:
        cluster.remove_node(cluster.slot_nodes.pop())
    while len(cluster.slot_nodes) < n:
        cluster.slot_nodes.append(add_slot_node(cluster))
    cluster.wait_for_nodes()


@contextlib.contextmanager
def slot_cluster(worker_nodes: int) -> Iterator[tuple[Cluster, list]]:
    """``(cluster, nodes)``: the connected cluster and its ``worker_nodes`` worker nodes (a list the
    test may change as it adds and removes nodes); everything is shut down on exit."""
    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray Train hands RAY_TRAIN_* on to its controller: a restart sized by the autoscaling
        # coordinator's stale view (refreshed every 20 s) for a lost node gives up after 5 s, not 60 s.
        env.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        nodes = [add_slot_node(cluster) for _ in range(worker_nodes)]
        root = str(Path(__file__).resolve().parents[1])  # workers import tests.* (callbacks of the tests)
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
        try:
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()
