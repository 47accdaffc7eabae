"""The main job's command line (``ray_jobs/finetune.py``) maps onto ``RayFinetuneConfig``.

Submitting it as a Ray job is tested against a running cluster in ``tests/test_autoscaling.py``
(``ray_jobs/submit.py`` follows the job to SUCCEEDED and prints its summary).
"""

import os
import sys
from pathlib import Path

import pytest

from tests.tiers import slow

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def refused(parse, argv: list[str], capsys) -> str:
    """A bad flag value gets argparse's treatment: exit status 2 and one ``error:`` line, no traceback."""
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_finetune_flags_map_onto_the_config(monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local run: it exports by default
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    address, export_dir, config = parse_args(["--offload-optimizer", "--zero-stage", "1", "--num-workers", "3"])
    assert address is None and export_dir == os.path.join(config.storage_path, config.name, "export")
    assert (config.offload_optimizer, config.zero_stage, config.num_workers) == (True, 1, 3)
    assert "error: zero_stage=3 is invalid" in refused(parse_args, ["--zero-stage", "3"], capsys)
    config = parse_args(["--zero-stage", "auto", "--zero-device-memory", "40GiB"])[2]
    args = config.training_arguments("out", world_size=2)
    assert (config.zero_stage, config.snapshots, args.zero_stage, args.zero_device_memory) == (
        "auto", "auto", "auto", "40GiB"
    )  # fmt: skip
    line = refused(parse_args, ["--zero-stage", "auto", "--zero-device-memory", "lots"], capsys)
    assert "error: zero_device_memory='lots' is invalid" in line
    config = parse_args(["--optim", "adafactor", "--zero-partition", "params"])[2]
    args = config.training_arguments("out", world_size=2)
    assert (args.optim, args.to_zero_config().partition) == ("adafactor", "params")
    assert "partition='whole' is invalid" in refused(parse_args, ["--zero-partition", "whole"], capsys)
    assert parse_args(["--no-export"])[1] is None
    assert parse_args(["--address", "auto"])[1] is None  # a cluster run exports only when asked
    assert parse_args(["--address", "auto", "--export-dir", "out/final"])[1] == os.path.abspath("out/final")
    with pytest.raises(SystemExit):  # argparse: not allowed with --export-dir
        parse_args(["--no-export", "--export-dir", "out/final"])


def test_workers_get_cpus_for_the_host_step_and_a_collective_timeout(monkeypatch, capsys):
    """With --use-gpu each worker gets the GPU nodes' CPUs per GPU (Ray's default of 1 would run an
    offloaded AdamW step on one thread); the local CPU demo keeps Ray's default of one CPU."""
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    from hf_lowzero.recipes.clm_ray import build_trainer

    gpu_nodes = [{"CPU": 48.0, "GPU": 4.0}, {"CPU": 4.0}, {"CPU": 20.0, "GPU": 2.0}]
    config = parse_args(["--use-gpu"])[2]
    assert config.worker_resources(gpu_nodes) == {"CPU": 10, "GPU": 1}  # the tightest GPU node decides
    assert config.worker_resources([{"CPU": 8.0}]) == {"CPU": 1, "GPU": 1}  # no GPU node up yet
    assert parse_args([])[2].worker_resources(gpu_nodes) == {"CPU": 1}
    assert parse_args(["--use-gpu", "--cpus-per-worker", "6"])[2].worker_resources(gpu_nodes) == {"CPU": 6, "GPU": 1}
    given = parse_args(["--resources-per-worker", '{"CPU": 3, "GPU": 1}'])[2]
    assert given.worker_resources(gpu_nodes) == {"CPU": 3, "GPU": 1}
    assert "cpus_per_worker='many' is invalid" in refused(parse_args, ["--cpus-per-worker", "many"], capsys)
    assert "both set" in refused(parse_args, ["--cpus-per-worker", "2", "--resources-per-worker", '{"CPU": 2}'], capsys)
    assert "collective_timeout_s=0 is invalid" in refused(parse_args, ["--collective-timeout-s", "0"], capsys)
    trainer = build_trainer(parse_args(["--collective-timeout-s", "90"])[2])
    assert trainer.backend_config.timeout_s == 90 and trainer.scaling_config.resources_per_worker == {"CPU": 1}


def test_an_offloaded_run_says_how_many_threads_its_host_step_gets(tmp_path, caplog):
    from transformers import TrainerState

    from hf_lowzero import LowZeroTrainingArguments
    from hf_lowzero.ray.console import ConsoleProgress

    args = LowZeroTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], zero_stage=2, zero_offload_optimizer=True
    )
    state = TrainerState(max_steps=10, is_world_process_zero=True)
    with caplog.at_level("INFO", logger="hf_lowzero"):
        ConsoleProgress(attempt=1).on_train_begin(args, state, None)
    import torch

    assert f"offloaded optimizer steps run on the host with {torch.get_num_threads()} threads" in caplog.text


def test_bad_values_of_every_ray_job_get_argparse_errors(capsys):
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    import autoscale_demo
    import finetune
    import submit
    import sweep

    assert "max_steps and save_steps must be >= 1" in refused(finetune.parse_args, ["--max-steps", "0"], capsys)
    assert "zero_stage=3 is invalid" in refused(sweep.main, ["--zero-stages", "1", "3"], capsys)
    assert "--max-concurrent 0 is invalid" in refused(sweep.main, ["--max-concurrent", "0"], capsys)
    assert "--timeout -1.0 is invalid" in refused(submit.main, ["--timeout", "-1"], capsys)
    assert "--max-steps 0 is invalid" in refused(autoscale_demo.main, ["--max-steps", "0"], capsys)


