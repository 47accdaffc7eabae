"""Changing a Ray run's cluster at known steps, and reading what the run left: a callback holds the
workers at chosen steps until the test removed or added a node (which ends that attempt), and the
final checkpoint's loss curve and optimizer tensors are read back from storage.

Example (a run that loses a node after step 4 and gets it back after step 8)::

    hold = HoldAt({4, 8}, signals)
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(build_trainer(config, trainer_callbacks=[hold]).fit)
        wait_for(signals / "hold_4", run)
        cluster.remove_node(nodes.pop())
        wait_for(signals / "hold_8", run)
        nodes.append(ray_clusters.add_slot_node(cluster))
        result = run.result(timeout=HOLD_TIMEOUT_S)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_lowzero.checkpoint.layout import META_FILE, TRAINER_SUBDIR
from hf_lowzero.ray.snapshots import snapshot_takers
from tests.ray_checkpoints import trainer_checkpoint

# A bound for a run that went wrong, never a wait of a run that goes right: under CI's load (three
# lanes of Ray tests on 2 cores) a run took more than 240 s to reach its sixth step.
HOLD_TIMEOUT_S = 480


class HoldAt(TrainerCallback):
    """At each step of ``steps``, once per run, when everything that step stores has landed (Ray
    committed its storage checkpoint, if it is a save step, and its memory snapshot, if it takes
    one): rank 0 writes ``signal_dir/hold_<step>`` (holding the world size), and every rank waits
    for the test to change the cluster, which ends this attempt."""

    def __init__(self, steps: set[int], signal_dir: Path) -> None:
        self.steps, self.signal_dir = steps, signal_dir

    def after_log_save_evaluate(self, trainer) -> None:
        """Called by ``LowZeroTrainer`` after the step's save and memory snapshot."""
        step = trainer.state.global_step
        marker = self.signal_dir / f"hold_{step}"
        if step not in self.steps or marker.exists():
            return
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        for taker in snapshot_takers():
            taker.wait()
        dist.barrier()  # every rank checked the marker before it appears
        if dist.get_rank() == 0:
            marker.write_text(str(dist.get_world_size()))
        time.sleep(HOLD_TIMEOUT_S)
        raise RuntimeError(f"the cluster did not change within {HOLD_TIMEOUT_S} s of step {step}")


def wait_for(path: Path, run, timeout_s: float = HOLD_TIMEOUT_S) -> None:
    """Wait until ``path`` exists; fail if the run (a ``Future`` of ``fit``) ended first or it took too long."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if run.done():
            raise AssertionError(f"the run ended before {path.name}: {run.result()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} within {timeout_s} s")
        time.sleep(0.2)


def final_checkpoint(run) -> Path:
    """``run``'s final Trainer checkpoint: a Ray ``Result``'s (the ``checkpoint-N`` folder inside its
    last Ray checkpoint), or ``run`` itself when it is a path (a run without Ray)."""
    return run if isinstance(run, Path) else trainer_checkpoint(run.checkpoint.path)


def loss_curve(run) -> list[dict]:
    """The final checkpoint's log entries that have a loss: one per step with ``logging_steps=1``."""
    history = json.loads((final_checkpoint(run) / "trainer_state.json").read_text())
    return [h for h in history["log_history"] if "loss" in h]


def final_tensors(run) -> dict[str, torch.Tensor]:
    """Every tensor of the final checkpoint: the model's weights (``model/...``) and every rank's
    optimizer shard (``zero_shard_*/...``: master weights and optimizer state)."""
    checkpoint = final_checkpoint(run)
    tensors = {f"model/{k}": v for k, v in load_file(checkpoint / "model.safetensors").items()}
    for shard in sorted((checkpoint / TRAINER_SUBDIR).glob("zero_shard_*")):
        tensors |= {f"{shard.name}/{k}": v for k, v in load_file(shard).items()}
    return tensors


def zero_metadata(run) -> dict:
    """The final checkpoint's ZeRO metadata (world size, loss scaler, exact grid, ...)."""
    return json.loads((final_checkpoint(run) / TRAINER_SUBDIR / META_FILE).read_text())
