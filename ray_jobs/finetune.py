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
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import ray  # noqa: E402

from hf_lowzero.ray import RayFinetuneConfig, run_finetune  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    d = RayFinetuneConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    p.add_argument("--num-workers", type=int, default=d.num_workers)
    p.add_argument("--use-gpu", action="store_true", help="one worker per GPU, NCCL")
    p.add_argument("--zero-stage", type=int, default=d.zero_stage, choices=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=d.max_steps)
    p.add_argument("--save-steps", type=int, default=d.save_steps)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--per-device-batch-size", type=int, default=d.per_device_train_batch_size)
    p.add_argument("--gradient-accumulation-steps", type=int, default=d.gradient_accumulation_steps)
    p.add_argument("--bf16", action="store_true", help="bf16 params with fp32 master rows")
    p.add_argument("--zero-config", default=None, help="other ZeroConfig fields as JSON")
    p.add_argument("--model-name-or-path", default=None, help="local save_pretrained directory (default: tiny GPT-2)")
    p.add_argument("--train-file", default=None, help="plain-text corpus (default: the one shipped)")
    p.add_argument("--storage-path", default=d.storage_path, help="where Ray keeps checkpoints (shared or cloud)")
    p.add_argument(
        "--name", default=None, help="run name; a rerun with the same name resumes it (default: a new timestamped run)"
    )
    p.add_argument("--max-failures", type=int, default=d.max_failures)
    p.add_argument("--inject-failure-at-step", type=int, default=None, help="kill one worker once at this step")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    config = RayFinetuneConfig(
        num_workers=a.num_workers,
        use_gpu=a.use_gpu,
        zero_stage=a.zero_stage,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        learning_rate=a.learning_rate,
        per_device_train_batch_size=a.per_device_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps,
        bf16=a.bf16,
        zero_config=a.zero_config,
        model_name_or_path=a.model_name_or_path,
        train_file=a.train_file,
        storage_path=os.path.abspath(a.storage_path) if "://" not in a.storage_path else a.storage_path,
        name=a.name or f"{RayFinetuneConfig().name}_{time.strftime('%Y%m%d-%H%M%S')}",
        max_failures=a.max_failures,
        inject_failure_at_step=a.inject_failure_at_step,
    )
    address = a.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # "local": never attach to a stale /tmp/ray/ray_current_cluster by accident.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, a.num_workers + 1), include_dashboard=False)
    result = run_finetune(config)
    print("\n=== hf_lowzero fine-tune finished ===")
    print("final metrics:", {k: v for k, v in result.metrics.items() if not isinstance(v, dict)})
    print("checkpoint:", result.checkpoint.path if result.checkpoint else None)
    if result.error:
        raise SystemExit(f"training failed: {result.error}")


if __name__ == "__main__":
    main()
