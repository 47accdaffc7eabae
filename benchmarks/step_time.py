"""Step time of ZeRO stage 1/2 against DDP, DeepSpeed, FSDP2 and ZeroRedundancyOptimizer, W=2 on CPU.

    python benchmarks/step_time.py              # ~8 min; results/step_time.{md,json,png}
    python benchmarks/step_time.py --rounds 5   # fewer rounds, wider spreads
    python benchmarks/step_time.py --models many_small_300 --setups ddp,ddp_fused,zero1,zero2

All setups of one model live in the same process group and are timed in turns, A B C A B C ...,
ROUNDS rounds of a few optimizer steps each (per model, ~0.3-0.5 s a round; after warm-up), so that a
machine that drifts or hiccups affects every setup alike. Reported: the median step time over rounds, and the ratios to
both DDP baselines of the same model computed per round (median, min, max).

Setups (``benchmarks.common.Setup``): ``ddp`` is DDP with ``torch.optim.AdamW(model.parameters())``
as a user writes it (torch's default kernel on CPU: the for-loop); ``ddp_fused`` gives DDP the
fused AdamW kernel that ZeRO picks for its host rows, to separate the kernel choice from the
sharding; ``zero_redundancy`` (torch's ZeroRedundancyOptimizer under DDP), ``fsdp2``
(``fully_shard``), ``deepspeed1``/``deepspeed2`` (DeepSpeed ZeRO-1/2 engine, torch AdamW as client
optimizer; skipped with a printed line when DeepSpeed is not installed) and ``zero1``/``zero2``
(ours). All train the same fp32 model (dropout off) on the same per-rank data with the same AdamW
hyperparameters; ``max_param_diff`` is the largest absolute difference of any param from DDP's
after all the timed steps, so each row shows it trained the same thing. Models: GPT-2 4x256 (5.6M
params, 52 tensors), 150 tiny Linear layers (300 tensors) and 1000 of them (2000 tensors), which
expose per-parameter overhead. ``ms_our_python`` is the self time of hf_lowzero's own Python
functions per step (cProfile over extra steps, outside the timed rounds and after the parity check);
the last lines compare it between the two tiny-layer models (host work per bucket, not per tensor,
keeps it nearly flat: [Note: one hook per bucket]).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    RESULTS,
    SETUPS,
    ManySmall,
    Setup,
    bar_plot,
    collect,
    deepspeed_config,
    deepspeed_missing,
    gpt2,
    interleaved_ms_per_step,
    max_param_diff,
    write_results,
)

ROUNDS, WARMUP, PROFILED = 15, 2, 3
PACKAGE = str(Path(__file__).resolve().parents[1] / "hf_lowzero")
TOP_FUNCTIONS = 4
MODELS = {  # name: (build, micro-batches per step, steps per round: ~0.3-0.5 s per round)
    "gpt2": (lambda: gpt2(4, 256, dropout=0.0), 1, 3),
    "gpt2_accum4": (lambda: gpt2(4, 256, dropout=0.0), 4, 1),
    "many_small_300": (lambda: ManySmall(150), 1, 30),
    "many_small_2000": (lambda: ManySmall(1000), 1, 6),
}


def loss_fn(kind: str, rank: int):
    g = torch.Generator().manual_seed(rank)
    if kind.startswith("gpt2"):
        xs = [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(4)]
        return lambda module, i: module(input_ids=xs[i], labels=xs[i]).loss
    xs = [torch.randn(64, 16, generator=g) for _ in range(4)]
    return lambda module, i: module(xs[i]).square().mean()


def our_python_ms(setup: Setup, loss_of) -> tuple[float, list[tuple[str, float]]]:
    """Self ms per step of hf_lowzero's Python functions in all, and of the TOP_FUNCTIONS biggest
    (``file:line function``). Self time includes C work a function starts that cProfile does not
    trace apart (a ``map`` over the params inside ``list()``, a tensor freed when a local goes)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED):
        setup.step(loss_of)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    own = {k: v[2] for k, v in stats.items() if k[0].startswith(PACKAGE)}
    top = sorted(own.items(), key=lambda item: -item[1])[:TOP_FUNCTIONS]
    where = [(f"{Path(file).relative_to(PACKAGE)}:{line} {name}", 1000 * t / PROFILED) for (file, line, name), t in top]
    return 1000 * sum(own.values()) / PROFILED, where


def ratios(times: dict[str, list[float]], name: str, baseline: str) -> dict[str, float]:
    per_round = [t / b for t, b in zip(times[name], times[baseline])]
    return {"": statistics.median(per_round), "_min": min(per_round), "_max": max(per_round)}


