"""Where a memory snapshot's time goes: a training step with a snapshot in it, piece by piece.

    python benchmarks/profile_snapshot.py            # ~25 min on a 2-core CPU machine (--rounds 1: ~12)

The cluster of ``benchmarks/recovery.py`` (a local multi-node Ray cluster: a head node and two
worker nodes of one worker slot each, so each rank has a node of its own and its buddy is the
other node), plus a "one node" layout where both workers share the head node, as in the main job
on a laptop: there is no buddy copy. Two models: the main job's (a tiny GPT-2, a 0.7 MiB shard per
rank) and the GPT-2 benchmark model (4x256, a 30 MiB shard). Each runs ``--steps`` steps without
snapshots and then with ``snapshot_every=1``, in turn, for ``--rounds`` rounds.

Per snapshot (rank 0's median over the measured snapshots, from ``MemorySnapshots.timings``):
- stopped: the step loop stands still (the copy into a host buffer, the Trainer state);
- write: the background thread checksums the copy and writes it into a file in the node's memory;
- send: the own node's holder sends the file to the buddy node's holder, which lands and checks it;
- mark: the holders mark the step (batched);
- chain: the whole background chain, the Ray call included (chain - write - send - mark is the
  call's own overhead);
- per snapshot: the step time at ``snapshot_every=1`` minus the step time without snapshots, what
  a snapshot costs training (the background work competes with training for the 2 cores).

Writes results/profile_snapshot.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import ray  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.common import gpt2, markdown_table, write_results  # noqa: E402
from benchmarks.recovery import WARMUP, StepClock, fit, read_log, step_ms, use_code  # noqa: E402
from hf_lowzero.ray.snapshots import snapshot_takers  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig  # noqa: E402
from hf_lowzero.snapshot.priority import ENV  # noqa: E402

PARTS = ["stopped_s", "write_s", "send_s", "mark_s", "chain_s"]
CPU_GROUPS = ["workers", "holders", "raylets", "gcs", "rest"]


class Timings(TrainerCallback):
    """Rank 0 writes its snapshots' timings (``MemorySnapshots.timings``) to ``path`` at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, args, state, control, **kwargs):
        takers = snapshot_takers()
        if takers and dist.get_rank() == 0:
            takers[0].close()  # every snapshot landed and was accounted
            self.path.write_text(json.dumps(list(takers[0].timings)))


GROUPS = {"ray::RayTrainWorker": "workers", "ray::SnapshotHolder": "holders"}


