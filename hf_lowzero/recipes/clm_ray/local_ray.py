"""The job's driver: a local Ray instance without Ray's known-harmless noise, and prints on the
workers that appear once ([Note: console noise] in ``hf_lowzero/ray/console.py`` says what each
setting silences).

Example::

    quiet_ray_train()
    start_local_ray(num_cpus=3)                      # driver, no cluster
    result = run_finetune(RayFinetuneConfig(num_workers=2))
"""

from __future__ import annotations

import os
import socket

import ray


def start_local_ray(num_cpus: int) -> None:
    """Start an embedded single-machine Ray instance whose console carries only what matters.

    Sets (unless already set) the local instance's environment knobs of [Note: console noise] and
    starts Ray with its dashboard on a free local port. ``address="local"`` never attaches to a stale
    ``/tmp/ray/ray_current_cluster`` by accident.

    Example::

        quiet_ray_train()
        start_local_ray(num_cpus=3)
        result = run_finetune(RayFinetuneConfig(num_workers=2))

    Args:
        num_cpus: The CPUs the instance offers its tasks and actors.
    """
    dashboard_port = _free_port()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # Ray's processes inherit the driver's environment, the state API's clients included.
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
    )


def quiet_ray_train() -> None:
    """Make prints on Ray Train workers appear once (see [Note: console noise]); call it on the
    driver before ``fit``: Ray Train hands the setting on to its controller and workers, also on a
    cluster.

    Example::

        quiet_ray_train()
        ray.init(address="auto")
    """
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
