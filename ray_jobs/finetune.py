"""The main job: fine-tune a tiny causal LM with ZeRO on Ray, surviving worker failures.

    python ray_jobs/finetune.py                                    # embedded local Ray, 2 CPU workers
    python ray_jobs/finetune.py --inject-failure-at-step 15        # kill a worker once, watch it resume
    RAY_ADDRESS=auto python ray_jobs/finetune.py --use-gpu --num-workers 8 --storage-path /mnt/shared/runs

With no ``--address`` and no ``RAY_ADDRESS`` it starts a local Ray instance; on a cluster it places
one worker per GPU (``--use-gpu``, NCCL). Rerunning with the same ``--name`` (and storage path)
resumes the latest checkpoint, resharded if ``--num-workers`` changed. Prints one line per step from
the first worker and ends with a summary: final loss, time, restarts survived, the checkpoint, and
the exported model (``--export-dir``; a local run exports to ``<storage>/<name>/export`` by default).
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

from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, RunSummary, run_with_summary  # noqa: E402
from hf_lowzero.recipes.clm_ray.local_ray import quiet_ray_train, start_local_ray  # noqa: E402


def parse_args(argv=None) -> tuple[str | None, str | None, RayFinetuneConfig]:
    """``(address, export_dir, config)``: RayFinetuneConfig's fields (``--num-workers``, ``--use-gpu``,
    ...) plus ``--address`` (else ``RAY_ADDRESS``; None: a local instance), ``--export-dir`` and ``--no-export``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    export = p.add_mutually_exclusive_group()
    export.add_argument(
        "--export-dir",
        default=None,
        help="write the final model here as a from_pretrained directory, on the machine running this script "
        "(default: <storage-path>/<name>/export for a local run, no export on a cluster)",
    )
    export.add_argument("--no-export", action="store_true", help="do not export the final model")
    hints = typing.get_type_hints(RayFinetuneConfig)
    for f in dataclasses.fields(RayFinetuneConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if hints[f.name] is bool:  # --flag, or --flag/--no-flag where it is on by default
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            p.add_argument(flag, action=action, default=None, help=help)
        else:
            kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            kind = kinds[0] if len(kinds) == 1 else str  # e.g. num_workers "2" or "1-4": the config parses it
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = help if "default" in help else f"{help} (default: {default})"
            p.add_argument(flag, type=kind, default=None, help=shown)
    a = p.parse_args(argv)
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(RayFinetuneConfig)}
    given = {k: v for k, v in given.items() if v is not None}
    if "storage_path" in given and "://" not in given["storage_path"]:
        given["storage_path"] = os.path.abspath(given["storage_path"])
    given.setdefault("name", f"{RayFinetuneConfig().name}_{time.strftime('%Y%m%d-%H%M%S')}")  # a new run
    try:
        config = RayFinetuneConfig(**given)
        config.check_training_arguments()  # what the workers would refuse, refused before a cluster starts
    except (ValueError, OSError) as e:  # a bad flag value: one line and exit status 2, as argparse's errors
        p.exit(2, f"{p.prog}: error: {e}\n")
    address = a.address or os.environ.get("RAY_ADDRESS")
    export_dir = a.export_dir and os.path.abspath(a.export_dir)
    if not export_dir and not address and "://" not in config.storage_path:  # a local run exports by default
        export_dir = os.path.join(config.storage_path, config.name, "export")
    return address, None if a.no_export else export_dir, config


def main(argv=None) -> RunSummary:
    address, export_dir, config = parse_args(argv)
    quiet_ray_train()
    if address:
        ray.init(address=address)
    else:
        start_local_ray(num_cpus=max(os.cpu_count() or 1, config.max_workers + 1))
    summary = run_with_summary(config, export_dir)
    print(f"\n{summary}")
    return summary


if __name__ == "__main__":
    main()