def _cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process of this machine: (its group, CPU seconds so far)."""
    out = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times, cmd = proc.info["cpu_times"], proc.info["cmdline"] or [proc.info["name"] or ""]
        if times is None:
            continue
        title = cmd[0].split()[0] if cmd and cmd[0] else ""  # ray::SnapshotHolder.land while it runs land
        group = next((g for prefix, g in GROUPS.items() if title.startswith(prefix)), None)
        if group is None:
            group = "raylets" if title.endswith("/raylet") else "gcs" if title.endswith("/gcs_server") else "rest"
        out[proc.info["pid"]] = (group, times.user + times.system)
    return out


class CpuClock(TrainerCallback):
    """Rank 0: CPU seconds per step of each group of processes (training workers, snapshot holders,
    raylets, the GCS, the rest) from the end of step ``start`` to the end of the last step (the
    holders end with training), into ``path``."""

    def __init__(self, path: Path, start: int = WARMUP) -> None:
        self.path, self.start = path, start

    def on_step_end(self, args, state, control, **kwargs):
        if dist.get_rank() != 0:
            return
        if state.global_step == self.start:
            self._begin, self._begin_step = _cpu_by_process(), state.global_step
        elif state.global_step == state.max_steps and hasattr(self, "_begin"):
            for taker in snapshot_takers():
                taker.wait()  # the last snapshots' background work counts too
            groups: dict[str, float] = {}
            for pid, (group, cpu) in _cpu_by_process().items():
                groups[group] = groups.get(group, 0.0) + cpu - self._begin.get(pid, (group, 0.0))[1]
            steps = state.global_step - self._begin_step
            self.path.write_text(json.dumps({g: 1e3 * cpu / steps for g, cpu in groups.items()}))


def measure(name: str, fields: dict, work: Path) -> dict:
    log, timings, cpu = work / f"{name}.jsonl", work / f"{name}.timings.json", work / f"{name}.cpu.json"
    result = fit(RayFinetuneConfig(**fields, name=name), [StepClock(log), CpuClock(cpu), Timings(timings)])
    if result.error:
        raise RuntimeError(f"{name} failed: {result.error}")
    out = {"ms_per_step": step_ms(read_log(log))}
    out.update({f"cpu_{g}_ms": v for g, v in json.loads(cpu.read_text()).items()})
    if timings.exists():
        measured = json.loads(timings.read_text())[3:]  # the first snapshots pay one-time costs
        out.update({part: 1e3 * statistics.median(t[part] for t in measured) for part in PARTS})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--models", default="main job,gpt2 4x256", help="comma-separated: main job, gpt2 4x256")
    p.add_argument("--layouts", default="two nodes,one node", help="comma-separated: two nodes, one node")
    p.add_argument("--out", default="profile_snapshot", help="results/OUT.{md,json}")
    a = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="hf_lowzero_profile_snapshot_"))
    big = gpt2(4, 256, vocab=8192, dropout=0.0)
    big.save_pretrained(work / "gpt2")
    del big
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, "resources": {"one_node": 2}}
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"worker_slot": 1})
    layouts = {"two nodes": '{"worker_slot": 1}', "one node": '{"one_node": 1}'}
    gpt2_fields = {"model_name_or_path": str(work / "gpt2"), "per_device_train_batch_size": 4}
    models = {"main job": {}, "gpt2 4x256": gpt2_fields}
    layouts = {k: v for k, v in layouts.items() if k in a.layouts.split(",")}
    models = {k: v for k, v in models.items() if k in a.models.split(",")}
    runs = []
    try:
        use_code(cluster, str(Path(__file__).resolve().parents[1]))
        for r in range(a.rounds):
            for model, extra in models.items():
                for layout, resources in layouts.items():
                    for every in (None, 1):
                        name = f"r{r}_{model}_{layout}_{every or 'off'}".replace(" ", "_")
                        fields = dict(extra, num_workers=2, storage_path=str(work / "storage"),
                                      resources_per_worker=resources, num_to_keep=1, max_failures=0,
                                      snapshot_every=every, max_steps=a.steps, save_steps=a.steps)  # fmt: skip
                        runs.append({"round": r, "model": model, "layout": layout, "every": every,
                                     **measure(name, fields, work)})  # fmt: skip
                        print(runs[-1], flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    rows = []
    for model in models:
        for layout in layouts:
            mine = [x for x in runs if x["model"] == model and x["layout"] == layout]
            off = {x["round"]: x["ms_per_step"] for x in mine if x["every"] is None}
            on = [x for x in mine if x["every"] == 1]
            row = {
                "model": model,
                "layout": layout,
                "ms_per_step_off": statistics.median(off.values()),
                "ms_per_snapshot": statistics.median(x["ms_per_step"] - off[x["round"]] for x in on),
            }
            for part in PARTS:
                row[part.replace("_s", "_ms")] = statistics.median(x[part] for x in on)
            row["call_ms"] = row["chain_ms"] - row["write_ms"] - row["send_ms"] - row["mark_ms"]
            for group in CPU_GROUPS:
                key = f"cpu_{group}_ms"
                row[key] = statistics.median(x.get(key, 0.0) for x in on) - statistics.median(
                    x.get(key, 0.0) for x in mine if x["every"] is None
                )
            rows.append(row)
    header = (
        "# Where a memory snapshot's time goes\n\n"
        f"`{' '.join(['python', 'benchmarks/profile_snapshot.py', *sys.argv[1:]])}`"
        f"{f' with HF_LOWZERO_SNAPSHOT_NICE={os.environ[ENV]}' if os.environ.get(ENV) else ''}: local multi-node Ray "
        "cluster on a 2-core CPU machine, 2 workers, ZeRO-2, AdamW, gloo, `snapshot_every=1` against no "
        "snapshots (same round). `two nodes`: one worker per node, the buddy copy goes to the other node; "
        "`one node`: both workers on one node, no buddy copy. Median over rounds of rank 0's median snapshot.\n\n"
        "ms_per_snapshot: step time with a snapshot every step minus without, what one costs training. "
        "stopped: the loop stands still (copy into a host buffer, Trainer state). In the background: write "
        "(checksums and the file in node memory), send (the holder's copy to the buddy node's holder), mark "
        "(the marks on every holder), call (the rest of the one Ray call), chain (all of it).\n\n"
        "cpu_*_ms: CPU time per step with a snapshot every step minus without, summed over the machine's "
        "processes of each kind: the two training workers (the loop's copy and the background thread), "
        "the snapshot holders, the raylets, the GCS, and the rest (Ray's other actors and agents). On "
        "this machine the 2 cores are both training, so CPU time spent elsewhere is taken from training.\n"
    )
    columns = ["model", "layout", "ms_per_step_off", "ms_per_snapshot", "stopped_ms", "write_ms", "send_ms",
               "mark_ms", "call_ms", "chain_ms", *[f"cpu_{g}_ms" for g in CPU_GROUPS]]  # fmt: skip
    print(markdown_table(rows, columns))
    print(write_results(a.out, rows, columns, header, "", data={"runs": runs}))


if __name__ == "__main__":
    main()
