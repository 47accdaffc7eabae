"""Where a training step's time goes: DDP vs ZeRO stage 1/2, world size 2 on CPU (gloo).

    python benchmarks/profile_step.py          # ~2 min; results/profile_step.{md,json}

Each setup runs WARMUP steps, then PROFILED steps under ``torch.profiler`` (CPU). Reported per
step, on rank 0: the wall time of forward, backward (with the bucket hooks and the flush) and the
optimizer step (for DDP: ``opt.step()``, its all-reduce runs inside backward), then the CPU time
of hf_lowzero's labelled phases (``record_function("hf_lowzero::...")``: packing gradients into
buckets, waiting for the reduce-scatter, the gradient norm, the inner optimizer, the all-gather
back into the params and its unpacking), and of the aten kernels that carry them. A phase's CPU
time includes the kernels it runs; waits include time the other rank needs to catch up.

A second table times 4-way accumulation without the profiler, fused DDP against ours, setups
interleaved over ACCUM_ROUNDS steps: the median wall time of each micro-batch's forward and
backward and of the optimizer step. DDP and stage 1 run the first three backwards under
``no_sync``; stage 2 reduce-scatters after each, so its extra time per micro-batch is that
reduction's price.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.common import RESULTS, Setup, collect, gpt2, markdown_table, write_results  # noqa: E402
from benchmarks.step_time import loss_fn  # noqa: E402

WARMUP, PROFILED = 3, 6
SETUPS = ["ddp", "zero1", "zero2"]
ACCUM_SETUPS, MICRO, ACCUM_ROUNDS = ["ddp_fused", "zero1", "zero2"], 4, 8
KERNELS = ["aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::_fused_adamw_", "aten::_foreach_norm"]
KERNELS += ["aten::sum", "aten::div_", "aten::mul_", "aten::copy_"]


def timed_step(setup: Setup, x: torch.Tensor) -> tuple[float, float, float]:
    """One step; wall ms of forward, backward and optimizer step (with zero_grad)."""
    t0 = time.perf_counter()
    loss = setup.module(input_ids=x, labels=x).loss
    t1 = time.perf_counter()
    setup.backward(loss)
    t2 = time.perf_counter()
    setup.opt.step()
    setup.opt.zero_grad()
    t3 = time.perf_counter()
    return 1000 * (t1 - t0), 1000 * (t2 - t1), 1000 * (t3 - t2)


def body(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(PROFILED + WARMUP)]
    rows = []
    for name in SETUPS:
        setup = Setup(name, gpt2(4, 256), micro=1)
        for x in xs[:WARMUP]:
            timed_step(setup, x)
        torch.distributed.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            times = [timed_step(setup, x) for x in xs[WARMUP:]]
        cpu_ms = {e.key: e.cpu_time_total / 1000 / PROFILED for e in prof.key_averages()}
        row = {"setup": name}
        for i, phase in enumerate(("forward", "backward", "step")):
            row[f"{phase}_ms"] = statistics.median(t[i] for t in times)
        row["total_ms"] = row["forward_ms"] + row["backward_ms"] + row["step_ms"]
        row["phases"] = {k: v for k, v in cpu_ms.items() if k.startswith("hf_lowzero::")}
        row["kernels"] = {k: cpu_ms.get(k, 0.0) for k in KERNELS}
        row["buckets"] = len(setup.opt.buckets) if name != "ddp" else ""
        rows.append(row)
        del setup
    accumulation = accumulation_phases(rank)
    if rank == 0:
        Path(out).write_text(json.dumps({"steps": rows, "accumulation": accumulation}))


def accumulation_phases(rank: int) -> list[dict]:
    """Median wall ms of each micro-batch's forward and backward and of the step, 4-way accumulation."""
    loss_of = loss_fn("gpt2_accum4", rank)
    setups = [Setup(name, gpt2(4, 256, dropout=0.0), micro=MICRO) for name in ACCUM_SETUPS]
    times = {setup.name: [] for setup in setups}
    for round_ in range(WARMUP + ACCUM_ROUNDS):
        for setup in setups:
            torch.distributed.barrier()
            phases = []
            setup.step(loss_of, phases)
            if round_ >= WARMUP:
                times[setup.name].append(phases)
    names = [f"{kind}{i}_ms" for i in range(MICRO) for kind in ("forward", "backward")] + ["step_ms"]
    rows = []
    for setup in setups:
        medians = [1000 * statistics.median(column) for column in zip(*times[setup.name])]
        rows.append({"setup": setup.name, **dict(zip(names, medians)), "total_ms": sum(medians)})
    return rows


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    result = collect(body, 2)
    rows, accumulation = result["steps"], result["accumulation"]
    labels = sorted({k for r in rows for k in r["phases"]})
    flat = []
    for r in rows:
        entry = {k: r[k] for k in ("setup", "forward_ms", "backward_ms", "step_ms", "total_ms", "buckets")}
        entry.update({k.removeprefix("hf_lowzero::"): r["phases"].get(k, "") for k in labels})
        entry.update({k.removeprefix("aten::"): r["kernels"][k] for k in KERNELS})
        flat.append(entry)
    columns = list(flat[0])
    header = (
        "# Where the time of one step goes, GPT-2 4x256, world size 2, CPU/gloo, 1 thread per rank\n\n"
        f"`python benchmarks/profile_step.py`: median wall ms per step of forward/backward/step over {PROFILED} "
        "profiled steps; the other columns are CPU ms per step (torch.profiler) of hf_lowzero's labelled "
        "phases and of the aten kernels that carry them (all ops of that name, also the model's own)."
    )
    columns_accum = list(accumulation[0])
    footer = (
        f"\n\nGPT-2 4x256 with {MICRO}-way accumulation, no profiler, setups interleaved: median wall ms over "
        f"{ACCUM_ROUNDS} steps of each micro-batch's forward and backward and of the optimizer step (with "
        "zero_grad). DDP and stage 1 run the first backwards under no_sync; stage 2 reduce-scatters after every "
        "one (its backward includes that reduction).\n\n" + markdown_table(accumulation, columns_accum)
    )
    print(write_results("profile_step", flat, columns, header, footer, {"steps": flat, "accumulation": accumulation}))


if __name__ == "__main__":
    main()
