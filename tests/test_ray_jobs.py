"""Ray job submission: a local head on loopback runs the fine-tune job to SUCCEEDED.

Runs after tests/test_ray.py (its embedded instance is shut down by then): ``ray stop`` here ends
every Ray process on this machine.
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local_head(tmp_path):
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    dashboard = free_port()
    # Short: Ray's unix sockets live under it and socket paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    start = [
        "ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(free_port()),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--num-cpus", "4",
        "--temp-dir", temp_dir, "--disable-usage-stats",
    ]  # fmt: skip
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submitted_job_succeeds(local_head, tmp_path):
    address, env = local_head
    storage = tmp_path / "runs"
    cmd = [sys.executable, str(ROOT / "ray_jobs/submit.py"), "--address", address, "--timeout", "400", "--",
           "--max-steps", "6", "--save-steps", "3", "--storage-path", str(storage), "--name", "submitted"]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ended: SUCCEEDED" in result.stdout
    assert "hf_lowzero fine-tune finished" in result.stdout  # the job's own output came back
    assert list(storage.glob("submitted/checkpoint_*/checkpoint-6/zero_optimizer/zero_meta.json"))


def test_finetune_flags_map_onto_the_config():
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    address, config = parse_args(["--offload-optimizer", "--zero-stage", "1", "--num-workers", "3"])
    assert address is None
    assert (config.offload_optimizer, config.zero_stage, config.num_workers) == (True, 1, 3)
    with pytest.raises(ValueError, match="zero_stage=3 is invalid"):
        parse_args(["--zero-stage", "3"])
