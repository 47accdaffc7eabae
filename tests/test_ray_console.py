"""The main job as a person runs it: ``python ray_jobs/finetune.py`` with a worker killed once prints
one progress line per logging step of each attempt, from the first rank only and with the losses the
Trainer logged, none of Ray's known noise, and a summary that counts the restart and names a
``from_pretrained`` directory holding the final checkpoint's consolidated weights."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray")

from hf_lowzero import consolidate_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, SAVE, KILL_AT = 6, 3, 5
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WORKER_LINE = re.compile(r"^\(RayTrainWorker pid=(\d+)(?:, ip=[^)]*)?\) (.*)$")
ATTEMPT_LINE = re.compile(r"^\[hf_lowzero\] attempt (\d+): (?:resuming at step (\d+)/\d+|.*)")
STEP_LINE = re.compile(
    r"^step +(\d+)/(\d+) \[[#.]{20}\] +\d+% \| loss (\d+\.\d{4}) \| lr \S+ \| grad_norm \S+ \| world 2$"
)
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
def job(tmp_path_factory):
    """One run of the main job, killed once at step KILL_AT: (console lines, summary, storage)."""
    storage = tmp_path_factory.mktemp("runs")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, str(ROOT / "ray_jobs/finetune.py"), "--max-steps", str(STEPS), "--save-steps", str(SAVE),
           "--inject-failure-at-step", str(KILL_AT), "--storage-path", str(storage), "--name", "console"]  # fmt: skip
    run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=500)
    console = ANSI.sub("", run.stdout)
    assert run.returncode == 0, console[-5000:]
    summary = dict(re.findall(r"^(final loss|restarts survived|checkpoint|model) +(.*)$", console, re.M))
    return console.splitlines(), summary, storage


def trainer_losses(trainer_checkpoint: Path) -> dict[int, float]:
    """The loss the Trainer logged at each step, from the final checkpoint's trainer_state.json."""
    history = json.loads((trainer_checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def test_console_has_one_line_per_logging_step_of_each_attempt_from_the_first_rank(job):
    lines, summary, _ = job
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
    assert [s for s, _ in attempts[0]["steps"]] == list(range(1, KILL_AT)), "killed before step KILL_AT logs"
    assert attempts[1]["resumed"] in (0, SAVE)  # the step-SAVE checkpoint, or none if its upload was cut short
    assert [s for s, _ in attempts[1]["steps"]] == list(range(attempts[1]["resumed"] + 1, STEPS + 1))
    logged = trainer_losses(Path(summary["checkpoint"]))
    for attempt in attempts:
        for step, loss in attempt["steps"]:
            assert loss == f"{logged[step]:.4f}", f"step {step}"


def test_console_carries_the_failure_and_none_of_the_known_noise(job):
    lines, _, _ = job
    assert [line for line in lines if any(noise in line for noise in KNOWN_NOISE)] == []
    assert any(line.endswith(f"[hf_lowzero] injecting a failure: killing rank 1 at step {KILL_AT}") for line in lines)


def test_summary_counts_the_restart_and_names_the_final_checkpoint(job):
    _, summary, storage = job
    assert summary["restarts survived"] == "1"
    final = Path(summary["checkpoint"])
    assert final.name == f"checkpoint-{STEPS}" and final.parent.parent == storage / "console"
    assert summary["final loss"] == f"{trainer_losses(final)[STEPS]:.4f} at step {STEPS}/{STEPS}"
    assert summary["model"].split()[0] == str(storage / "console" / "export")


def test_exported_model_loads_with_from_pretrained_and_holds_the_consolidated_weights(job):
    from transformers import AutoModelForCausalLM

    _, summary, _ = job
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
