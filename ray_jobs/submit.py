"""Submit the fine-tune to a Ray cluster as a Ray job and follow its logs until it ends.

    python ray_jobs/submit.py --address http://HEAD_IP:8265 -- --use-gpu --num-workers 8 --storage-path s3://bucket/runs

Everything after ``--`` goes to ``ray_jobs/finetune.py``. The repository is shipped as the job's
``working_dir``; exits 0 when the job SUCCEEDED, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from ray.job_submission import JobStatus, JobSubmissionClient

ROOT = Path(__file__).resolve().parents[1]
EXCLUDES = [".git", "out", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache", "benchmarks/results"]


def submit(address: str, finetune_args: list[str], follow: bool = True, timeout_s: float = 3600) -> JobStatus:
    """Submit ``ray_jobs/finetune.py finetune_args`` to ``address``; returns the final status."""
    if os.path.exists(Path.home() / ".ray" / "auth_token"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # clusters started by ray >= 2.59 use token auth
    client = JobSubmissionClient(address)
    job_id = client.submit_job(
        entrypoint="python ray_jobs/finetune.py " + shlex.join(finetune_args),
        runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES, "env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
    )
    print(f"submitted job {job_id} to {address}", flush=True)
    if not follow:
        return client.get_job_status(job_id)
    shown, deadline = 0, time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        print(logs[shown:], end="", flush=True)
        shown = len(logs)
        if status.is_terminal():
            print(f"\njob {job_id} ended: {status}", flush=True)
            return status
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            raise TimeoutError(f"job {job_id} still {status} after {timeout_s} s; stopped it")
        time.sleep(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, finetune_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"))
    p.add_argument("--no-follow", action="store_true", help="return after submitting")
    p.add_argument("--timeout", type=float, default=3600)
    a = p.parse_args(ours)
    if a.timeout <= 0:
        p.error(f"--timeout {a.timeout} is invalid; expected seconds > 0")
    status = submit(a.address, finetune_args, follow=not a.no_follow, timeout_s=a.timeout)
    ok = status == JobStatus.SUCCEEDED or (a.no_follow and not status.is_terminal())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
