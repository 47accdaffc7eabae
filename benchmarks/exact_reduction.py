"""What exact reduction costs: step time and bytes sent against "ddp", and the time spent converting.

    python benchmarks/exact_reduction.py               # ~5 min; results/exact_reduction.{md,json,png}
    python benchmarks/exact_reduction.py --rounds 4    # fewer rounds, wider spreads

W=2 on CPU (gloo, one thread per rank), GPT-2 4x256 (5.6M params, fp32, AdamW), ZeRO stage 2, two
micro-batches per step. Three setups live in one process group, each with its own model and optimizer,
timed in turns (A B C A B C ...) over ROUNDS rounds of STEPS steps, so that a drifting machine affects
them alike:
- "ddp": today's default (on CPU the fused AdamW kernel);
- "ddp, foreach AdamW": the same with the kernel exact mode steps row shards with on the CPU
  (``zero/exact/kernels.py``), to tell the reduction's cost from the kernel's;
- "exact": ``reduction="exact"``.
Reported per setup: the median step time and its ratio to "ddp" per round (median, min, max), the same
of rank 0's CPU time (on a shared machine the wall time swings with the other jobs; the CPU time is
what the step itself computes, waits excluded); the bytes one rank sends per step (``comm_stats``,
ring formula); and, from a profiled run of a few more steps, the host time per step inside exact
mode's own work: rounding to the grid as buckets are packed (``quantize``), the maxima and their
all-reduce (``maxima``), the conversion back and the norm's squares (``convert``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, interleaved_ms_per_step, ratio_plot, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.zero.runtime.comm import comm_stats  # noqa: E402

ROUNDS, STEPS, WARMUP, MICRO, PROFILED = 16, 3, 3, 2, 4
SETUPS = {"ddp": ("ddp", None), "ddp, foreach AdamW": ("ddp", False), "exact": ("exact", None)}
PHASES = {
    "quantize": "hf_lowzero::quantize",
    "maxima": "hf_lowzero::exact_maxima",
    "convert": "hf_lowzero::exact_convert",
}


def body(rank: int, world_size: int, out: str, rounds: int) -> None:
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(2 * MICRO)]
    runs, cpu = {}, {name: [] for name in SETUPS}  # cpu: this rank's CPU seconds per turn
    for name, (reduction, fused) in SETUPS.items():
        model = gpt2(4, 256, dropout=0.0)
        inner = torch.optim.AdamW(model.parameters(), **({} if fused is None else {"fused": fused}))
        opt = LowLevelZeroOptimizer(model, inner, stage=2, reduction=reduction)
        counter = iter(range(10**9))

        def run(model=model, opt=opt, counter=counter, divide=reduction == "ddp", turns=cpu[name]) -> None:
            start = time.process_time()
            for _ in range(MICRO):  # exact mode: each micro-batch's own loss; ddp: divided by their number
                x = xs[next(counter) % len(xs)]
                loss = model(input_ids=x, labels=x).loss
                opt.backward(loss / MICRO if divide else loss)
            opt.step()
            opt.zero_grad()
            if turns:
                turns[-1] += time.process_time() - start

        runs[name] = run
    times = interleaved_ms_per_step(runs, rounds, STEPS, WARMUP, before=lambda name: cpu[name].append(0.0))
    cpu_ms = {name: [1000 * t / STEPS for t in turns[1:]] for name, turns in cpu.items()}  # [0]: the warmup
    rows = []
    for name, run in runs.items():
        comm_stats.reset()
        run()
        sent = sum(comm_stats.sent_bytes.values())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED):
                run()
        spent = {e.key: e.cpu_time_total / 1000 / PROFILED for e in prof.key_averages()}
        ratios = [t / base for t, base in zip(times[name], times["ddp"])]
        cpu_ratios = [t / base for t, base in zip(cpu_ms[name], cpu_ms["ddp"])]
        rows.append(
            {
                "setup": name,
                "ms_per_step": statistics.median(times[name]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "cpu_ms_per_step": statistics.median(cpu_ms[name]),
                "cpu_ratio_median": statistics.median(cpu_ratios),
                "MB_sent_per_step": sent / 2**20,
                **{f"ms_{phase}": spent.get(label, 0.0) for phase, label in PHASES.items()},
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    rows = collect(body, 2, rounds=parser.parse_args().rounds)
    base = rows[0]["MB_sent_per_step"]
    for row in rows:
        row["bytes_vs_ddp"] = row["MB_sent_per_step"] / base
    header = (
        "# Exact reduction: step time, bytes sent, conversion\n\n`python benchmarks/exact_reduction.py`: W=2, gloo, "
        f"1 thread per rank, GPT-2 4x256 fp32, AdamW, ZeRO stage 2, {MICRO} micro-batches per step; {ROUNDS} "
        f"interleaved rounds of {STEPS} steps; ratio = setup / ddp per round (median, min, max) of the wall time, "
        "`cpu_ratio_median` of rank 0's CPU time (what the step computes, whatever else the machine runs). "
        "`MB_sent_per_step`: "
        "what one rank sends in a step (ring formula); `ms_quantize`, `ms_maxima`, `ms_convert`: host time per step "
        f"in exact mode's own work, from {PROFILED} profiled steps (the maxima include their all-reduce and the "
        "wait for it)."
    )
    print(write_results("exact_reduction", rows, list(rows[0]), header))
    ratio_plot(
        RESULTS / "exact_reduction.png",
        rows,
        "step time / ddp (median, min-max over rounds)",
        "exact reduction, GPT-2 4x256, W=2, CPU",
    )


if __name__ == "__main__":
    main()