def body(rank: int, world_size: int, out: str, names: list[str], rounds: int, models: list[str]) -> None:
    torch.set_num_threads(1)
    rows = []
    for kind in models:
        build, micro, steps = MODELS[kind]
        loss_of = loss_fn(kind, rank)
        setups = [Setup(name, build(), micro) for name in names]
        torch.set_num_threads(1)  # whatever a library set while initializing
        runs = {setup.name: functools.partial(setup.step, loss_of) for setup in setups}
        times = interleaved_ms_per_step(runs, rounds, steps, WARMUP)
        for setup in setups:
            row = {"model": kind, "setup": setup.name, "ms_per_step": statistics.median(times[setup.name])}
            row.update({f"vs_ddp{k}": v for k, v in ratios(times, setup.name, "ddp").items()})
            row.update({f"vs_ddp_fused{k}": v for k, v in ratios(times, setup.name, "ddp_fused").items()})
            row["max_param_diff"] = max_param_diff(setup, setups[0])
            rows.append(row)
        for setup, row in zip(setups, rows[-len(setups) :]):
            ours = setup.name in ("zero1", "zero2")
            row["ms_our_python"], row["python_top"] = our_python_ms(setup, loss_of) if ours else ("", [])
            row["buckets"] = len(setup.opt.buckets) if ours else ""
        del setups
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per model (default {ROUNDS})")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: %(default)s")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated subset of: %(default)s")
    args = parser.parse_args()
    rounds, models, names = args.rounds, args.models.split(","), args.setups.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(names) - set(SETUPS))
    if unknown or not {"ddp", "ddp_fused"} <= set(names):
        parser.error(f"unknown models/setups {unknown}, or ddp and ddp_fused (the baselines) left out")
    names = [n for n in SETUPS if n in names]  # the table's order
    skipped = deepspeed_missing()
    if skipped and any(n.startswith("deepspeed") for n in names):
        print(skipped, flush=True)
        names = [n for n in names if not n.startswith("deepspeed")]
    RESULTS.mkdir(exist_ok=True)
    rows = collect(body, 2, names=names, rounds=rounds, models=[m for m in MODELS if m in models])
    everything = set(models) == set(MODELS) and set(args.setups.split(",")) == set(SETUPS)
    name = "step_time" if everything else "step_time_subset"  # a subset never overwrites the full table
    command = f"python benchmarks/step_time.py --rounds {rounds}"
    if not everything:
        command += f" --models {args.models} --setups {args.setups}"
    header = (
        "# Step time, world size 2, CPU/gloo, 1 thread per rank\n\n"
        f"`{command}`: setups interleaved, {rounds} rounds of "
        f"{', '.join(f'{MODELS[kind][2]} ({kind})' for kind in models)} steps after {WARMUP} warm-up "
        "steps; ms_per_step = median over rounds; vs_ddp = the per-round ratio to DDP with "
        "torch's default AdamW kernel (the for-loop on CPU), vs_ddp_fused = the per-round ratio to DDP with fused "
        "AdamW (median, min, max of each); max_param_diff = the largest absolute difference of any param from "
        "DDP's (default kernel) after all those steps (fp32, dropout off, same data); ms_our_python = self time "
        "of hf_lowzero's Python per step (cProfile). DeepSpeed "
        + (
            skipped
            or f"{_deepspeed_version()}, config of deepspeed2 (deepspeed1: stage 1; gpt2_accum4: "
            f"gradient_accumulation_steps 4): `{json.dumps(deepspeed_config(2, 1))}`"
        )
        + "."
    )
    columns = ["model", "setup", "ms_per_step", "vs_ddp", "vs_ddp_min", "vs_ddp_max", "vs_ddp_fused"]
    columns += ["vs_ddp_fused_min", "vs_ddp_fused_max", "max_param_diff", "ms_our_python", "buckets"]
    python = {(r["model"], r["setup"]): r["ms_our_python"] for r in rows if r["ms_our_python"] != ""}
    lines = []
    for setup in ("zero1", "zero2"):
        if ("many_small_2000", setup) in python and ("many_small_300", setup) in python:
            many, few = python["many_small_2000", setup], python["many_small_300", setup]
            lines.append(f"- {setup}: {many:.2f} ms with 2,000 tensors / {few:.2f} ms with 300 = {many / few:.2f}x")
            for model in ("many_small_300", "many_small_2000"):
                top = next(r["python_top"] for r in rows if (r["model"], r["setup"]) == (model, setup))
                lines.append(f"  - {model}, biggest: " + "; ".join(f"`{where}` {ms:.2f}" for where, ms in top))
    footer = "\n\nOur Python per step (`ms_our_python`), 2,000 tiny tensors against 300:\n\n" + "\n".join(lines) + "\n"
    print(write_results(name, rows, columns, header, footer if lines else ""))
    bar_plot(
        RESULTS / f"{name}.png",
        [f"{r['model']} {r['setup']}" for r in rows],
        [r["vs_ddp"] for r in rows],
        [(r["vs_ddp_min"], r["vs_ddp_max"]) for r in rows],
        xlabel="step time / DDP (default AdamW), median of rounds (lower is faster)",
        title="World size 2, CPU/gloo",
    )


if __name__ == "__main__":
    main()
