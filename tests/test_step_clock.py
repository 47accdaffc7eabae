"""The plan's step time against the run's (issue 56, must-hold 6; the Ray job prints both lines):
a real ``LowZeroTrainer`` with ``zero_stage="auto"`` on one CPU rank logs the plan's prediction for
the setup it took when it starts, times each step, and the end's line carries the median of those
times and its ratio to the prediction. Without a plan the start's line says how to get one.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import types

import pytest

from hf_lowzero import LowZeroTrainer
from hf_lowzero.plan.planner import parse_bytes
from hf_lowzero.plan.report import seconds_text
from hf_lowzero.recipes.clm_ray.summary import RunSummary
from hf_lowzero.timing import calibrate
from hf_lowzero.timing.devices import table_name
from hf_lowzero.trainer.auto import host_share
from hf_lowzero.trainer.step_clock import PlannedStepTime, plan_device_flags, step_time_line, trained_on
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.test_timing import FIXED_CPU
from tests.trainer_runs import make_args

STEPS = 4


@pytest.fixture
def fixed_cpu_cache(tmp_path, monkeypatch):
    """``cpu``'s figures fixed (no calibration run), and no process group left behind."""
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "cache"))
    calibrate.cache_path().parent.mkdir(parents=True)
    calibrate.cache_path().write_text(json.dumps(FIXED_CPU))
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_plans_step_time_at_the_start_and_the_measured_one_at_the_end(fixed_cpu_cache, tmp_path, caplog):
    args = make_args(tmp_path, "auto", zero_device_memory="1GiB", max_steps=STEPS, gradient_accumulation_steps=1)
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset())
    clock = PlannedStepTime(trainer.memory_plan)
    trainer.add_callback(clock)
    with caplog.at_level("INFO", logger="hf_lowzero.trainer.step_clock"):
        trainer.train()

    chosen = trainer.memory_plan.recommended  # the setup auto took, and the plan's time for it
    assert (trainer.args.zero_stage, bool(trainer.args.zero_offload_optimizer)) == (chosen.stage, chosen.offload)
    assert clock.predicted_s == chosen.step_time_s > 0
    (start,) = [r.getMessage() for r in caplog.records if "[hf_lowzero] plan:" in r.getMessage()]
    assert start == (
        f"[hf_lowzero] plan: {chosen.label} on 1 x cpu predicts {seconds_text(chosen.step_time_s)} per step "
        "(measured against it at the end)"
    )
    assert len(clock.step_times_s) == STEPS and all(t > 0 for t in clock.step_times_s)

    # [Note: the device named]: a plan timed for another device says so, and names the run's
    elsewhere = dataclasses.replace(trainer.memory_plan, timed_for=trainer.memory_plan.timed_for | {"device": "H100"})
    caplog.clear()
    with caplog.at_level("INFO", logger="hf_lowzero.trainer.step_clock"):
        PlannedStepTime(elsewhere).on_train_begin(trainer.args, trainer.state, trainer.control)
    assert caplog.records[-1].getMessage() == (
        f"[hf_lowzero] plan: {chosen.label} timed for 1 x H100, though this run trains on cpu, predicts "
        f"{seconds_text(chosen.step_time_s)} per step (measured against it at the end)"
    )
    median = statistics.median(clock.step_times_s)
    end = step_time_line(clock.step_times_s, clock.predicted_s)
    assert end == (
        f"measured median {seconds_text(median)} over {STEPS} steps; the plan predicted "
        f"{seconds_text(chosen.step_time_s)}: measured/predicted {median / chosen.step_time_s:.2f}"
    )


def test_without_a_plan_the_start_says_how_to_get_one(tmp_path, caplog):
    args = make_args(tmp_path, 2, max_steps=2, gradient_accumulation_steps=1)
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset())
    clock = PlannedStepTime(getattr(trainer, "memory_plan", None), how_to_plan="run the plan")
    trainer.add_callback(clock)
    try:
        with caplog.at_level("INFO", logger="hf_lowzero.trainer.step_clock"):
            trainer.train()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    assert "[hf_lowzero] plan: no step time predicted for stage 2 (no plan ran): run the plan" in caplog.text
    assert clock.predicted_s is None and len(clock.step_times_s) == 2
    assert step_time_line(clock.step_times_s, None).endswith("; no plan predicted it (zero_stage='auto' plans the run)")


def test_the_plans_command_names_the_device_the_run_trains_on(tmp_path):
    """The Ray job's hint names this worker's device ([Note: the device named]): on a CPU rank,
    ``cpu`` and the rank's share of the node's memory (it said ``cpu --device-memory 8GiB``, and
    ``H100`` for any GPU); a GPU by the device table's name."""
    args = make_args(tmp_path, 2, max_steps=1)
    assert trained_on(args) == "cpu"
    flags = plan_device_flags(args).split()
    assert flags[:3] == ["--device", "cpu", "--device-memory"]
    assert parse_bytes(flags[3], "device_memory") == pytest.approx(host_share(), rel=0.01)
    assert [table_name(n) for n in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "Tesla T4")] == [
        "H200", "A100-80GB", "L4", None
    ]  # fmt: skip


def test_the_ray_jobs_summary_ends_with_the_step_time_line_of_its_returned_times():
    """The summary's row is ``step_time_line`` of what the first rank returned (``Result.return_value``)."""
    times, predicted = [0.05, 0.07, 0.04, 0.06], 0.04
    result = types.SimpleNamespace(metrics={}, return_value={"step_times_s": times, "predicted_step_s": predicted})
    summary = RunSummary(result, 4, 1.0, restarts=0, trainer_checkpoint=None, export_dir=None)
    (row,) = [line for line in str(summary).splitlines() if line.startswith("step time")]
    assert (
        row.split(None, 2)[2] == "measured median 55 ms over 4 steps; the plan predicted 40 ms: measured/predicted 1.38"
    )
    restarted = RunSummary(result, 4, 1.0, restarts=1, trainer_checkpoint=None, export_dir=None)
    assert str(restarted).count("measured/predicted 1.38 (last attempt)") == 1
