"""A Ray Tune search over TrainingArguments and ZeRO fields, each trial your own training function
(``examples/ray_classifier.py``'s ``train_func``) on a multi-worker ``TorchTrainer`` of its own.

    python examples/ray_sweep.py                                   # embedded local Ray, 2 CPU workers per trial
    python examples/ray_sweep.py --zero-stages 2 --max-steps 4     # 2 trials (the learning rates), a few steps
    python ray_jobs/local_cluster.py -- python examples/ray_sweep.py --max-concurrent 2   # fake autoscaling cluster
    RAY_ADDRESS=auto python examples/ray_sweep.py --num-workers 4 --max-concurrent 2 --storage-path s3://bucket/sweeps

``search_space`` holds any ``LowZeroTrainingArguments`` fields (``learning_rate``, ``zero_stage``,
``weight_decay``, ``lr_scheduler_type``, ``zero_reduce_bucket_mb``, ...): a grid over the learning
rates and ZeRO stages given (``--learning-rates``, ``--zero-stages``), one trial per pair. Every trial
passes its values to ``train_func`` as ``config["training_args"]``. Each trial's ``RunConfig`` carries Tune's report
callback and its own retry policy: a trial whose worker dies resumes its last checkpoint. Prints
every trial's final loss and the best trial.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import ray
from ray import tune
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback
from ray_classifier import train_func  # examples/, shipped to the workers as the job's working_dir

EXAMPLES = Path(__file__).resolve().parent


def search_space(learning_rates: list[float], zero_stages: list[int]) -> dict:
    """The searched ``LowZeroTrainingArguments`` fields: a grid over the learning rates and stages."""
    return {
        "learning_rate": tune.grid_search(learning_rates),
        "zero_stage": tune.grid_search(zero_stages),
        "weight_decay": tune.choice([0.0, 0.01]),
    }


# A trial's function only drives its TorchTrainer: it runs on the head and takes no CPU (on a worker
# node, the detached actor Ray Train creates beside the first trial's controller would keep that
# node from ever scaling down; see ray_jobs/sweep.py).
TRIAL_RESOURCES = {"CPU": 0, "node:__internal_head__": 0.001}


def trial(config: dict) -> None:
    """One Tune trial: ``train_func`` on its own TorchTrainer; its reports flow back to Tune."""
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"training_args": config["training_args"]},
        scaling_config=ScalingConfig(num_workers=config["num_workers"], use_gpu=config["use_gpu"]),
        run_config=RunConfig(
            name=f"trial_{tune.get_context().get_trial_id()}",
            storage_path=config["storage_path"],
            failure_config=FailureConfig(max_failures=config["max_failures"]),
            callbacks=[TuneReportCallback()],
        ),
    )
    trainer.fit()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2, help="workers of each trial's TorchTrainer")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3], help="searched (a grid)")
    p.add_argument("--zero-stages", type=int, nargs="+", default=[1, 2], choices=[0, 1, 2], help="searched (a grid)")
    p.add_argument("--max-concurrent", type=int, default=1, help="trials at once (each takes num-workers slots)")
    p.add_argument("--max-failures", type=int, default=1, help="worker-group restarts per trial")
    p.add_argument("--storage-path", default=str(Path.home() / "ray_results"))
    a = p.parse_args(argv)
    space = search_space(a.learning_rates, a.zero_stages)
    runtime_env = {"working_dir": str(EXAMPLES)}  # the workers import ray_classifier from it
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env=runtime_env)
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # Logical CPUs for each running trial's workers and for one finished trial whose placement
        # group Ray may still be releasing; otherwise the next trial can wait forever.
        slots = a.num_workers * (a.max_concurrent + 1)
        ray.init(address="local", num_cpus=slots, include_dashboard=False, runtime_env=runtime_env)
    storage = a.storage_path if "://" in a.storage_path else os.path.abspath(a.storage_path)
    fixed = {"max_steps": a.max_steps, "save_steps": a.max_steps // 2 or 1, "use_cpu": not a.use_gpu}
    tuner = tune.Tuner(
        tune.with_resources(trial, TRIAL_RESOURCES),
        param_space={
            "training_args": space | fixed,
            "num_workers": a.num_workers,
            "use_gpu": a.use_gpu,
            "max_failures": a.max_failures,
            "storage_path": storage,
        },
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=a.max_concurrent),
        run_config=tune.RunConfig(name="hf_lowzero_classifier_sweep", storage_path=storage),
    )
    results = tuner.fit()
    for r in results:
        searched = {k: r.config["training_args"][k] for k in space}
        print(f"{searched}  final loss={r.metrics.get('loss', float('nan')):.4f}  error={r.error is not None}")
    failed = [r for r in results if r.error is not None]
    if failed:  # a sweep with a failed trial is not a result: say so in the exit status
        raise SystemExit(f"{len(failed)} of {len(results)} trials failed; the first: {failed[0].error!r}")
    best = results.get_best_result()
    print(f"best trial: { {k: best.config['training_args'][k] for k in space} } loss={best.metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
