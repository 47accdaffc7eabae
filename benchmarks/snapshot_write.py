"""What a memory snapshot costs a rank's process, measured alone: the stop, the trainer state, the write.

    python benchmarks/snapshot_write.py --before 0423e57      # ~4 min on a 2-core CPU machine

Two ranks train with ``LowZeroTrainer`` (ZeRO-2, AdamW, gloo, no Ray, no holders), and after every
step from the 6th each rank does what ``MemorySnapshots``'s stop does for a snapshot on the host:
stages its shard (``ShardStager.stage``: on the host its live tensors, no copy: [Note: written from
the live shard]; a checkout older than that copies them into a host buffer), takes the Trainer's
part (``trainer_manifest``, each log entry copied once) and writes its piece into a file in
``/dev/shm`` (``Staged.write``), over a spare file as a holder would leave one (the piece two
snapshots back becomes a spare). Rank 0's medians, for the main job's model (a tiny
GPT-2, a 0.7 MiB shard per rank) and the GPT-2 benchmark model (4x256, a 30 MiB shard), with this
checkout's code and, with ``--before REF``, the code of git commit REF, interleaved in each round.
The ratios are today's time over the same round's ``before``. Both ranks train at once on the 2
cores, as in a run: the times include that competition, but no holder's and no other node's.

Writes results/snapshot_write.md and .json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# HF_LOWZERO_BENCH_ROOT: a checkout of another commit whose hf_lowzero this process imports.
sys.path.insert(0, os.environ.get("HF_LOWZERO_BENCH_ROOT") or str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.common import gpt2, write_results  # noqa: E402

FIRST = 6  # the first steps pay one-time costs (buffers, files, mappings)
PARTS = ["stage_ms", "trainer_state_ms", "write_ms"]
MODELS = {  # the main job's tiny GPT-2 (hf_lowzero/recipes/clm.py) and the GPT-2 of benchmarks/recovery.py
    "main job": dict(n_layer=2, n_embd=64, vocab=257),
    "gpt2 4x256": dict(n_layer=4, n_embd=256, vocab=8192),
}


class SnapshotEachStep(TrainerCallback):
    """After each step from FIRST: stage, the Trainer's part, the piece written (rank 0 times them)."""

    def __init__(self, folder: str, out: str) -> None:
        self.folder, self.out, self.times, self.last = Path(folder), out, {p: [] for p in PARTS}, None

    def after_log_save_evaluate(self, trainer) -> None:
        from hf_lowzero.snapshot import ShardStager
        from hf_lowzero.snapshot.segments import recycle
        from hf_lowzero.trainer.snapshot_files import LogCopies, trainer_manifest

        step = trainer.state.global_step
        if step < FIRST or step == self.last:  # the epoch's end calls it again for the same step
            return
        self.last = step
        if not hasattr(self, "stager"):
            self.stager = ShardStager(trainer.zero_optimizer)
            self.log = LogCopies()  # each log entry copied once, as MemorySnapshots does
            # as MemorySnapshots stages on the host (an older checkout copies into a staging buffer)
            self.live = {"live": True} if "live" in inspect.signature(self.stager.stage).parameters else {}
        rank = dist.get_rank()
        start = time.perf_counter()
        staged = self.stager.stage(step, **self.live)
        staged_at = time.perf_counter()
        fields = trainer_manifest(trainer, include_state=rank == 0, log=self.log)
        fields_at = time.perf_counter()
        staged.write(self.folder / f"step{step}-rank{rank}.piece", spares=self.folder, **fields)
        end = time.perf_counter()
        old = self.folder / f"step{step - 2}-rank{rank}.piece"
        if old.exists():
            recycle(old, keep_at_most=2)  # what the holder does once a newer snapshot completes
        for part, seconds in zip(PARTS, (staged_at - start, fields_at - staged_at, end - fields_at)):
            self.times[part].append(1e3 * seconds)

    def on_train_end(self, args, state, control, **kwargs):
        self.stager.close()
        if dist.get_rank() == 0:
            Path(self.out).write_text(json.dumps({p: statistics.median(v) for p, v in self.times.items()}))


