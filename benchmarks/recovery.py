"""What memory snapshots cost while training, and what they save when a worker or a node is lost.

    python benchmarks/recovery.py                 # ~15 min on a 2-core CPU machine
    python benchmarks/recovery.py --rounds 1 --overhead-steps 30   # shorter, noisier
    python benchmarks/recovery.py --before 7494209                  # also the code of a commit, interleaved
    python benchmarks/recovery.py --no-failures --paired --settings off,1   # with and without, in each run

Everything runs in one invocation on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``:
a head node and two worker nodes of one worker slot each, so each rank has a node of its own), with
the Ray job's recipe (``build_trainer``) on the GPT-2 benchmark model (4 layers, width 256, 8192-token
vocabulary, dropout off), 2 workers, ZeRO-2, AdamW, gloo.

1. **Step-time overhead.** Runs with ``snapshot_every`` = off, 1, 2, 5, 10 and auto, in turn, for
   ``--rounds`` rounds (off, 1, 2, ..., auto, off, 1, ...), no storage checkpoint within the measured
   steps. Each run's time per step is the mean over its steps after the first WARMUP (a snapshot
   every N steps costs once per N steps); the overhead of a setting is its step time over the same
   round's "off" run, minus 1 (median over rounds, with the smallest and largest). The same for the
   main job's model (``ray_jobs/finetune.py``'s tiny GPT-2, a 0.7 MiB shard per rank) with off, 1
   and auto, ``--main-job-steps`` steps per run (its steps take about 30 ms: 60 of them are within
   this machine's noise): a snapshot's cost is the step time at ``snapshot_every=1`` minus the step
   time without.
   With ``--paired``, a fixed ``snapshot_every`` is measured within its own run instead: blocks of
   steps with and without snapshots in turn, each pair compared ([Note: paired blocks]; GPT-2:
   blocks of 10 steps, the main job: 40), the median over the pairs of every round.
   With ``--before REF`` every run is also made with the library as it was at git commit REF (a
   worktree of it is what the Ray workers import), interleaved with today's code in each round.
2. **A failure between two storage checkpoints** (``save_steps=20``, failure after step 37 of 40):
   - process kill from memory: rank 1's process dies (``InjectWorkerFailure``), snapshots every step;
   - node kill from buddies: rank 1's node is removed and a fresh node added, snapshots every step;
   - storage only: rank 1's process dies, no snapshots.
   For each: steps lost (the failed step minus the step resumed), seconds from the failure to the
   end of the first new step, and of those the state-loading part (from ``resume_checkpoint()``'s
   start to ``on_train_begin``: fetching and writing the snapshot, or nothing for local storage,
   then the Trainer loading it).

Writes results/recovery.md, results/recovery.json and results/recovery.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# HF_LOWZERO_BENCH_ROOT: a checkout of another commit whose hf_lowzero this process and its Ray
# workers import (Ray puts the driver's sys.path in front of the workers', so the driver decides).
sys.path.insert(0, os.environ.get("HF_LOWZERO_BENCH_ROOT") or str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.common import RESULTS, bar_plot, gpt2, markdown_table, write_results  # noqa: E402
from hf_lowzero.ray import InjectWorkerFailure  # noqa: E402
from hf_lowzero.ray.restore import last_resume  # noqa: E402
from hf_lowzero.ray.snapshots import snapshot_takers  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, build_trainer  # noqa: E402

WARMUP = 5
SETTINGS = ["off", 1, 2, 5, 10, "auto"]
MAIN_JOB_SETTINGS = ["off", 1, "auto"]
SAVE_STEPS, FAIL_AT, FAIL_STEPS = 20, 37, 40


class StepClock(TrainerCallback):
    """Rank 0 appends one JSON line per event to ``log``: the attempt's start, and each step's end."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def on_train_begin(self, args, state, control, **kwargs):
        resumed = last_resume()
        self._write({"event": "train_begin", "step": state.global_step,
                     "resume_started": resumed.started_at if resumed else None})  # fmt: skip

    def on_step_end(self, args, state, control, **kwargs):
        self._write({"event": "step_end", "step": state.global_step})

    def on_train_end(self, args, state, control, **kwargs):
        takers = snapshot_takers()  # the loop's stops for snapshots (the copy, and agreeing on the interval)
        if takers:
            taken = max(1, takers[0].snapshots_taken)
            self._write({"event": "train_end", "snapshots": takers[0].snapshots_taken,
                         "stopped_ms_per_snapshot": 1e3 * takers[0].stopped_s / taken})  # fmt: skip

    def _write(self, record: dict) -> None:
        if dist.get_rank() == 0:
            with open(self.log, "a") as f:
                f.write(json.dumps({**record, "time": time.time()}) + "\n")


