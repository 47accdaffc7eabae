"""Ray Train, through the main job as a person runs it and through the library.

The main job (``python ray_jobs/finetune.py``, memory snapshots off: ``test_recovery.py`` has
them) with a worker killed while its checkpoint upload is in flight: its console has one progress
line per logging step of each attempt, from the first rank only, none of Ray's known noise, and a
summary that counts the restart and names a ``from_pretrained`` directory holding the final
checkpoint's consolidated weights. Ray registered only complete checkpoints (never the killed
round's, partial or not), the restart resumed the last complete one, and the run ends exactly like
an uninterrupted one. Every shard reaches the reported
checkpoint, each file uploaded by one rank; a rerun with fewer workers resumes the same checkpoint,
resharded. ``Trainer.hyperparameter_search(backend="ray")`` builds a ZeRO optimizer per trial.

Your own training function (``examples/ray_classifier.py``: ``prepare_trainer`` and
``resume_checkpoint`` around a BERT classifier) on a ``TorchTrainer``, a worker killed once, with
storage Ray must download from: it ends with the parameters of the same training without Ray. A
caller's ``RunConfig`` reaches the recipe's ``TorchTrainer``: a Tune trial whose worker is killed is
retried under the trial's ``failure_config``."""

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow.fs
import pytest
import torch

ray = pytest.importorskip("ray")

