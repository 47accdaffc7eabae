"""The main job: fine-tune a tiny causal LM with ZeRO on Ray, surviving worker failures.

    python ray_jobs/finetune.py                                    # embedded local Ray, 2 CPU workers
    python ray_jobs/finetune.py --inject-failure-at-step 15        # kill a worker once, watch it resume
    RAY_ADDRESS=auto python ray_jobs/finetune.py --use-gpu --num-workers 8 --storage-path /mnt/shared/runs

With no ``--address`` and no ``RAY_ADDRESS`` it starts a local Ray instance; on a cluster it places
one worker per GPU (``--use-gpu``, NCCL). Rerunning with the same ``--name`` (and storage path)
resumes the latest checkpoint, resharded if ``--num-workers`` changed. Prints the final metrics
and where the checkpoint is.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import ray  # noqa: E402

from hf_lowzero.ray import RayFinetuneConfig, run_finetune  # noqa: E402


def parse_args(argv=None) -> tuple[str | None, RayFinetuneConfig]:
    """Flags are RayFinetuneConfig's fields (``--num-workers``, ``--use-gpu``, ...) plus ``--address``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    hints = typing.get_type_hints(RayFinetuneConfig)
    for f in dataclasses.fields(RayFinetuneConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if hints[f.name] is bool:
            p.add_argument(flag, action="store_true", help=help)
        else:
            kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = help if "default" in help else f"{help} (default: {default})"
            p.add_argument(flag, type=kind, default=None, help=shown)
    a = p.parse_args(argv)
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(RayFinetuneConfig)}
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if "storage_path" in given and "://" not in given["storage_path"]:
        given["storage_path"] = os.path.abspath(given["storage_path"])
    given.setdefault("name", f"{RayFinetuneConfig().name}_{time.strftime('%Y%m%d-%H%M%S')}")  # a new run
    return a.address, RayFinetuneConfig(**given)


def main(argv=None) -> None:
    address, config = parse_args(argv)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # "local": never attach to a stale /tmp/ray/ray_current_cluster by accident.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, config.num_workers + 1), include_dashboard=False)
    result = run_finetune(config)
    print("\n=== hf_lowzero fine-tune finished ===")
    print("final metrics:", {k: v for k, v in result.metrics.items() if not isinstance(v, dict)})
    print("checkpoint:", result.checkpoint.path if result.checkpoint else None)
    if result.error:
        raise SystemExit(f"training failed: {result.error}")


if __name__ == "__main__":
    main()