class PairedBlocks(TrainerCallback):
    """Snapshots only in every other block of ``block`` steps: a run with a fixed ``snapshot_every``
    then has blocks with snapshots and blocks without, in turn ([Note: paired blocks])."""

    def __init__(self, block: int) -> None:
        self.block = block

    def on_train_begin(self, args, state, control, **kwargs):
        for taker in snapshot_takers():
            fixed = taker.schedule.due
            taker.schedule.due = lambda step, fixed=fixed: snapshots_on(step, self.block) and fixed(step)


def snapshots_on(step: int, block: int) -> bool:
    """Whether ``step`` is in a block with snapshots (the first block has none)."""
    return (step // block) % 2 == 1


# [Note: paired blocks]
# On this VM the time of a step drifts by 10-25% from one minute to the next, so a run with
# snapshots compared with another run without them measures the machine as much as the snapshots.
# With ``--paired``, a run with a fixed ``snapshot_every`` takes snapshots only in every other block
# of steps, and each block with snapshots is compared with the block without just before it: the
# same processes, the same minute. A step's time counts toward the block of the step before it (a
# snapshot is taken after a step ends and slows the steps after it), and the first SETTLE steps of
# each block are left out (the last snapshots of a block are still being written then). The
# overhead is the median over the pairs of all rounds.
SETTLE = 2


def paired_overheads(log: list[dict], block: int) -> list[float]:
    """The step-time overhead of each block with snapshots over the block without them before it."""
    ends = {r["step"]: r["time"] for r in log if r["event"] == "step_end"}
    blocks: dict[int, list[float]] = {}
    for step in sorted(ends):
        if step - 1 not in ends or step < WARMUP or (step - 1) % block < SETTLE:
            continue
        blocks.setdefault((step - 1) // block, []).append(ends[step] - ends[step - 1])
    return [
        statistics.mean(blocks[b]) / statistics.mean(blocks[b - 1]) - 1
        for b in sorted(blocks)
        if snapshots_on(b * block, block) and b - 1 in blocks
    ]


class KillNodeAt(TrainerCallback):
    """At step ``step`` (end of the step, like ``InjectWorkerFailure``), once: the last rank writes its
    node id to ``signal`` and every rank waits; the driver removes that node."""

    def __init__(self, step: int, signal: Path) -> None:
        self.step, self.signal = step, signal

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.signal.exists():
            return
        # As InjectWorkerFailure: Ray registered the storage checkpoints so far, every snapshot landed.
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        for taker in snapshot_takers():
            taker.wait()
        dist.barrier()
        if dist.get_rank() == dist.get_world_size() - 1:
            self.signal.write_text(json.dumps({"node": ray.get_runtime_context().get_node_id(), "time": time.time()}))
        time.sleep(600)


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_ms(log: list[dict]) -> float:
    """Mean time per step after WARMUP steps: the mean, not the median, so that a cost paid every
    N-th step counts once per N steps."""
    ends = [r["time"] for r in log if r["event"] == "step_end"][WARMUP:]
    return 1e3 * (ends[-1] - ends[0]) / (len(ends) - 1)


def fit(config: RayFinetuneConfig, callbacks: list, cluster=None, signal: Path | None = None):
    trainer = build_trainer(config, trainer_callbacks=callbacks)
    if signal is None:
        return trainer.fit()
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(trainer.fit)
        while not signal.exists():
            if run.done():
                raise RuntimeError(f"the run ended before its node was killed: {run.result()}")
            time.sleep(0.1)
        node = json.loads(signal.read_text())["node"]
        (doomed,) = [n for n in cluster.slot_nodes if n.node_id == node]
        cluster.slot_nodes.remove(doomed)
        cluster.remove_node(doomed)
        cluster.slot_nodes.append(cluster.add_node(num_cpus=1, resources={"worker_slot": 1}))
        return run.result()


def use_code(cluster, root: str) -> None:
    """Connect to ``cluster`` with Ray workers that import hf_lowzero from ``root``."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}})


def fit_with_code(root: str, today: str, address: str, fields: dict, log: Path, block: int | None = None) -> None:
    """One overhead run whose driver and workers import hf_lowzero from ``root``: in this process
    for today's code, else in a new driver process of its own (``--one-run``); ``block``: paired
    blocks of this many steps ([Note: paired blocks])."""
    if root == today:
        result = fit(RayFinetuneConfig(**fields), [StepClock(log)] + ([PairedBlocks(block)] if block else []))
        if result.error:
            raise RuntimeError(f"{fields['name']} failed: {result.error}")
        return
    from hf_lowzero.process_guard import run_tied  # here: a --one-run child may import an older library

    env = dict(os.environ, HF_LOWZERO_BENCH_ROOT=root, PYTHONPATH=root)
    job = json.dumps({"address": address, "root": root, "fields": fields, "log": str(log), "block": block})
    run_tied([sys.executable, __file__, "--one-run", job], env=env, check=True, cwd=root)


def one_run(job: dict) -> None:
    """``--one-run``: connect to the benchmark's cluster and make one run with this process's code."""
    ray.init(address=job["address"], log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": job["root"]}})
    paired = [PairedBlocks(job["block"])] if job.get("block") else []
    result = fit(RayFinetuneConfig(**job["fields"]), [StepClock(Path(job["log"])), *paired])
    if result.error:
        raise RuntimeError(f"{job['fields']['name']} failed: {result.error}")


def overhead_rows(a, models: dict[str, dict], codes: dict[str, str], cluster, work: Path) -> tuple[list[dict], dict]:
    """For each model (its settings and config fields) and each code (name: source root), the
    overhead of each setting against the same round's run without snapshots."""
    runs = []
    for r in range(a.rounds):
        for model, spec in models.items():
            for setting in spec["settings"]:
                for code, root in codes.items():
                    log = work / f"overhead_{r}_{model}_{code}_{setting}.jsonl"
                    every = None if setting == "off" else setting
                    fields = dict(
                        spec["config"],
                        name=f"overhead_{r}_{model}_{code}_{setting}".replace(" ", "_"),
                        snapshot_every=every,
                        max_steps=spec["steps"],
                        save_steps=spec["steps"],
                    )
                    block = spec["block"] if a.paired and isinstance(setting, int) else None
                    fit_with_code(root, codes["today"], cluster.address, fields, log, block)
                    records = read_log(log)
                    end = next((x for x in records if x["event"] == "train_end"), {})
                    runs.append({"round": r, "model": model, "code": code, "setting": str(setting),
                                 "ms_per_step": step_ms(records), "snapshots": end.get("snapshots", 0),
                                 "stopped_ms": end.get("stopped_ms_per_snapshot", 0.0),
                                 "paired": paired_overheads(records, block) if block else None})  # fmt: skip
                    print(runs[-1], flush=True)
    rows = []
    for model, spec in models.items():
        for code in codes:
            mine = [x for x in runs if x["model"] == model and x["code"] == code]
            off = {x["round"]: x["ms_per_step"] for x in mine if x["setting"] == "off"}
            for setting in spec["settings"][1:]:
                these = [x for x in mine if x["setting"] == str(setting)]
                if these[0]["paired"] is not None:  # within each run ([Note: paired blocks])
                    ratios = [ratio for x in these for ratio in x["paired"]]
                    extra_ms = [ratio * off[x["round"]] for x in these for ratio in x["paired"]]
                else:  # against the same round's run without snapshots
                    ratios = [x["ms_per_step"] / off[x["round"]] - 1 for x in these]
                    extra_ms = [x["ms_per_step"] - off[x["round"]] for x in these]
                rows.append({
                    "model": model,
                    "code": code,
                    "snapshot_every": str(setting),
                    "overhead_pct": 100 * statistics.median(ratios),
                    "min_pct": 100 * min(ratios),
                    "max_pct": 100 * max(ratios),
                    "ms_per_step": statistics.median(x["ms_per_step"] for x in these),
                    "ms_per_snapshot": statistics.median(extra_ms) if setting == 1 else "",
                    "snapshots": statistics.median(x["snapshots"] for x in these),
                    "measured": "paired blocks" if these[0]["paired"] is not None else "against off run",
                    "stopped_ms_per_snapshot": statistics.median(x["stopped_ms"] for x in these),
                })  # fmt: skip
    off_ms = {
        model: statistics.median(x["ms_per_step"] for x in runs if x["model"] == model and x["setting"] == "off")
        for model in models
    }
    return rows, {"runs": runs, "off_ms_per_step": off_ms}


def failure_row(kind: str, common: dict, work: Path, cluster) -> dict:
    log, marker = work / f"fail_{kind}.jsonl", work / f"fail_{kind}_marker"
    every = None if kind == "storage only" else 1
    config = RayFinetuneConfig(**common, name=f"fail_{kind.replace(' ', '_')}", snapshot_every=every,
                               max_steps=FAIL_STEPS, save_steps=SAVE_STEPS)  # fmt: skip
    if kind == "node kill from buddies":
        result = fit(config, [StepClock(log), KillNodeAt(FAIL_AT, marker)], cluster, marker)
        failed_at = json.loads(marker.read_text())["time"]
    else:
        marker.mkdir()
        result = fit(config, [StepClock(log), InjectWorkerFailure(FAIL_AT, marker)])
        failed_at = next(marker.iterdir()).stat().st_mtime
    if result.error:
        raise RuntimeError(f"{kind} failed: {result.error}")
    records = read_log(log)
    begins = [r for r in records if r["event"] == "train_begin"]
    resumed = begins[-1]
    first_new = next(r for r in records if r["event"] == "step_end" and r["time"] > resumed["time"])
    return {
        "failure": kind,
        "resumed_from": result.metrics["resumed_from"],
        "resumed_step": resumed["step"],
        "steps_lost": FAIL_AT - resumed["step"],
        "failure_to_first_new_step_s": first_new["time"] - failed_at,
        "state_loading_s": resumed["time"] - resumed["resume_started"],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the overhead runs")
    p.add_argument("--overhead-steps", type=int, default=60, help="steps per overhead run of the GPT-2 model")
    p.add_argument("--main-job-steps", type=int, default=300, help="steps per overhead run of the main job's model")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--before", default=None, help="also measure the overhead with the code of this git commit")
    p.add_argument("--settings", default="off,1,2,5,10,auto", help="snapshot_every values of the GPT-2 runs")
    p.add_argument("--no-failures", action="store_true", help="only the overhead runs")
    p.add_argument(
        "--paired", action="store_true", help="fixed intervals: blocks with and without snapshots in turn in each run"
    )
    p.add_argument("--models", default="gpt2,main job", help="comma-separated: gpt2, main job")
    p.add_argument("--out", default="recovery", help="results/OUT.{md,json,png}")
    p.add_argument("--one-run", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one_run:
        return one_run(json.loads(a.one_run))

    settings = [s if s in ("off", "auto") else int(s) for s in a.settings.split(",")]
    if settings[0] != "off":
        p.error("--settings must start with off (the baseline)")
    chosen = [m.strip() for m in a.models.split(",")]
    if not chosen or any(m not in ("gpt2", "main job") for m in chosen):
        p.error(f"--models {a.models!r}: expected a comma-separated list of gpt2 and main job")
    work = Path(tempfile.mkdtemp(prefix="hf_lowzero_recovery_"))
    model = gpt2(a.n_layer, a.n_embd, vocab=a.vocab, dropout=0.0)
    params = sum(t.numel() for t in model.parameters())
    model.save_pretrained(work / "model")
    del model
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.slot_nodes = [cluster.add_node(num_cpus=1, resources={"worker_slot": 1}) for _ in range(2)]
    root = str(Path(__file__).resolve().parents[1])
    codes = {"today": root}
    if a.before:
        codes = {"before": str(work / "before"), **codes}
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", codes["before"], a.before], check=True)
    base = dict(num_workers=2, storage_path=str(work / "storage"), resources_per_worker='{"worker_slot": 1}',
                num_to_keep=1, max_failures=1)  # fmt: skip
    common = dict(base, per_device_train_batch_size=4, model_name_or_path=str(work / "model"))
    models = {
        f"gpt2 {a.n_layer}x{a.n_embd}": {
            "settings": settings,
            "config": common,
            "steps": a.overhead_steps,
            "block": 10,
        },
        # ray_jobs/finetune.py's model and batch; its steps are short, so its runs are longer
        "main job": {"settings": MAIN_JOB_SETTINGS, "config": base, "steps": a.main_job_steps, "block": 40},
    }
    models = {name: spec for name, spec in models.items() if ("main job" if name == "main job" else "gpt2") in chosen}
    try:
        use_code(cluster, root)
        overhead, raw = overhead_rows(a, models, codes, cluster, work)
        kinds = () if a.no_failures else ("process kill from memory", "node kill from buddies", "storage only")
        failures = [failure_row(k, common, work, cluster) for k in kinds]
    finally:
        ray.shutdown()
        cluster.shutdown()
        if a.before:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", codes["before"]], check=False)
        shutil.rmtree(work, ignore_errors=True)

    for row in failures:
        print(row, flush=True)
    shard_mib = 12 * params / 2 / 2**20
    header = (
        "# Memory snapshots: overhead while training, and recovery after a failure\n\n"
        f"`python benchmarks/recovery.py --rounds {a.rounds} --overhead-steps {a.overhead_steps} "
        f"--main-job-steps {a.main_job_steps} "
        f"--settings {a.settings}{' --paired' if a.paired else ''}"
        f"{f' --models {chr(34)}{a.models}{chr(34)}' if set(chosen) != {'gpt2', 'main job'} else ''}"
        f"{' --before ' + a.before if a.before else ''}`. Local "
        f"multi-node Ray cluster on a 2-core CPU machine (one worker per node), 2 workers, ZeRO-2, AdamW, "
        f"GPT-2 {a.n_layer}x{a.n_embd}, vocab {a.vocab} ({params / 1e6:.1f}M params; a rank's shard of fp32 "
        f"masters and AdamW state is {shard_mib:.0f} MiB), batch 4 x 64 tokens per worker, dropout off. "
        f"Without snapshots a step takes {_off_ms(raw, f'gpt2 {a.n_layer}x{a.n_embd}')} (mean "
        f"over the measured steps); the main job's model (`ray_jobs/finetune.py`: a tiny GPT-2, a 0.7 MiB shard "
        f"per rank), {_off_ms(raw, 'main job')}. code: `today` is this checkout"
        f"{f', `before` is commit {a.before}' if a.before else ''}.\n\n"
        "## Step-time overhead against no snapshots (same round's run without them)\n\n"
        "stopped_ms_per_snapshot: how long the step loop stood still per snapshot (the copy into a host "
        "buffer, and agreeing on the next interval); the rest of the overhead is the background work "
        "(checksums, writing the piece, the holders' copies and calls) competing with training for this "
        "machine's 2 cores, which both train. ms_per_snapshot: at `snapshot_every=1`, the step time minus "
        "the step time without snapshots: what one snapshot costs training.\n"
    )
    failure_table = markdown_table(failures, list(failures[0])) if failures else "(not measured: --no-failures)\n"
    footer = (
        f"\n## A failure after step {FAIL_AT}, storage checkpoints every {SAVE_STEPS} steps\n\n{failure_table}"
        "\nfailure_to_first_new_step_s: from the kill to the end of the first step of the restarted group "
        "(Ray's restart, new processes, imports, model build, state loading, one step). state_loading_s: "
        "from `resume_checkpoint()`'s start to the Trainer's `on_train_begin` (fetching and writing the "
        "snapshot, then loading it; for local storage only the loading).\n"
    )
    columns = ["model", "code", "snapshot_every", "measured", "overhead_pct", "min_pct", "max_pct", "ms_per_step",
               "ms_per_snapshot", "snapshots", "stopped_ms_per_snapshot"]  # fmt: skip
    data = {"overhead": overhead, "failures": failures, **raw}
    print(write_results(a.out, overhead, columns, header, footer, data=data))
    bar_plot(
        RESULTS / f"{a.out}.png",
        [f"{r['model']}, {r['code']}: every {r['snapshot_every']}" for r in overhead],
        [r["overhead_pct"] for r in overhead],
        spans=[(r["min_pct"], r["max_pct"]) for r in overhead],
        xlabel="step-time overhead vs no snapshots (%)",
        title="memory snapshots, W=2",
        ref=0.0,
    )


def _off_ms(raw: dict, model: str) -> str:
    ms = raw["off_ms_per_step"].get(model)
    return "(not measured)" if ms is None else f"{ms:.0f} ms"


if __name__ == "__main__":
    main()