from examples.ray_classifier import classifier_trainer, tiny_bert, train_func, training_arguments  # noqa: E402
from hf_lowzero import LowZeroTrainer, consolidate_checkpoint  # noqa: E402
from hf_lowzero.ray import InjectWorkerFailure  # noqa: E402
from hf_lowzero.ray.faults import FAILURE_MARKER  # noqa: E402
from hf_lowzero.ray.reporting import stage_owned_files  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, RunSummary, build_trainer, run_finetune  # noqa: E402
from hf_lowzero.recipes.clm_ray.attempts import count_attempts  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402
from tests.hf_models import TokenDataset, tiny_gpt2  # noqa: E402
from tests.ray_checkpoints import missing_files, step_of  # noqa: E402
from tests.ray_env import as_a_user_runs  # noqa: E402
from tests.ray_reference import losses_without_ray  # noqa: E402
from tests.trainer_runs import make_args  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray_cluster]  # long Ray runs: the second tier (tests/tiers.py)

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE = 12, 4
KILL_AT = 2 * SAVE  # a checkpoint step: rank 1 dies right after its report, its upload in flight
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WORKER_LINE = re.compile(r"^\(RayTrainWorker pid=(\d+)(?:, ip=[^)]*)?\) (.*)$")
ATTEMPT_LINE = re.compile(r"^\[hf_lowzero\] attempt (\d+): (?:resuming at step (\d+)/\d+|.*)")
STEP_LINE = re.compile(
    r"^step +(\d+)/(\d+) \[[#.]{20}\] +\d+% \| loss (\d+\.\d{4}) \| lr \S+ \| grad_norm \S+ \| world 2$"
)
UNPREDICTED_STEP_TIME = r"measured median ([0-9.]+) (ms|s) over (\d+) steps; no plan predicted it .*\(last attempt\)"
KNOWN_NOISE = (
    "Failed to query Ray Train Controller",  # PlacementGroupCleaner without a state API
    "Found multiple active Ray instances",  # ... guessing which cluster to ask
    "PreemptionWatcher",  # core_worker.cc warning about its constructor arguments
    "Reporting training result",  # Ray Train, every report from every rank
    "Checkpoint successfully created",
    "Writing model shards",  # transformers' tqdm on every save
    "loss_type=None",  # GPT2LMHeadModel's loss warning
    "mtime may not be reliable",
    "{'loss':",  # the Trainer's PrinterCallback
)


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory):
    """One run of the main job whose last rank is killed at step KILL_AT: (console lines, summary,
    storage). Runs before this module starts its own Ray instance (it starts one of its own)."""
    storage = tmp_path_factory.mktemp("runs")
    env = as_a_user_runs({k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"})
    cmd = [sys.executable, str(ROOT / "ray_jobs/finetune.py"), "--max-steps", str(STEPS), "--save-steps", str(SAVE),
           "--inject-failure-at-step", str(KILL_AT), "--storage-path", str(storage), "--name", "killed",
           "--snapshot-every", "off"]  # fmt: skip
    run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
    console = ANSI.sub("", run.stdout)
    assert run.returncode == 0, console[-5000:]
    summary = dict(re.findall(r"^(final loss|step time|restarts survived|checkpoint|model) +(.*)$", console, re.M))
    return console.splitlines(), summary, storage


@pytest.fixture(scope="module")
def local_ray(killed_job):
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    root = str(Path(__file__).resolve().parents[1])  # workers import tests.* (model_init below)
    runtime_env = {"env_vars": {"PYTHONPATH": root}}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    yield
    ray.shutdown()


def final_state(result) -> tuple[Path, dict[str, torch.Tensor]]:
    trainer_ckpt = next(Path(result.checkpoint.path).glob("checkpoint-*"))
    return trainer_ckpt, consolidate_checkpoint(trainer_ckpt / "zero_optimizer")


def trainer_losses(trainer_checkpoint: Path) -> dict[int, float]:
    """The loss the Trainer logged at each step, from the final checkpoint's trainer_state.json."""
    history = json.loads((trainer_checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def test_console_has_one_line_per_logging_step_of_each_attempt_from_the_first_rank(killed_job):
    lines, summary, _ = killed_job
    attempts: list[dict] = []  # per attempt: the first rank's pid, where it resumed, its step lines
    for line in lines:
        worker = WORKER_LINE.match(line)
        if worker is None:
            continue
        pid, text = worker.groups()
        if started := ATTEMPT_LINE.match(text):
            assert int(started.group(1)) == len(attempts) + 1, line
            attempts.append({"pid": pid, "resumed": int(started.group(2) or 0), "steps": []})
        elif step := STEP_LINE.match(text):
            assert attempts and pid == attempts[-1]["pid"], f"a line not from the first rank: {line!r}"
            assert int(step.group(2)) == STEPS
            attempts[-1]["steps"].append((int(step.group(1)), step.group(3)))

    assert len(attempts) == 2, "expected the first attempt and one restart"
    assert attempts[0]["resumed"] == 0
    # Rank 1 dies after step KILL_AT was logged, while its checkpoint uploads: the restart resumes the
    # step-SAVE checkpoint, the last one every rank's upload completed.
    assert [s for s, _ in attempts[0]["steps"]] == list(range(1, KILL_AT + 1))
    assert attempts[1]["resumed"] == SAVE
    assert [s for s, _ in attempts[1]["steps"]] == list(range(attempts[1]["resumed"] + 1, STEPS + 1))
    logged = trainer_losses(Path(summary["checkpoint"]))
    for attempt in attempts:
        for step, loss in attempt["steps"]:
            assert loss == f"{logged[step]:.4f}", f"step {step}"


def test_console_carries_the_failure_in_one_line_and_none_of_the_known_noise(killed_job):
    lines, _, _ = killed_job
    assert [line for line in lines if any(noise in line for noise in KNOWN_NOISE)] == []
    assert any(f"[hf_lowzero] injecting a failure: killing rank 1 at step {KILL_AT};" in line for line in lines)
    assert not any("Error in training function" in line or "Traceback" in line for line in lines)  # designed


def test_summary_counts_the_restart_and_names_the_final_checkpoint(killed_job):
    _, summary, storage = killed_job
    assert summary["restarts survived"] == f"1 (resumed from storage, step {SAVE})"  # snapshots off here
    final = Path(summary["checkpoint"])
    assert final.name == f"checkpoint-{STEPS}" and final.parent.parent == storage / "killed"
    assert summary["final loss"] == f"{trainer_losses(final)[STEPS]:.4f} at step {STEPS}/{STEPS}"
    assert summary["model"].split()[0] == str(storage / "killed" / "export")


def test_each_attempt_starts_with_how_to_plan_and_the_summary_has_its_last_steps_time(killed_job):
    """No plan runs at a given stage: each attempt's first lines say how to get one (issue 56), and the
    summary's step time is the median of the last attempt's steps, from step SAVE + 1 to the end."""
    lines, summary, _ = killed_job
    hints = [line for line in lines if "[hf_lowzero] plan: no step time predicted for stage 2 (no plan ran)" in line]
    assert len(hints) == 2 and all(
        line.endswith("--zero-stage auto plans the job as it starts and predicts its step time here") for line in hints
    )
    measured = re.fullmatch(UNPREDICTED_STEP_TIME, summary["step time"])
    assert measured is not None, summary["step time"]
    assert int(measured.group(3)) == STEPS - SAVE and float(measured.group(1)) > 0


def test_exported_model_loads_with_from_pretrained_and_holds_the_consolidated_weights(killed_job):
    from transformers import AutoModelForCausalLM

    _, summary, _ = killed_job
    model = AutoModelForCausalLM.from_pretrained(summary["model"].split()[0])
    reference = consolidate_checkpoint(Path(summary["checkpoint"]) / "zero_optimizer")
    params = dict(model.named_parameters())
    assert set(params) == set(reference)
    for name, value in reference.items():
        assert params[name].dtype == torch.float32
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as trained
    logits = model(torch.tensor([list(b"ZeRO ")])).logits
    assert logits.shape == (1, 5, model.config.vocab_size) and torch.isfinite(logits).all()


def test_worker_failure_resumes_to_the_same_result(killed_job, local_ray, tmp_path):
    _, summary, storage = killed_job
    clean = run_finetune(
        RayFinetuneConfig(num_workers=2, max_steps=STEPS, save_steps=SAVE, storage_path=str(tmp_path), name="clean")
    )
    faulty = ray.train.Result.from_path(str(storage / "killed"))  # what Ray registered for the killed run
    assert clean.error is None
    # A stage given by hand: no plan ran, so no prediction; the step times of its every step.
    assert clean.return_value["predicted_step_s"] is None and len(clean.return_value["step_times_s"]) == STEPS
    assert (storage / "killed" / FAILURE_MARKER).exists(), "the failure was not injected"

    # Ray registered only complete checkpoints. The killed round's folder stays unregistered, and the
    # restart resumed the last registered checkpoint (step SAVE), not that newer folder. Rank 1 died
    # with its upload in flight: usually its files never all arrive, but the upload may win the race
    # with os._exit (CI saw it once). Either way its report died with it, and rank 0's files are all there.
    registered = {Path(c.path) for c, _ in faulty.best_checkpoints}
    assert all(missing_files(c) == [] for c in registered)
    unregistered = [d for d in (storage / "killed").glob("checkpoint_*") if d.is_dir() and d not in registered]
    assert [step_of(d) for d in unregistered] == [KILL_AT], "the killed round is not the one unregistered folder"
    rank1_files = {"zero_optimizer/zero_shard_rank00001_of_00002.safetensors", "rng_state_1.pth"}
    assert set(missing_files(unregistered[0])) <= rank1_files
    assert faulty.metrics["resumed_from_step"] == SAVE
    assert Path(summary["checkpoint"]).parent == Path(faulty.checkpoint.path)

    clean_dir, clean_weights = final_state(clean)
    faulty_dir, faulty_weights = final_state(faulty)
    assert clean_dir.name == faulty_dir.name == f"checkpoint-{STEPS}"
    # Each file of the final checkpoint is reported (uploaded) by exactly one rank.
    staged = [set(stage_owned_files(clean_dir, tmp_path / f"staged{r}", r)) for r in range(2)]
    assert not staged[0] & staged[1]
    assert staged[0] | staged[1] == {p.relative_to(clean_dir) for p in clean_dir.rglob("*") if p.is_file()}
    assert {str(p) for p in staged[1]} == rank1_files
    for ckpt in (clean_dir, faulty_dir):  # every rank's files reached the reported checkpoint
        names = set(os.listdir(ckpt)) | set(os.listdir(ckpt / "zero_optimizer"))
        assert {
            "rng_state_0.pth",
            "rng_state_1.pth",
            "model.safetensors",
            "trainer_state.json",
            "zero_meta.json",
            "zero_shard_rank00000_of_00002.safetensors",
            "zero_shard_rank00001_of_00002.safetensors",
        } <= names
    assert faulty.metrics["loss"] == pytest.approx(clean.metrics["loss"], rel=1e-6)
    for name, value in clean_weights.items():
        torch.testing.assert_close(faulty_weights[name], value, rtol=1e-6, atol=1e-7, msg=name)

    # A rerun of "clean" with one worker resumes its step-12 checkpoint, resharded 2 -> 1.
    resumed = run_finetune(
        RayFinetuneConfig(
            num_workers=1, max_steps=STEPS + SAVE, save_steps=SAVE, storage_path=str(tmp_path), name="clean"
        )
    )
    resumed_dir, _ = final_state(resumed)
    assert resumed_dir.name == f"checkpoint-{STEPS + SAVE}"
    assert sorted(os.listdir(resumed_dir / "zero_optimizer"))[-1] == "zero_shard_rank00000_of_00001.safetensors"
    history = json.loads((resumed_dir / "trainer_state.json").read_text())["log_history"]
    before = json.loads((clean_dir / "trainer_state.json").read_text())["log_history"]
    assert [h.get("loss") for h in history[:STEPS]] == [h.get("loss") for h in before[:STEPS]], "did not resume"


def test_auto_stage_on_ray_workers_is_one_choice_for_all_ranks(local_ray, tmp_path):
    """--zero-stage auto plans on rank 0 of the workers (a fresh process: the group exists) and sends
    the choice to every rank: the fastest setup that fits (issue 56's time columns). For the job's tiny
    fp32 GPT-2 with room to spare that is stage 0 (DDP) today; whichever it takes, the run equals the
    same training given that stage by hand, and each rank's files are that stage's."""
    common = dict(num_workers=2, max_steps=SAVE, save_steps=SAVE, storage_path=str(tmp_path))
    auto = run_finetune(RayFinetuneConfig(**common, zero_stage="auto", zero_device_memory="8GiB", name="auto"))
    assert auto.error is None
    auto_dir = next(Path(auto.checkpoint.path).glob("checkpoint-*"))
    if (auto_dir / "zero_optimizer").exists():
        stage = json.loads((auto_dir / "zero_optimizer" / "zero_meta.json").read_text())["stage"]
        assert sorted(p.name for p in (auto_dir / "zero_optimizer").glob("zero_shard_*")) == [
            "zero_shard_rank00000_of_00002.safetensors",
            "zero_shard_rank00001_of_00002.safetensors",
        ]  # every rank took the ZeRO optimizer
    else:
        stage = 0
        assert (auto_dir / "optimizer.pt").exists()  # DDP's files
    # the job's step-time lines (issue 56): the plan's prediction for the stage it took, against its own steps
    times, predicted = auto.return_value["step_times_s"], auto.return_value["predicted_step_s"]
    assert len(times) == SAVE and min(times) > 0 and predicted > 0
    median = statistics.median(times)
    summary = str(RunSummary(auto, SAVE, 0.0, restarts=0, trainer_checkpoint=None, export_dir=None))
    assert f"measured/predicted {median / predicted:.2f}" in summary and f"over {SAVE} steps" in summary
    # By hand: that stage in two plain gloo ranks, without Ray (a Ray worker trains bit for bit like one).
    by_hand = RayFinetuneConfig(**common, zero_stage=stage, name=f"stage{stage}")
    expected = {h["step"]: h["loss"] for h in losses_without_ray(by_hand, tmp_path / "by_hand", world_size=2)}
    assert trainer_losses(auto_dir) == expected


def model_init(trial=None):
    return tiny_gpt2(seed=3)


def test_ray_tune_hyperparameter_search_builds_a_zero_optimizer_per_trial(local_ray, tmp_path):
    """Trainer.hyperparameter_search(backend="ray"): each trial (a Ray actor, world size 1) builds
    its model with model_init and a ZeRO optimizer for it; every trial's objective equals the plain
    Trainer's for the same learning rate."""
    from ray import tune

    data = {"train_dataset": TokenDataset(), "eval_dataset": TokenDataset(n=8, seed=9)}
    rates = [1e-3, 3e-3]
    trainer = LowZeroTrainer(model_init=model_init, args=make_args(tmp_path / "search", 2), **data)
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.grid_search(rates)},
        backend="ray",
        n_trials=1,
        direction="minimize",
        resources_per_trial={"cpu": 1},
        storage_path=str(tmp_path / "tune"),
    )
    objectives = {t.config["learning_rate"]: t.last_result["objective"] for t in best.run_summary.trials}
    for lr in rates:
        args = make_args(tmp_path / f"plain-{lr}", 0, learning_rate=lr)
        plain = LowZeroTrainer(model_init=model_init, args=args, **data)
        plain.train()
        assert objectives[lr] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5), lr
    assert best.hyperparameters["learning_rate"] == min(objectives, key=objectives.get)


def _classifier_without_ray(rank: int, world_size: int, out: str, overrides: dict) -> None:
    trainer = classifier_trainer(training_arguments(out, **overrides))
    trainer.train()
    if rank == 0:
        torch.save({n: p.detach() for n, p in trainer.model.named_parameters()}, Path(out) / "params.pt")
        Path(out, "losses.json").write_text(json.dumps(trainer_losses_of(trainer.state.log_history)))


def trainer_losses_of(log_history: list[dict]) -> dict[str, float]:
    return {str(entry["step"]): entry["loss"] for entry in log_history if "loss" in entry}


def test_your_own_train_func_survives_a_killed_worker_and_ends_like_training_without_ray(local_ray, tmp_path):
    steps, save, kill_at = 12, 4, 6  # killed after step 6: the restart resumes step 4's checkpoint
    overrides = {"max_steps": steps, "save_steps": save, "per_device_train_batch_size": 4}
    run_distributed(_classifier_without_ray, 2, out=str(tmp_path / "plain"), overrides=overrides)
    reference = torch.load(tmp_path / "plain" / "params.pt")

    # A filesystem that is not pyarrow's LocalFileSystem: resume_checkpoint() downloads, as from S3.
    remote = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "remote"), pyarrow.fs.LocalFileSystem())
    (tmp_path / "remote").mkdir()
    config = {"training_args": overrides, "callbacks": [InjectWorkerFailure(kill_at, tmp_path / "marker")]}
    result = ray.train.torch.TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name="classifier",
            storage_path="runs",
            storage_filesystem=remote,
            failure_config=ray.train.FailureConfig(max_failures=1),
        ),
    ).fit()

    assert result.error is None
    assert (tmp_path / "marker" / FAILURE_MARKER).exists(), "the failure was not injected"
    assert (result.metrics["step"], result.metrics["resumed_from_step"]) == (steps, save)
    with result.checkpoint.as_directory() as folder:
        trainer_ckpt = next(Path(folder).glob("checkpoint-*"))
        assert trainer_ckpt.name == f"checkpoint-{steps}"
        params = consolidate_checkpoint(trainer_ckpt / "zero_optimizer")
        history = json.loads((trainer_ckpt / "trainer_state.json").read_text())["log_history"]
    assert [h["world_size"] for h in history if "loss" in h] == [2] * steps
    expected_losses = json.loads((tmp_path / "plain" / "losses.json").read_text())
    assert trainer_losses_of(history) == pytest.approx(expected_losses, rel=1e-6)
    assert set(params) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(reference["classifier.weight"], tiny_bert(seed=0).classifier.weight), "did not train"