@pytest.mark.parametrize("name", ["../../escape", "runs/a", "..", ".", "", "a\\b"])
def test_the_run_name_is_one_plain_folder_name(tmp_path, name, capsys):
    # The run's folder is <storage>/<name>: '--name ../../escape' had exported outside the storage.
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    line = refused(parse_args, ["--storage-path", str(tmp_path), "--name", name], capsys)
    assert line.endswith(
        f"error: name={name!r} (--name) is invalid; expected a plain name, one folder under the storage path: "
        "not empty, no '/' or '\\', not only dots, e.g. --name my_run"
    )
    assert list(tmp_path.iterdir()) == []
    assert parse_args(["--storage-path", str(tmp_path), "--name", "run-2.b_c"])[2].name == "run-2.b_c"


@pytest.mark.slow  # imports Ray in a subprocess (11 s); tests/test_layers.py checks the same arrow in the source
def test_the_job_lives_above_the_ray_library_which_exports_none_of_its_names():
    """``hf_lowzero.ray`` never imports the job (``hf_lowzero.recipes.clm_ray``), and the job's names it
    used to export (deprecated aliases until issue 56) are the job's alone."""
    import subprocess

    probe = "import sys, hf_lowzero.ray; print(sorted(m for m in sys.modules if m.startswith('hf_lowzero.recipes')))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"

    import hf_lowzero.ray
    from hf_lowzero.recipes import clm_ray

    for name in ("RayFinetuneConfig", "build_trainer", "run_finetune", "train_loop_per_worker"):
        assert name in clm_ray.__all__ and name not in hf_lowzero.ray.__all__
        with pytest.raises(AttributeError):
            getattr(hf_lowzero.ray, name)


def test_reduction_flag(monkeypatch, capsys):
    """``--reduction exact`` reaches the Trainer's ZeroConfig; combinations it cannot keep invariant
    are refused with the numbers."""
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    config = parse_args(["--reduction", "exact", "--num-workers", "1-4", "--global-batch-size", "48"])[2]
    args = config.training_arguments("out", world_size=3)
    assert (args.zero_reduction, args.to_zero_config().reduction, args.gradient_accumulation_steps) == (
        "exact",
    ) * 2 + (4,)
    assert parse_args([])[2].training_arguments("out", 2).to_zero_config().reduction == "ddp"
    assert "reduction='sum' is invalid" in refused(parse_args, ["--reduction", "sum"], capsys)
    line = refused(parse_args, ["--reduction", "exact", "--num-workers", "1-4"], capsys)
    assert "num_workers=1-4 needs global_batch_size" in line
    line = refused(parse_args, ["--reduction", "exact", "--zero-stage", "0"], capsys)
    assert "needs zero_stage 1, 2 or auto" in line
    line = refused(parse_args, ["--reduction", "exact", "--num-workers", "1-3", "--global-batch-size", "16"], capsys)
    assert "global_batch_size=16 is not a positive multiple of per_device_train_batch_size * world size = 4 * 3" in line


# Flags the workers used to refuse only after a cluster start, or nobody refused (issue 55).
BAD_FLAGS = [
    (["--zero-config", "not json"], "zero_config='not json' is neither an existing file nor valid JSON"),
    (["--optim", "not_an_optim"], "optim='not_an_optim' is invalid; expected one of the Trainer's optimizers"),
    (["--per-device-train-batch-size", "0"], "per_device_train_batch_size=0 is invalid; expected a number >= 1"),
    (["--gradient-accumulation-steps", "0"], "gradient_accumulation_steps=0 is invalid; expected a number >= 1"),
    (["--learning-rate", "-1"], "learning_rate=-1.0 is invalid; expected a number >= 0"),
    (["--num-to-keep", "0"], "num_to_keep=0 is invalid; expected a number >= 1"),
    (["--max-failures", "-5"], "max_failures=-5 is invalid; expected >= 0, or -1 to restart without end"),
    (["--zero-stage", "0", "--zero-config", '{"stage": 1}'], "zero_config sets stage=1 but zero_stage=0"),
    (["--zero-stage", "0", "--zero-config", '{"reduce_bucket_mb": -1}'], "reduce_bucket_mb"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[argv[-2] for argv, _ in BAD_FLAGS])
def test_the_driver_refuses_what_the_workers_would_in_one_line(argv, message, tmp_path, capsys):
    """``parse_args`` builds the job's TrainingArguments (and ZeroConfig) as a worker would."""
    sys.path.insert(0, str(ROOT / "ray_jobs"))
    from finetune import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--storage-path", str(tmp_path / "runs"), *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and ": error: " in err and message in err, err
    assert list(tmp_path.iterdir()) == []  # no storage or run folder made


# The second flag through the script is the slow tier's: the driver's check is the same call for both.
@pytest.mark.parametrize("argv", [BAD_FLAGS[0][0], slow(BAD_FLAGS[1][0])], ids=["zero_config", "optim"])
def test_the_job_script_refuses_a_bad_flag_before_ray_starts(argv, tmp_path):
    """The real entry: exit status 2, one error line naming the flag, and no Ray instance (none of
    its session files under RAY_TMPDIR, nothing of its start-up printed)."""
    import subprocess

    env = dict(os.environ, RAY_TMPDIR=str(tmp_path / "ray"))
    env.pop("RAY_ADDRESS", None)
    script = [sys.executable, str(ROOT / "ray_jobs" / "finetune.py"), "--storage-path", str(tmp_path / "runs"), *argv]
    done = subprocess.run(script, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    flag = argv[0][2:].replace("-", "_")
    assert len(errors) == 1 and errors[0].startswith(f"finetune.py: error: {flag}="), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert "Ray" not in done.stderr and not (tmp_path / "ray").exists() and not (tmp_path / "runs").exists()