def _train(rank: int, world_size: int, model: str, steps: int, folder: str, out: str) -> None:
    from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments
    from hf_lowzero.recipes.clm import BlockDataset

    torch.set_num_threads(1)  # as in a Ray worker of one CPU
    spec = MODELS[model]
    net = gpt2(spec["n_layer"], spec["n_embd"], vocab=spec["vocab"], dropout=0.0)
    tokens = torch.randint(0, spec["vocab"], (256 * 64,), generator=torch.Generator().manual_seed(0))
    args = LowZeroTrainingArguments(
        output_dir=str(Path(folder) / "out"), zero_stage=2, use_cpu=True, per_device_train_batch_size=4,
        max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        disable_tqdm=True,
    )  # fmt: skip
    callback = SnapshotEachStep(folder, out)
    LowZeroTrainer(model=net, args=args, train_dataset=BlockDataset(tokens.tolist(), 64), callbacks=[callback]).train()


def one_run(job: dict) -> None:
    """``--one-run``: one measurement with this process's code (``HF_LOWZERO_BENCH_ROOT``)."""
    from hf_lowzero.testing import run_distributed

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as folder:
        run_distributed(_train, 2, model=job["model"], steps=job["steps"], folder=folder, out=job["out"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--before", default=None, help="also measure the code of this git commit, interleaved")
    p.add_argument("--out", default="snapshot_write", help="results/OUT.{md,json}")
    p.add_argument("--one-run", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one_run:
        return one_run(json.loads(a.one_run))

    root = str(Path(__file__).resolve().parents[1])
    work = Path(tempfile.mkdtemp(prefix="hf_lowzero_snapshot_write_"))
    codes = {"today": root}
    if a.before:
        codes = {"before": str(work / "before"), **codes}
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", codes["before"], a.before], check=True)
    from hf_lowzero.process_guard import run_tied  # here: a --one-run child may import an older library

    runs = []
    try:
        for r in range(a.rounds):
            for model in MODELS:
                for code, code_root in codes.items():
                    out = work / f"{r}_{model.replace(' ', '_')}_{code}.json"
                    job = json.dumps({"model": model, "steps": a.steps, "out": str(out)})
                    env = dict(os.environ, HF_LOWZERO_BENCH_ROOT=code_root, PYTHONPATH=code_root)
                    run_tied([sys.executable, __file__, "--one-run", job], env=env, check=True, cwd=code_root,
                             stdout=subprocess.DEVNULL)  # fmt: skip
                    runs.append({"round": r, "model": model, "code": code, **json.loads(out.read_text())})
                    print(runs[-1], flush=True)
    finally:
        if a.before:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", codes["before"]], check=False)

    rows = []
    for model in MODELS:
        for code in codes:
            mine = [x for x in runs if x["model"] == model and x["code"] == code]
            row = {"model": model, "code": code, **{part: statistics.median(x[part] for x in mine) for part in PARTS}}
            row.update({part.replace("_ms", "_vs_before"): "" for part in PARTS})
            if code == "today" and a.before:
                before = {y["round"]: y for y in runs if y["model"] == model and y["code"] == "before"}
                for part in PARTS:
                    ratios = [x[part] / before[x["round"]][part] for x in mine]
                    row[part.replace("_ms", "_vs_before")] = statistics.median(ratios)
            rows.append(row)
    header = (
        "# A snapshot's work in a rank's process, measured alone\n\n"
        f"`{' '.join(['python', 'benchmarks/snapshot_write.py', *sys.argv[1:]])}`: 2 ranks on a 2-core CPU machine, "
        "ZeRO-2, AdamW, gloo, one torch thread each, no Ray; after every step from the 6th each rank stages its "
        "shard (stage), takes the Trainer's part (trainer_state) and writes its piece into `/dev/shm` over a "
        f"spare file (write: the background thread's work). Rank 0's median, then the median over {a.rounds} "
        "rounds; `*_vs_before`: today's time over the same round's `before`"
        f"{f' (commit {a.before})' if a.before else ''}.\n"
    )
    columns = ["model", "code", *PARTS] + ([p.replace("_ms", "_vs_before") for p in PARTS] if a.before else [])
    print(write_results(a.out, rows, columns, header, data={"rows": rows, "runs": runs}))


if __name__ == "__main__":
    main()
