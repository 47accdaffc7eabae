"""A record of every start of the training function, kept in the run's storage folder, so that the
driver can tell how many worker-group restarts a fit survived.

Ray Train reruns the training function from the top on every worker-group restart (a failure, or
an elastic resize) and its ``Result`` says nothing of how often that happened. So the first rank
writes one small JSON file per attempt into ``<storage_path>/<name>/hf_lowzero_attempts/``; the
driver counts the files before and after ``fit``. Storage is local, shared or ``s3://...`` alike
(pyarrow), like Ray's own checkpoints.

Example::

    before = count_attempts("/tmp/ray_results", "demo")
    result = run_finetune(RayFinetuneConfig(storage_path="/tmp/ray_results", name="demo"))
    restarts = count_attempts("/tmp/ray_results", "demo") - before - 1
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid

import pyarrow.fs

ATTEMPTS_DIR = "hf_lowzero_attempts"


def record_attempt(storage_path: str, name: str, world_size: int) -> int:
    """Write the record of one attempt of run ``name``; returns the run's attempts so far, this one
    included. Call it once per attempt, on one rank.

    Example::

        >>> record_attempt("/tmp/ray_results", "demo", world_size=2)   # the run's first attempt
        1
    """
    fs, folder = _attempts_folder(storage_path, name)
    fs.create_dir(folder, recursive=True)
    record = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "world_size": world_size}
    with fs.open_output_stream(f"{folder}/attempt-{time.time_ns()}-{uuid.uuid4().hex[:8]}.json") as f:
        f.write(json.dumps(record).encode())
    return count_attempts(storage_path, name)


def count_attempts(storage_path: str, name: str) -> int:
    """How many attempts run ``name`` has recorded (0 before its first).

    Example::

        >>> count_attempts("/tmp/ray_results", "never_ran")
        0
    """
    fs, folder = _attempts_folder(storage_path, name)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(folder, allow_not_found=True))
    return sum(info.base_name.startswith("attempt-") for info in infos)


def _attempts_folder(storage_path: str, name: str) -> tuple[pyarrow.fs.FileSystem, str]:
    if "://" in storage_path:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage_path)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), os.path.abspath(storage_path)
    return fs, f"{root}/{name}/{ATTEMPTS_DIR}"
