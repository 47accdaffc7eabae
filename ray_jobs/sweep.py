"""A Ray Tune sweep over learning rate x ZeRO stage; each trial is a multi-worker causal-LM fine-tune.

    python ray_jobs/sweep.py                                       # local, 2 CPU workers per trial
    RAY_ADDRESS=auto python ray_jobs/sweep.py --use-gpu --num-workers 4 --max-concurrent 2 \
        --storage-path /mnt/shared/sweeps

Prints every trial's final loss and the best trial. For a search over any TrainingArguments fields
with your own training function, see ``examples/ray_sweep.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import ray  # noqa: E402
from ray import tune  # noqa: E402
from ray.train import RunConfig  # noqa: E402
from ray.tune.integration.ray_train import TuneReportCallback  # noqa: E402

from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, build_trainer  # noqa: E402

# A trial's function only drives its TorchTrainer, so it runs on the head and takes no CPU, as the
# main job's driver does. On a worker node it would keep that node from ever scaling down: Ray Train
# 2.60 creates a detached AutoscalingCoordinator actor on the node of the first trainer's controller
# (the trial's node), and a node that hosts an actor is never idle.
TRIAL_RESOURCES = {"CPU": 0, "node:__internal_head__": 0.001}


def trial(params: dict) -> None:
    """One Tune trial: a TorchTrainer fine-tune whose reports flow back to Tune."""
    overrides = {
        "learning_rate": params["learning_rate"],
        "zero_stage": params["zero_stage"],
        "name": f"{params['base']['name']}_{tune.get_context().get_trial_id()}",
    }
    config = RayFinetuneConfig(**(params["base"] | overrides))
    # Merged with the job's RunConfig: the trial adds Tune's callback and keeps the job's name,
    # storage, retry and checkpoint policy.
    build_trainer(config, run_config=RunConfig(callbacks=[TuneReportCallback()])).fit()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None)
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3])
    p.add_argument("--zero-stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--max-concurrent", type=int, default=1, help="trials at once (each takes num-workers slots)")
    p.add_argument("--storage-path", default=str(Path.home() / "ray_results"))
    a = p.parse_args(argv)
    for name in ("num_workers", "max_steps", "max_concurrent"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} is invalid; expected a number >= 1")
    try:  # every trial's configuration, checked before anything starts
        for lr in a.learning_rates:
            for stage in a.zero_stages:
                RayFinetuneConfig(learning_rate=lr, zero_stage=stage, num_workers=a.num_workers, max_steps=a.max_steps)
    except ValueError as e:
        p.error(str(e))
    address = a.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Logical CPUs for each running trial's workers and for one finished trial whose placement
        # group Ray may still be releasing; otherwise the next trial can wait forever.
        slots = a.num_workers * (a.max_concurrent + 1)
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False)
    storage = os.path.abspath(a.storage_path) if "://" not in a.storage_path else a.storage_path
    base = RayFinetuneConfig(
        num_workers=a.num_workers,
        use_gpu=a.use_gpu,
        max_steps=a.max_steps,
        save_steps=a.max_steps,
        storage_path=storage,
        name="sweep",
        max_failures=1,
    )
    tuner = tune.Tuner(
        tune.with_resources(trial, TRIAL_RESOURCES),
        param_space={
            "base": dataclasses.asdict(base),
            "learning_rate": tune.grid_search(a.learning_rates),
            "zero_stage": tune.grid_search(a.zero_stages),
        },
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=a.max_concurrent),
        run_config=tune.RunConfig(name="hf_lowzero_sweep", storage_path=storage),
    )
    results = tuner.fit()
    for r in results:
        print(
            f"lr={r.config['learning_rate']:<8g} zero_stage={r.config['zero_stage']}  "
            f"final loss={r.metrics.get('loss', float('nan')):.4f}  error={r.error is not None}"
        )
    best = results.get_best_result()
    print(
        f"best trial: lr={best.config['learning_rate']} zero_stage={best.config['zero_stage']} "
        f"loss={best.metrics['loss']:.4f}"
    )


if __name__ == "__main__":
    main()
