"""Autoscaling on a fake multi-node Ray cluster (one machine, Ray's real autoscaler): worker nodes
are added for the sweep's trials and for the main job submitted through ``ray_jobs/submit.py``
(which follows its logs to SUCCEEDED), and removed when idle; each trial's result
equals that of the same training run without Ray. Also: ray_jobs/cluster.yaml passes Ray's
cluster-config schema, and broken configs are refused."""

import copy
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
import jsonschema  # noqa: E402
import ray.autoscaler  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.job_submission import JobSubmissionClient  # noqa: E402

from hf_lowzero.recipes.clm_ray import RayFinetuneConfig  # noqa: E402
from tests.ray_reference import losses_without_ray  # noqa: E402
from tests.tiers import ray_nodes_run  # noqa: E402

# .ci/run runs this module's Ray tests after the rest, in that lane: they start a cluster of their own (tests/tiers.py).
pytestmark = pytest.mark.ray_late
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ray_jobs"))  # the fake cluster is demo and test code, not the library's
import local_cluster  # noqa: E402
from local_cluster import LocalAutoscalingCluster, WorkerNodeSampler, load_fake_cluster_config  # noqa: E402

LOCAL_CONFIG = ROOT / "ray_jobs" / "local_autoscaling.yaml"
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
STEPS = 3
SCALE_DOWN_S = 120  # deadline for idle nodes to go (idle_timeout_minutes is 0.1)


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):  # they would redirect our state queries
            env.delenv(var, raising=False)
        cluster = LocalAutoscalingCluster(LOCAL_CONFIG)
        cluster.start()
        yield cluster
        assert cluster.stop() == [], "processes of the fake cluster outlived SIGKILL"


def run(cmd: list[str], env: dict, timeout_s: float = 400) -> str:
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def sweep(storage: Path) -> list[str]:
    """Two trials at once (one worker node each), a few steps."""
    return [sys.executable, str(ROOT / "ray_jobs/sweep.py"), "--learning-rates", "1e-3", "3e-3", "--zero-stages", "2",
            "--max-steps", str(STEPS), "--max-concurrent", "2", "--storage-path", str(storage)]  # fmt: skip


def trial_results(storage: Path) -> dict[tuple[float, int], tuple[float, dict]]:
    """(learning_rate, zero_stage) -> (the last loss the trial reported, its config), from Tune's
    result files."""
    results = {}
    for result_file in storage.glob("hf_lowzero_sweep/trial_*/result.json"):
        last = json.loads(result_file.read_text().splitlines()[-1])
        results[(last["config"]["learning_rate"], last["config"]["zero_stage"])] = (last["loss"], last["config"])
    return results


@ray_nodes_run
def test_sweep_trials_get_worker_nodes_that_go_when_idle(cluster, tmp_path):
    assert cluster.alive_worker_nodes() == []
    head = cluster.head_node_id()
    with WorkerNodeSampler(cluster) as sampler:
        out = run([*sweep(tmp_path / "fake"), "--address", cluster.gcs_address], cluster.client_env)
        cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=SCALE_DOWN_S)

    assert sampler.samples[0][1] == []
    assert sampler.peak() > 0
    assert sampler.samples[-1][1] == []
    # Every training worker of both trials ran on a node the autoscaler added, none on the head.
    workers = cluster.train_worker_placements()
    assert len(workers) >= 4, workers  # 2 trials x 2 workers (more if a trial was retried)
    assert {node for _, node in workers} <= sampler.seen()
    assert head not in {node for _, node in workers}

    # Each trial's loss is bit for bit the one of the same training run without Ray; the best
    # trial is the one with the least.
    results = trial_results(tmp_path / "fake")
    assert set(results) == {(1e-3, 2), (3e-3, 2)}
    losses = {key: loss for key, (loss, _) in results.items()}
    for key, (loss, trial_config) in results.items():
        config = RayFinetuneConfig(**trial_config["base"] | {"learning_rate": key[0], "zero_stage": key[1]})
        assert loss == losses_without_ray(config, tmp_path / f"reference_{key[0]}", world_size=2)[-1]["loss"], key
    assert losses[(1e-3, 2)] != losses[(3e-3, 2)]  # the trials did get their own configs
    best = re.search(r"best trial: lr=(\S+) zero_stage=(\d+)", out)
    assert (float(best[1]), int(best[2])) == min(losses, key=losses.get)
    assert "error=True" not in out


