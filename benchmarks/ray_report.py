"""Time training spends blocked reporting checkpoints to Ray: synchronous vs asynchronous upload.

    python benchmarks/ray_report.py                  # ~7 min on a 2-core CPU machine
    python benchmarks/ray_report.py --rounds 1 --n-layer 4 --n-embd 256 --vocab 8192   # ~1 min, small

A 2-worker Ray Train fine-tune (gloo, ZeRO-2, ``hf_lowzero.recipes.clm_ray.run_finetune``) of a GPT-2 small
sized model (12 layers, width 768, 50257-token vocabulary: 124M parameters, random init from the
config) saves and reports a checkpoint every ``--save-steps`` steps: 0.5 GB of weights and 1.5 GB of
fp32 optimizer shards. The runs differ only in ``checkpoint_upload``: ``sync`` (``report()`` returns
once this rank's files are in storage) or ``async`` (it returns once the ranks agreed on the folder
name; a background thread uploads). Each run measures ``checkpoint_wait_s``: the seconds rank 0's
training spent staging its files and inside ``ray.train.report``, over all its checkpoints (rank 0
uploads the most: the weights and its shard; ``Result.return_value``). Runs alternate sync, async,
sync, async in one invocation; the ratio is sync / async wait per round (median). Storage is a local
directory, so an upload is a local copy: to S3 or a network filesystem uploads take longer and
asynchronous upload saves more.

Writes results/ray_report.md and results/ray_report.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from benchmarks.common import gpt2, write_results  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig, run_finetune  # noqa: E402


def one_run(mode: str, name: str, a, model_dir: Path, storage: Path) -> dict:
    config = RayFinetuneConfig(
        num_workers=2,
        max_steps=a.max_steps,
        save_steps=a.save_steps,
        per_device_train_batch_size=1,
        model_name_or_path=str(model_dir),
        storage_path=str(storage),
        name=name,
        checkpoint_upload=mode,
        num_to_keep=1,
        max_failures=0,
    )
    start = time.perf_counter()
    result = run_finetune(config)
    wall = time.perf_counter() - start
    if result.error:
        raise RuntimeError(f"{name} failed: {result.error}")
    ckpt_bytes = sum(p.stat().st_size for p in Path(result.checkpoint.path).rglob("*") if p.is_file())
    waits = result.return_value  # rank 0's, from train_loop_per_worker
    reports = waits["checkpoints_reported"]
    shutil.rmtree(storage / name)  # 2 GB per checkpoint
    return {
        "mode": mode,
        "run": name,
        "checkpoints": reports,
        "checkpoint_GB": ckpt_bytes / 1e9,
        "wait_per_checkpoint_s": waits["checkpoint_wait_s"] / reports,
        "fit_wall_s": wall,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="sync/async pairs")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    a = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="hf_lowzero_ray_report_"))
    model_dir = work / "model"
    model = gpt2(a.n_layer, a.n_embd, vocab=a.vocab)
    params = sum(t.numel() for t in model.parameters())
    model.save_pretrained(model_dir)
    del model
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for r in range(a.rounds):
            for mode in ("sync", "async"):
                rows.append(one_run(mode, f"{mode}_{r}", a, model_dir, work / "storage"))
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    waits = {mode: [row["wait_per_checkpoint_s"] for row in rows if row["mode"] == mode] for mode in ("sync", "async")}
    ratios = [s / w for s, w in zip(waits["sync"], waits["async"])]
    ratio = statistics.median(ratios)
    header = (
        "# Time blocked reporting checkpoints to Ray: sync vs async upload\n\n"
        f"`python benchmarks/ray_report.py`. 2 Ray Train workers (gloo, ZeRO-2) on a 2-core CPU machine, "
        f"GPT-2 {a.n_layer}x{a.n_embd}, vocab {a.vocab} ({params / 1e6:.0f}M params), batch 1 x 64 tokens "
        f"per worker, {a.max_steps} steps, a checkpoint every {a.save_steps}; local storage (an upload is a "
        "copy). wait = seconds rank 0's training spent staging + in `ray.train.report`, per checkpoint. "
        f"Runs alternate sync/async, {a.rounds} rounds. fit_wall_s is the whole `fit` (worker startup "
        "included), for reference only: on a small shared machine it varies more than the wait does.\n\n"
        f"**sync / async wait per checkpoint: {ratio:.1f}x** (median of rounds; per round: "
        f"{', '.join(f'{x:.1f}' for x in ratios)})"
    )
    columns = ["mode", "run", "checkpoints", "checkpoint_GB", "wait_per_checkpoint_s", "fit_wall_s"]
    print(write_results("ray_report", rows, columns, header))
    print(f"sync / async time blocked in report per checkpoint: {ratio:.1f}x")


if __name__ == "__main__":
    main()
