"""Autoscaling on one machine: the sweep and the main job on a fake multi-node Ray cluster.

    python ray_jobs/autoscale_demo.py                   # a few minutes on 2 cores
    python ray_jobs/autoscale_demo.py --max-steps 20 --storage-path /tmp/autoscale_demo

Starts a Ray head with Ray's own autoscaler and its fake multi-node provider
(``ray_jobs/local_autoscaling.yaml``: a head without CPUs, 0-2 worker nodes of 2 CPUs, idle nodes
removed after 6 s), runs ``ray_jobs/sweep.py`` against it (two trials at once) and submits the main
job with ``ray_jobs/submit.py``, printing the worker nodes whenever the autoscaler adds or removes
one. At the end it ends every process of the cluster it started (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from local_cluster import LocalAutoscalingCluster, WorkerNodeSampler  # noqa: E402  (ray_jobs/)

IDLE_DEADLINE_S = 180


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=10, help="steps of every trial and of the job")
    p.add_argument("--storage-path", default=None, help="where the sweep and the job write (default: a new temp dir)")
    a = p.parse_args(argv)
    if a.max_steps < 1:
        p.error(f"--max-steps {a.max_steps} is invalid; expected a number of steps >= 1")
    storage = Path(a.storage_path or tempfile.mkdtemp(prefix="hf_lowzero_autoscale_demo_")).resolve()

    with LocalAutoscalingCluster(ROOT / "ray_jobs" / "local_autoscaling.yaml") as cluster:
        say(f"fake cluster up: GCS {cluster.gcs_address}, dashboard {cluster.dashboard_url}, no worker nodes")
        with WorkerNodeSampler(cluster, on_change=show_nodes) as sampler:
            say("the sweep: 2 trials at once, each needs a worker node for its 2 training workers")
            sweep = [sys.executable, str(ROOT / "ray_jobs/sweep.py"), "--address", cluster.gcs_address,
                     "--learning-rates", "1e-3", "3e-3", "--zero-stages", "2", "--max-steps", str(a.max_steps),
                     "--max-concurrent", "2", "--storage-path", str(storage / "sweeps")]  # fmt: skip
            check(subprocess.run(sweep, env=cluster.client_env), "the sweep")
            wait_until_idle(cluster)
            say("the main job, submitted as a Ray job: its 2 training workers need a worker node again")
            submit = [sys.executable, str(ROOT / "ray_jobs/submit.py"), "--address", cluster.dashboard_url, "--",
                      "--max-steps", str(a.max_steps), "--save-steps", str(a.max_steps),
                      "--storage-path", str(storage / "runs"), "--name", "autoscaled"]  # fmt: skip
            check(subprocess.run(submit, env=cluster.client_env), "the submitted job")
            wait_until_idle(cluster)
        workers_per_node = Counter(node for _, node in cluster.train_worker_placements())
        head = cluster.head_node_id()
    say(f"worker nodes at once: at most {sampler.peak()}; {len(sampler.seen())} added and removed in all")
    say("training workers per node: " + ", ".join(f"{short(n)}: {k}" for n, k in sorted(workers_per_node.items())))
    say(f"on the head: {workers_per_node[head]}; cluster stopped; results in {storage}")


def wait_until_idle(cluster: LocalAutoscalingCluster) -> None:
    say("waiting for the autoscaler to remove the idle worker nodes")
    cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=IDLE_DEADLINE_S)


def check(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {result.returncode}); see its output above")


def show_nodes(seconds: float, nodes: list[str]) -> None:
    say(f"+{seconds:.0f}s: {len(nodes)} worker node(s) alive {[short(n) for n in nodes]}")


def short(node_id: str) -> str:
    return "..." + node_id[-5:]  # fake nodes are fff...f0000N; the head is ...00000


def say(message: str) -> None:
    print(f"[autoscale demo] {message}", flush=True)


if __name__ == "__main__":
    main()
