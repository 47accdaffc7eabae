"""A fake multi-node autoscaling Ray cluster on this machine: start it, watch its nodes, tear it down.

    python ray_jobs/local_cluster.py -- python examples/ray_sweep.py --max-concurrent 2

runs a command against a new fake cluster (``ray_jobs/local_autoscaling.yaml``; the command finds it
through ``RAY_ADDRESS``), printing the worker nodes as the autoscaler adds and removes them, then
ends every process of that cluster. Demo and test code, not part of the library.

Example::

    with LocalAutoscalingCluster("ray_jobs/local_autoscaling.yaml") as cluster:
        with WorkerNodeSampler(cluster) as sampler:
            subprocess.run(["python", "ray_jobs/sweep.py", "--address", cluster.gcs_address],
                           env=cluster.client_env, check=True)
            cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=120)  # idle nodes removed
        print(sampler.peak())  # most worker nodes alive at once

Ray's ``fake_multinode`` provider runs inside the autoscaler (the head's ``monitor.py``) and starts
each "node" as a raylet of its own on this machine, with the node id ``fff...f0000N`` and the
resources of its node type. ``ray_jobs/autoscale_demo.py`` and ``tests/test_autoscaling.py`` use it.

# [Note: fake cluster teardown]
``ray stop`` ends every Ray process on the machine, other people's included, so we never call it.
The head is ``ray start --head --block`` in a session of its own (``start_new_session=True``), and
everything the cluster starts stays in that session: the head's processes, the autoscaler, the fake
worker nodes (children of the autoscaler) and the core workers of every raylet (each in a process
group of its own, so killing the head's group would miss them; same session). Job drivers are
the exception: the job supervisor starts them in a new session, but they descend from the supervisor's
worker. So ``stop()`` signals the session and
the process tree of the head: SIGTERM, then SIGKILL for what is still alive after a short grace
(a raylet takes ~15 s to exit gracefully, the head ~30 s; nothing of a throwaway cluster needs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import yaml
from ray.util import get_node_ip_address

FAKE_HEAD_NODE_TYPE = "ray.head.default"  # the node type fake_multinode gives the head (node_provider.py)
_HEAD_FLAGS = {"CPU": "--num-cpus", "GPU": "--num-gpus", "object_store_memory": "--object-store-memory"}


class LocalAutoscalingCluster:
    """A Ray head with the fake multi-node autoscaler, on free ports and a temp dir of its own.

    ``config_path`` is an autoscaler config with ``provider: {type: fake_multinode}`` (see
    ``ray_jobs/local_autoscaling.yaml``); the head gets the resources of its ``ray.head.default``
    type. ``port`` is the GCS port (default: a free one; the provider learns it from
    ``provider.gcs_address``). Clients connect to ``gcs_address`` (``ray.init``, ``sweep.py
    --address``) or ``dashboard_url`` (job submission, state API) and run with ``client_env``
    (``RAY_ADDRESS`` set to this cluster, token auth off).

    Example::

        cluster = LocalAutoscalingCluster("ray_jobs/local_autoscaling.yaml")
        cluster.start()
        try:
            print(cluster.alive_worker_nodes())  # [] until work arrives
        finally:
            cluster.stop()
    """

    def __init__(self, config_path: str | os.PathLike, port: int | None = None) -> None:
        self.config = load_fake_cluster_config(config_path)
        self.port = port
        self.temp_dir: str | None = None
        self.gcs_address: str | None = None
        self.dashboard_url: str | None = None
        self.client_env: dict[str, str] = {}
        self._head: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> None:
        """Start the head and its autoscaler; returns once the head node is alive."""
        if self._head is not None:
            raise RuntimeError("this LocalAutoscalingCluster is already started; stop() it first")
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            if os.environ.get(var):  # Ray's state API prefers them to the address it is given
                raise RuntimeError(f"{var}={os.environ[var]} is set: this process would watch that cluster; unset it")
        if self.port is not None and not _port_is_free(self.port):
            raise RuntimeError(f"port {self.port} is in use (another Ray cluster?); pass port=None for a free one")
        # Every port at once, each socket held until all are chosen: one at a time, the OS may hand out
        # the same free port twice (seen: the GCS and the client server given one port, and the head refused it).
        free = free_ports(4, besides=self.port)
        port, dashboard_port = self.port or free[0], free[1]
        # The address Ray itself advertises: processes that find the cluster by scanning command
        # lines ("auto") refuse to choose when the nodes name it in two ways (127.0.0.1 and the IP).
        node_ip = get_node_ip_address()
        self.gcs_address, self.dashboard_url = f"{node_ip}:{port}", f"http://127.0.0.1:{dashboard_port}"
        # Short: Ray's unix sockets live under it and socket paths are limited to 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="rayfake_", dir="/tmp")
        # Token auth would be on by default (ray >= 2.59); this throwaway cluster runs without. With
        # RAY_ADDRESS, every process of it that looks a cluster up ("auto", the state API without an
        # address, as Ray Train's placement-group cleaner does) finds this one, not another on the machine.
        self.client_env = os.environ | {
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": self.gcs_address,
        }
        config = json.loads(json.dumps(self.config))
        config["provider"]["gcs_address"] = self.gcs_address  # else the provider assumes port 6379
        config_file = Path(self.temp_dir) / "autoscaling.yaml"
        config_file.write_text(yaml.safe_dump(config))
        command = [
            "ray", "start", "--head", "--block", "--node-ip-address", node_ip, "--port", str(port),
            "--temp-dir", self.temp_dir, "--autoscaling-config", str(config_file), "--disable-usage-stats",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
            "--ray-client-server-port", str(free[2]), "--dashboard-agent-listen-port", str(free[3]),
        ]  # fmt: skip
        command += _head_resource_flags(config["available_node_types"][FAKE_HEAD_NODE_TYPE].get("resources", {}))
        env = self.client_env | {
            "RAY_FAKE_CLUSTER": "1",  # FakeMultiNodeProvider refuses to run without it
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # react within a second (default 5)
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # no 30 s drain on SIGTERM
        }
        with open(Path(self.temp_dir) / "head.log", "w") as log:
            self._head = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_for_head(timeout_s)
        except BaseException:
            self.stop()
            raise

    def alive_worker_nodes(self) -> list[str]:
        """Ids of the alive nodes other than the head, sorted.

        Example::

            assert cluster.alive_worker_nodes() == []  # an idle cluster has no worker nodes
        """
        return sorted(n.node_id for n in self._alive_nodes() if not n.is_head_node)

    def head_node_id(self) -> str:
        """The head node's id.

        Example::

            assert cluster.head_node_id() not in cluster.alive_worker_nodes()
        """
        return next(n.node_id for n in self._alive_nodes() if n.is_head_node)

    def wait_for_worker_nodes(self, until: Callable[[int], bool], timeout_s: float, poll_s: float = 1.0) -> int:
        """Poll the number of alive worker nodes until ``until(count)``; returns that count.

        Raises ``TimeoutError`` (with the last count) after ``timeout_s``.

        Example::

            cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=120)  # idle nodes are gone
        """
        deadline = time.monotonic() + timeout_s
        while True:
            count = len(self.alive_worker_nodes())
            if until(count):
                return count
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{count} worker nodes still alive after {timeout_s} s; the autoscaler's log is "
                    f"{self.temp_dir}/session_latest/logs/monitor.log"
                )
            time.sleep(poll_s)

    def train_worker_placements(self) -> list[tuple[str, str]]:
        """``(job_id, node_id)`` of every Ray Train worker actor the cluster ran, alive or dead.

        Example::

            nodes = {node for job, node in cluster.train_worker_placements()}
            assert cluster.head_node_id() not in nodes  # no training on the head
        """
        from ray.util.state import list_actors

        actors = list_actors(address=self.dashboard_url, limit=10_000)
        return sorted((a.job_id, a.node_id) for a in actors if a.class_name == "RayTrainWorker")

    def stop(self, grace_s: float = 3.0) -> list[int]:
        """End every process of the cluster (see [Note: fake cluster teardown]) and remove its temp
        dir; returns the pids still alive afterwards (none, unless one outlives SIGKILL)."""
        if self._head is None:
            return []
        session = self._head.pid
        victims = _session_and_tree(session)
        for p in victims:
            _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(victims, timeout=grace_s)
        for _ in range(3):  # again: a process may have started another one meanwhile
            alive = [p for p in alive + _session_and_tree(session) if _is_running(p)]
            for p in alive:
                _signal(p, signal.SIGKILL)
            _, alive = psutil.wait_procs(alive, timeout=10)
            if not alive:
                break
        self._head.wait(timeout=10)
        self._head = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return [p.pid for p in alive]

    def __enter__(self) -> LocalAutoscalingCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _alive_nodes(self) -> list:
        from ray.util.state import list_nodes

        # Filtered here: with a state filter on the server, Ray 2.60 reports dead nodes as truncated output.
        return [n for n in list_nodes(address=self.dashboard_url, limit=10_000) if n.state == "ALIVE"]

    def _wait_for_head(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._head.poll() is not None:
                log = (Path(self.temp_dir) / "head.log").read_text()[-3000:]
                raise RuntimeError(f"`ray start --head` exited with {self._head.returncode}:\n{log}")
            with contextlib.suppress(Exception):  # the dashboard is not up yet
                if any(n.is_head_node for n in self._alive_nodes()):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray head was not up after {timeout_s} s; see {self.temp_dir}/head.log")
            time.sleep(0.5)


class WorkerNodeSampler:
    """Samples the alive worker nodes of ``cluster`` every ``interval_s`` in a background thread.

    ``samples`` holds ``(seconds since start, worker node ids)``; ``on_change(seconds, ids)`` is
    called whenever the set changed (the demo prints it).

    Example::

        with WorkerNodeSampler(cluster) as sampler:
            run_the_sweep()
        assert sampler.peak() > 0
    """

    def __init__(
        self,
        cluster: LocalAutoscalingCluster,
        interval_s: float = 1.0,
        on_change: Callable[[float, list[str]], None] | None = None,
    ) -> None:
        self.cluster, self.interval_s, self.on_change = cluster, interval_s, on_change
        self.samples: list[tuple[float, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-node-sampler", daemon=True)
        self._start = time.monotonic()

    def seen(self) -> set[str]:
        """Every worker node id alive in some sample."""
        return {node for _, nodes in self.samples for node in nodes}

    def peak(self) -> int:
        """The most worker nodes alive in one sample."""
        return max((len(nodes) for _, nodes in self.samples), default=0)

    def __enter__(self) -> WorkerNodeSampler:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the last sample shows the cluster as the block left it

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                return

    def _sample(self) -> None:
        nodes = None
        with contextlib.suppress(Exception):  # a transient state-API failure: no sample this time
            nodes = self.cluster.alive_worker_nodes()
        if nodes is not None:
            if self.on_change and (not self.samples or self.samples[-1][1] != nodes):
                self.on_change(time.monotonic() - self._start, nodes)
            self.samples.append((time.monotonic() - self._start, nodes))


def load_fake_cluster_config(path: str | os.PathLike) -> dict:
    """Read an autoscaler config for the fake multi-node provider, checked against Ray's schema.

    Raises ``ValueError`` saying what is wrong (Ray's schema, the provider type, the head type).

    Example::

        config = load_fake_cluster_config("ray_jobs/local_autoscaling.yaml")
        print(config["available_node_types"]["cpu_worker"]["resources"])
    """
    from ray.autoscaler._private.util import validate_config

    config = yaml.safe_load(Path(path).read_text())
    try:
        validate_config(config)
    except Exception as e:  # jsonschema.ValidationError, or Ray's own ValueError/RuntimeError
        raise ValueError(f"{path} is not a valid Ray cluster config: {e}") from e
    if config["provider"].get("type") != "fake_multinode":
        raise ValueError(f"{path}: provider.type must be 'fake_multinode', got {config['provider'].get('type')!r}")
    if config.get("head_node_type") != FAKE_HEAD_NODE_TYPE:
        raise ValueError(
            f"{path}: head_node_type must be {FAKE_HEAD_NODE_TYPE!r} (the fake provider's name for the head), "
            f"got {config.get('head_node_type')!r}"
        )
    return config


def _head_resource_flags(resources: dict) -> list[str]:
    """``ray start`` flags giving the head the resources its node type declares."""
    rest = dict(resources)
    flags = [arg for name, flag in _HEAD_FLAGS.items() if name in rest for arg in (flag, str(int(rest.pop(name))))]
    return flags + (["--resources", json.dumps(rest)] if rest else [])


def _session_and_tree(session: int) -> list[psutil.Process]:
    """The live processes of ``session`` and every descendant of them (job drivers start sessions
    of their own)."""
    found = {}
    for p in psutil.process_iter():
        with contextlib.suppress(OSError):
            if os.getsid(p.pid) == session:
                found[p.pid] = p
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            found.update({child.pid: child for child in p.children(recursive=True)})
    return [p for p in found.values() if _is_running(p)]


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)


def free_ports(count: int, besides: int | None = None) -> list[int]:
    """``count`` distinct free ports, none of them ``besides``: every socket is held until all are bound."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket())
            s.bind(("", 0))
            if s.getsockname()[1] != besides:
                ports.append(s.getsockname()[1])
        return ports


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def main(argv: list[str] | None = None) -> int:
    """Run the command after ``--`` against a new fake cluster; returns its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(Path(__file__).with_name("local_autoscaling.yaml")))
    a = p.parse_args(ours)
    if not Path(a.config).is_file():
        p.error(f"--config {a.config}: no such file")
    if not command:
        p.error("give the command to run after --, e.g. -- python examples/ray_sweep.py")

    def show(seconds: float, nodes: list[str]) -> None:
        print(f"[local cluster] +{seconds:.0f}s: {len(nodes)} worker node(s) alive", flush=True)

    with LocalAutoscalingCluster(a.config) as cluster:
        print(f"[local cluster] up: GCS {cluster.gcs_address}, dashboard {cluster.dashboard_url}", flush=True)
        with WorkerNodeSampler(cluster, on_change=show):
            return subprocess.run(command, env=cluster.client_env).returncode


if __name__ == "__main__":
    sys.exit(main())