@ray_nodes_run
def test_submitted_job_trains_on_a_new_worker_node(cluster, tmp_path):
    cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=SCALE_DOWN_S)
    before = cluster.train_worker_placements()
    with WorkerNodeSampler(cluster) as sampler:
        submit = [sys.executable, str(ROOT / "ray_jobs/submit.py"), "--address", cluster.dashboard_url,
                  "--timeout", "400", "--", "--max-steps", str(STEPS), "--save-steps", str(STEPS),
                  "--storage-path", str(tmp_path), "--name", "autoscaled"]  # fmt: skip
        out = run(submit, cluster.client_env, timeout_s=500)
        cluster.wait_for_worker_nodes(lambda n: n == 0, timeout_s=SCALE_DOWN_S)

    assert "ended: SUCCEEDED" in out
    assert "hf_lowzero fine-tune finished" in out  # the job's own output came back through submit.py
    assert re.search(r"^restarts survived +0$", out, re.M), "the summary counts no restart"
    assert re.search(r"^model +not exported$", out, re.M), "a cluster run exports only when asked"
    submission_id = re.search(r"submitted job (\S+)", out)[1]
    job_id = JobSubmissionClient(cluster.dashboard_url).get_job_info(submission_id).job_id
    job_nodes = [node for job, node in cluster.train_worker_placements() if job == job_id]
    assert len(job_nodes) == 2  # the job's two training workers
    # They ran on a node added for the job (none was alive when it started), removed when idle.
    assert sampler.samples[0][1] == [] and sampler.samples[-1][1] == []
    assert set(job_nodes) <= sampler.seen()
    assert not set(job_nodes) & {node for _, node in before}
    assert list(tmp_path.glob(f"autoscaled/checkpoint_*/checkpoint-{STEPS}/zero_optimizer/zero_meta.json"))


def test_cluster_yaml_passes_rays_schema():
    config = yaml.safe_load((ROOT / "ray_jobs" / "cluster.yaml").read_text())
    schema = json.loads(RAY_SCHEMA.read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` checks, defaults filled in


def test_cluster_yaml_binds_the_dashboard_to_loopback_only():
    # Ray's job-submission API has no authentication of its own: on 0.0.0.0 anyone reaching the head
    # could run code on the cluster. docs/ray.md says how to reach it (ray dashboard, ssh -L).
    config = yaml.safe_load((ROOT / "ray_jobs" / "cluster.yaml").read_text())
    (head,) = [c for c in config["head_start_ray_commands"] if c.startswith("ray start --head")]
    assert re.findall(r"--dashboard-host[= ](\S+)", head) == ["127.0.0.1"]
    assert "0.0.0.0" not in (ROOT / "ray_jobs" / "cluster.yaml").read_text()


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c.update(idle_timeout_minute=5),  # misspelled key
        lambda c: c["available_node_types"]["gpu_worker"]["resources"].update(GPU=0.5),  # not an integer
        lambda c: c["available_node_types"]["gpu_worker"].pop("node_config"),  # required
    ],
)
def test_schema_catches_a_broken_cluster_yaml(break_it):
    config = yaml.safe_load((ROOT / "ray_jobs" / "cluster.yaml").read_text())
    break_it(config)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, json.loads(RAY_SCHEMA.read_text()))


def rename_head_type(config: dict) -> None:
    config["available_node_types"]["head"] = config["available_node_types"].pop("ray.head.default")
    config["head_node_type"] = "head"  # valid for Ray, not for the fake provider


def test_local_autoscaling_config_is_checked(tmp_path):
    config = load_fake_cluster_config(LOCAL_CONFIG)
    assert config["available_node_types"]["ray.head.default"]["resources"]["CPU"] == 0
    for edit, message in [
        (lambda c: c.pop("cluster_synced_files"), "cluster_synced_files"),
        (lambda c: c["provider"].update(type="aws"), "provider.type must be 'fake_multinode'"),
        (rename_head_type, "head_node_type must be 'ray.head.default'"),
    ]:
        broken = copy.deepcopy(config)
        edit(broken)
        (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_fake_cluster_config(tmp_path / "broken.yaml")


def test_a_start_that_cannot_work_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(RuntimeError, match="RAY_ADDRESS=10.0.0.1:6379 is set"):
        LocalAutoscalingCluster(LOCAL_CONFIG).start()
    monkeypatch.delenv("RAY_ADDRESS")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        cluster = LocalAutoscalingCluster(LOCAL_CONFIG, port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="is in use"):
            cluster.start()
        assert cluster.temp_dir is None


def test_the_heads_ports_are_distinct_and_never_the_one_given():
    """The head's ports are chosen together, each socket held until all are bound: chosen one at a
    time, the OS once gave the GCS and the client server one port, and the head refused to start."""
    with socket.socket() as s:
        s.bind(("", 0))
        given = s.getsockname()[1]  # free again below, as a --port the caller names
    ports = local_cluster.free_ports(64, besides=given)
    assert len(ports) == 64 and len(set(ports)) == 64 and given not in ports
