"""The example script under its launchers: torchrun, and accelerate launch against it bit for bit.

[Note: accelerate launch on CPU] ``accelerate launch --num_processes 2`` picks its launcher from the
config file and the visible GPUs (accelerate 1.15, ``commands/launch.py``). With no config and fewer
than two GPUs, CPU-only included, it runs the script *once* (``simple_launcher``), setting
``MASTER_ADDR``/``MASTER_PORT`` and ``ACCELERATE_USE_CPU`` but no ``WORLD_SIZE`` or ``RANK``.
``--multi_gpu`` (or ``distributed_type: MULTI_GPU`` in the config) selects ``multi_gpu_launcher``,
which is ``torch.distributed.run``: one process per rank with the variables torchrun sets, so on CPU
the ranks run gloo exactly as under torchrun. ``HF_HOME`` points into the test's temp dir, so a
user's ``~/.cache/huggingface/accelerate/default_config.yaml`` cannot change the launcher.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_lowzero.checkpoint.layout import TRAINER_SUBDIR, rank_file_name
from hf_lowzero.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/finetune_clm.py"
STEPS = 8
FLAGS = [
    "--zero_stage",
    "2",
    "--max_steps",
    str(STEPS),
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--disable_tqdm",
    "true",
    "--learning_rate",
    "3e-3",
]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]  # the `accelerate` command


def run_example(launcher: list[str], out: Path, *flags: str) -> subprocess.CompletedProcess:
    # No GPU and no accelerate config from the user's home: both launchers run gloo ranks on CPU.
    env = dict(os.environ, HF_HOME=str(out.parent / "hf_home"), CUDA_VISIBLE_DEVICES="")
    cmd = [*launcher, str(EXAMPLE), *FLAGS, "--output_dir", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def torchrun_out(tmp_path_factory) -> tuple[Path, str]:
    """The reference: the example under ``torchrun --nproc-per-node 2`` (output dir, stdout)."""
    out = tmp_path_factory.mktemp("torchrun") / "clm"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    result = run_example([*torchrun, "--master-port", str(free_port())], out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stdout


def step_losses(out: Path) -> list[float]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def shard_files(out: Path) -> list[str]:
    return sorted(p.name for p in (out / f"checkpoint-{STEPS}" / TRAINER_SUBDIR).glob("zero_shard_rank*"))


@pytest.mark.slow  # launches torchrun / accelerate subprocesses: the second tier
def test_example_finetunes_with_torchrun(torchrun_out):
    out, stdout = torchrun_out
    line = next(s for s in stdout.splitlines() if s.startswith("zero_stage=2"))
    first, last = (float(line.split(f"{k} loss=")[1].split()[0]) for k in ("first", "last"))
    assert last < first, line  # it learns
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() > 0


@pytest.mark.slow  # launches torchrun / accelerate subprocesses: the second tier
def test_accelerate_launch_matches_torchrun(torchrun_out, tmp_path):
    ref, _ = torchrun_out
    out = tmp_path / "clm"
    launcher = [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port())]
    result = run_example(launcher, out)
    assert result.returncode == 0, result.stderr[-3000:]
    two_ranks = [rank_file_name(r, 2) for r in range(2)]
    assert shard_files(ref) == two_ranks and shard_files(out) == two_ranks  # both really ran 2 ranks
    losses = step_losses(out)
    assert len(losses) == STEPS and losses == step_losses(ref)
    weights, ref_weights = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, ref_weights[name]), name


@pytest.mark.slow  # launches torchrun / accelerate subprocesses: the second tier
def test_accelerate_launch_starting_one_process_for_two_is_refused(tmp_path):
    # [Note: accelerate launch on CPU]: without --multi_gpu the script runs once. Training a world
    # of 1 would silently halve the global batch --num_processes 2 asked for: the Trainer must
    # refuse, naming the flag that gives two ranks.
    out = tmp_path / "clm"
    launcher = [*ACCELERATE, "--num_processes", "2", "--main_process_port", str(free_port())]
    result = run_example(launcher, out, "--max_steps", "1")
    shards = sorted(p.name for p in out.glob(f"checkpoint-*/{TRAINER_SUBDIR}/zero_shard_rank*"))
    assert result.returncode != 0, f"trained as one process, saving {shards}"
    assert "--multi_gpu" in result.stderr, result.stderr[-3000:]
