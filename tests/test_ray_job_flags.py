"""The main job's command line (``ray_jobs/finetune.py``) maps onto ``RayFinetuneConfig``.

Submitting it as a Ray job is tested against a running cluster in ``tests/test_autoscaling.py``
(``ray_jobs/submit.py`` follows the job to SUCCEEDED and prints its summary).
"""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def test_finetune_flags_map_onto_the_config(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local run: it exports by default
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    address, export_dir, config = parse_args(["--offload-optimizer", "--zero-stage", "1", "--num-workers", "3"])
    assert address is None and export_dir == os.path.join(config.storage_path, config.name, "export")
    assert (config.offload_optimizer, config.zero_stage, config.num_workers) == (True, 1, 3)
    with pytest.raises(ValueError, match="zero_stage=3 is invalid"):
        parse_args(["--zero-stage", "3"])
    config = parse_args(["--zero-stage", "auto", "--zero-device-memory", "40GiB"])[2]
    args = config.training_arguments("out", world_size=2)
    assert (config.zero_stage, config.snapshots, args.zero_stage, args.zero_device_memory) == (
        "auto", "auto", "auto", "40GiB"
    )  # fmt: skip
    with pytest.raises(ValueError, match="zero_device_memory='lots' is invalid"):
        parse_args(["--zero-stage", "auto", "--zero-device-memory", "lots"])
    config = parse_args(["--optim", "adafactor", "--zero-partition", "params"])[2]
    args = config.training_arguments("out", world_size=2)
    assert (args.optim, args.to_zero_config().partition) == ("adafactor", "params")
    with pytest.raises(ValueError, match="partition='whole' is invalid"):
        parse_args(["--zero-partition", "whole"])
    assert parse_args(["--no-export"])[1] is None
    assert parse_args(["--address", "auto"])[1] is None  # a cluster run exports only when asked
    assert parse_args(["--address", "auto", "--export-dir", "out/final"])[1] == os.path.abspath("out/final")
    with pytest.raises(SystemExit):  # argparse: not allowed with --export-dir
        parse_args(["--no-export", "--export-dir", "out/final"])
