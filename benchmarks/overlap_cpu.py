"""The CPU step with the all-gather left in flight (overlap on), waited in the step (off), against
fused DDP, and against the code of another commit: W=2, gloo, 1 thread per rank.

    python benchmarks/overlap_cpu.py --before 9ec81e8      # ~15 min; results/overlap_cpu.{md,json,png}
    python benchmarks/overlap_cpu.py --pairs 1 --rounds 4  # a quick look

Two models: GPT-2 4x256 (5.6M params, one 22 MB bucket: bandwidth) and 300 tiny tensors
(latency). One run interleaves its setups, A B C A B C ..., in rounds of a few steps; a setup's turn
starts with one untimed step, so a timed block pays exactly one gather per step whether the gathers
land in the step (off) or in the next forward (on) ([Note: steady-state blocks] in
``gpu_overlap.py``). The machine's load drifts from run to run by more than the change measured, so
runs come in pairs, the code of ``--before`` (a git commit, checked out beside this one and imported
first) and today's back to back, ``--pairs`` times; each run's ratios to its own fused DDP are
reported as medians over the pairs with their ranges. ``max_param_diff``: overlap on against off
after all the steps of a run (0: the same bits).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, WARMUP, PAIRS = 8, 2, 3
MODELS = {"gpt2_4x256": 3, "many_small_300": 30}  # steps per round


def _one_run(code: str, variants: list[str], rounds: int) -> dict:
    """In a fresh process: the library from ``code`` (imported first), these benchmarks from today."""
    sys.path[:0] = [code, str(ROOT)]
    from benchmarks.common import collect

    return collect(_body, 2, variants=variants, rounds=rounds)


VARIANTS = {  # name: (Setup kind, ZeroConfig fields)
    "ddp_fused": ("ddp_fused", None),
    "zero2": ("zero2", {"overlap_allgather": True}),  # overlap on: the Trainer's and the Ray job's default
    "zero2_overlap_off": ("zero2", {"overlap_allgather": False}),
}


def _body(rank: int, world_size: int, out: str, variants: list[str], rounds: int) -> None:
    import torch

    from benchmarks.common import ManySmall, Setup, gpt2, interleaved_ms_per_step, max_param_diff
    from benchmarks.step_time import loss_fn

    builds = {"gpt2_4x256": lambda: gpt2(4, 256, dropout=0.0), "many_small_300": lambda: ManySmall(150)}
    torch.set_num_threads(1)
    result = {}
    for model, steps in MODELS.items():
        loss_of = loss_fn("gpt2" if model.startswith("gpt2") else model, rank)
        setups = {
            name: Setup(VARIANTS[name][0], builds[model](), 1, zero_config=VARIANTS[name][1]) for name in variants
        }
        runs = {name: functools.partial(setup.step, loss_of) for name, setup in setups.items()}
        times = interleaved_ms_per_step(runs, rounds, steps, WARMUP, before=lambda name, runs=runs: runs[name]())
        rows = {}
        for name in variants:
            per_round = [t / b for t, b in zip(times[name], times["ddp_fused"])]
            rows[name] = {"ms_per_step": statistics.median(times[name]), "vs_ddp_fused": statistics.median(per_round)}
        if "zero2_overlap_off" in setups:
            for setup in setups.values():
                if setup.name == "zero2":
                    setup.opt.wait_for_params()
            rows["zero2"]["max_param_diff"] = max_param_diff(setups["zero2"], setups["zero2_overlap_off"])
        result[model] = rows
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="also run the code of this git commit, paired with today's")
    p.add_argument("--pairs", type=int, default=PAIRS, help=f"runs of each code (default {PAIRS})")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per model and run (default {ROUNDS})")
    p.add_argument("--one-run", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one_run:
        spec = json.loads(a.one_run)
        print(json.dumps(_one_run(spec["code"], spec["variants"], spec["rounds"])))
        return
    codes = {"today": (str(ROOT), list(VARIANTS))}
    work = Path(tempfile.mkdtemp(prefix="hf_lowzero_overlap_cpu_"))
    if a.before:
        before = str(work / "before")
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", before, a.before], check=True)
        # Its library, today's benchmarks: without this folder ``benchmarks`` resolves to today's.
        shutil.rmtree(Path(before) / "benchmarks")
        codes = {"before": (before, ["ddp_fused", "zero2"]), **codes}
    from hf_lowzero.process_guard import run_tied  # here: a --one-run child imports the library it measures

    runs: dict[str, list[dict]] = {name: [] for name in codes}
    try:
        for pair in range(a.pairs):
            for name, (code, variants) in codes.items():
                spec = json.dumps({"code": code, "variants": variants, "rounds": a.rounds})
                done = run_tied([sys.executable, __file__, "--one-run", spec], capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"the run of {name} ({code}) failed:\n{done.stderr[-4000:]}")
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"pair {pair + 1}/{a.pairs}, {name}: {runs[name][-1]}", flush=True)
    finally:
        if a.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", before], check=False)
    report(runs, a)


def report(runs: dict[str, list[dict]], a) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import RESULTS, bar_plot, write_results

    rows = []
    for code, results in runs.items():
        for model in MODELS:
            for setup in results[0][model]:
                ratios = [r[model][setup]["vs_ddp_fused"] for r in results]
                ms = [r[model][setup]["ms_per_step"] for r in results]
                row = {"code": code, "model": model, "setup": setup, "ms_per_step": statistics.median(ms)}
                row |= {f"vs_ddp_fused_{k}": v for k, v in _spread(ratios).items()}
                diffs = [r[model][setup].get("max_param_diff") for r in results]
                row["max_param_diff"] = max(diffs) if None not in diffs else "-"
                rows.append(row)
    today = runs["today"]
    helps = {
        model: _spread([r[model]["zero2"]["ms_per_step"] / r[model]["zero2_overlap_off"]["ms_per_step"] for r in today])
        for model in MODELS
    }
    header = (
        "# The all-gather overlapped on CPU/gloo, and the step against fused DDP before and after\n\n"
        f"`python benchmarks/overlap_cpu.py{' --before ' + a.before if a.before else ''} --pairs {a.pairs} "
        f"--rounds {a.rounds}`: W=2, gloo, 1 thread per rank, AdamW, fp32, stage 2; each run interleaves its "
        f"setups in {a.rounds} rounds ({', '.join(f'{s} steps of {m}' for m, s in MODELS.items())}), each turn "
        "after one untimed step; vs_ddp_fused = the run's median per-round ratio to fused DDP, then the median "
        f"(min, max) over {a.pairs} runs of each code, run in pairs"
        + (f"; `before` is commit {a.before}" if a.before else "")
        + ". zero2 has overlap on (the Trainer's and the Ray job's default; the optimizer API's is off); "
        "zero2_overlap_off waits for the gathers in the step; "
        "max_param_diff: overlap on against off after every step of a run."
    )
    footer = (
        "\n\nOverlap on against off (today's runs, step time ratio, median (min, max) over runs):\n\n"
        + "\n".join(f"- {model}: {h['median']:.3f} ({h['min']:.3f}, {h['max']:.3f})" for model, h in helps.items())
        + "\n"
    )
    columns = ["code", "model", "setup", "ms_per_step", "vs_ddp_fused_median", "vs_ddp_fused_min", "vs_ddp_fused_max"]
    data = {"rows": rows, "overlap_on_over_off": helps, "runs": runs}
    print(write_results("overlap_cpu", rows, columns + ["max_param_diff"], header, footer, data=data))
    bar_plot(
        RESULTS / "overlap_cpu.png",
        [f"{r['code']} {r['model']} {r['setup']}" for r in rows],
        [r["vs_ddp_fused_median"] for r in rows],
        [(r["vs_ddp_fused_min"], r["vs_ddp_fused_max"]) for r in rows],
        xlabel="step time / fused DDP, median over runs (lower is faster)",
        title="World size 2, CPU/gloo: the all-gather overlapped, before and after",
    )


if __name__ == "__main__":
    main()