def _recipe_trial(params: dict) -> None:
    """A Tune trial that fits the recipe with the trial's own RunConfig: its retry policy and callback."""
    from ray.tune.integration.ray_train import TuneReportCallback

    run_config = ray.train.RunConfig(
        failure_config=ray.train.FailureConfig(max_failures=1), callbacks=[TuneReportCallback()]
    )
    build_trainer(RayFinetuneConfig(**params), run_config).fit()


def test_a_tune_trial_whose_worker_is_killed_is_retried_under_the_trials_run_config(local_ray, tmp_path):
    from ray import tune

    # The job's own policy allows no restart: only the trial's failure_config can retry it.
    job = RayFinetuneConfig(num_workers=1, max_steps=4, save_steps=2, inject_failure_at_step=3, max_failures=0,
                            storage_path=str(tmp_path / "runs"), name="trial_job")  # fmt: skip
    tuner = tune.Tuner(
        tune.with_resources(_recipe_trial, {"CPU": 0, "node:__internal_head__": 0.001}),
        param_space=dataclasses.asdict(job),
        run_config=tune.RunConfig(name="retry", storage_path=str(tmp_path / "tune")),
    )
    (trial,) = tuner.fit()
    assert trial.error is None
    assert (tmp_path / "runs" / "trial_job" / FAILURE_MARKER).exists(), "the failure was not injected"
    assert count_attempts(job.storage_path, job.name) == 2
    # Ray kept the checkpoints under the job's name and storage: the trial's RunConfig named neither.
    assert step_of(ray.train.Result.from_path(str(tmp_path / "runs" / "trial_job")).checkpoint.path) == 4
    # Tune got the recipe's reports through the trial's callback: the retry resumed step 2's checkpoint.
    assert (trial.metrics["step"], trial.metrics["resumed_from_step"], trial.metrics["train_end"]) == (4, 2, True)


def _prepare_checks(config: dict) -> dict:
    """Inside a Ray Train worker: prepare_trainer once and twice, and the settings it refuses."""
    from transformers import Trainer, TrainingArguments

    from hf_lowzero.ray import local_output_dir, prepare_trainer
    from hf_lowzero.ray.reporting import ReportShardedCheckpoints

    out = local_output_dir()
    data = TokenDataset()
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=make_args(out, 2, save_strategy="steps"), train_dataset=data)
    assert prepare_trainer(prepare_trainer(trainer)) is trainer
    errors = {"reporters": sum(isinstance(cb, ReportShardedCheckpoints) for cb in trainer.callback_handler.callbacks)}
    refused = {
        "other upload mode": lambda: prepare_trainer(trainer, upload="sync"),
        "no checkpoints": lambda: prepare_trainer(LowZeroTrainer(model=tiny_gpt2(), args=make_args(out, 2))),
        "one-process world": lambda: prepare_trainer(Trainer(model=tiny_gpt2(), args=TrainingArguments(out))),
    }
    for what, call in refused.items():
        try:
            call()
            errors[what] = "accepted"
        except (RuntimeError, ValueError) as e:
            errors[what] = str(e)
    return errors


def test_prepare_trainer_in_a_worker_is_idempotent_and_refuses_what_cannot_be_resumed(local_ray, tmp_path):
    result = ray.train.torch.TorchTrainer(
        _prepare_checks,
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="prepare", storage_path=str(tmp_path)),
    ).fit()
    errors = result.return_value
    assert errors["reporters"] == 1, "a second prepare_trainer added a second reporter"
    assert "already prepared with upload='async'" in errors["other upload mode"]
    assert "save_strategy='no'" in errors["no checkpoints"]
    assert "args.world_size is 1 but the Ray Train worker group has 2 workers" in errors["one-process world"]
