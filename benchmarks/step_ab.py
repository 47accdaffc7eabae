"""A/B of single step-time changes, interleaved in one run: ours with and without each, W=2 on CPU.

    python benchmarks/step_ab.py              # ~3 min; results/step_ab.{md,json,png}
    python benchmarks/step_ab.py --rounds 30
    python benchmarks/step_ab.py --models many_small_300 --variants ddp_fused,zero1,zero1_verify_off --name step_ab_300

``step_time.py`` compares whole implementations; across two of its runs at the same code the ratios
of a latency-bound model move by more than a small change does (the host's load changes between
runs). Here the variants of one change run in the same rounds, A B A B ..., next to fused DDP:

- ``zero1_verify_every_1`` and ``zero1_verify_off``, diagnostics: the integrity checks at every step
  and off, beside ``zero1`` with their default (``verify_every="auto"``: within 1% of the step);
- ``zero1_reduce_scatter``: stage 1 without [Note: replicated reduction] (``grads/replicated.py``):
  the bucket reduce-scattered and the step's norm and flags all-reduced, three synchronizations per
  step where ``zero1`` has two on a model of one small bucket;
- ``zero1_overlap``: the all-gather left in flight to the next forward (``overlap_allgather=True``, the
  Trainer's default);
- ``zero1_torch_step``, ``zero2_torch_step``: the inner step by torch's fused AdamW over the rows, not
  our host kernel ([Note: our kernel in torch's place], [Note: a prepared call]; a no-op step hook on
  the inner optimizer sends it there): the same bits;
- ``zero1_torch_unpack``: the gathered bucket unpacked by torch's ``split_with_sizes_copy``, not
  by one call of our kernel ([Note: one call per unpack] in ``layout/row_scatter.py``);
- ``zero2_p2p_small_buckets``: point-to-point reduce-scatters and all-gathers for buckets below
  ``POINT_TO_POINT_MIN_BYTES`` too, instead of gloo's own collectives ([Note: gloo point-to-point]
  in ``comm.py``);
- ``zero2_no_norm_sync``, a diagnostic, not a candidate: the step skips the one all-reduce of the
  squared norm and the used-param flags, so each rank takes its own rows' norm. What that sync costs
  per step. It trains the same here only because nothing is clipped and every param is used on
  every rank (``max_param_diff`` checks it); it would let ranks disagree on skipping a non-finite
  step.

Reported per setup: the median step time, and its per-round ratio to ``ddp_fused`` (median, min,
max), in wall time and in rank 0's CPU time (which other jobs on the machine disturb less);
``max_param_diff`` from ``ddp_fused`` after all the steps shows every variant trained the same.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ManySmall,
    Setup,
    bar_plot,
    collect,
    gpt2,
    interleaved_ms_per_step,
    max_param_diff,
    write_results,
)
from benchmarks.step_time import loss_fn, ratios  # noqa: E402
from hf_lowzero.zero.grads import replicated  # noqa: E402
from hf_lowzero.zero.grads.norm import float64_squared_norm, squared_norm  # noqa: E402
from hf_lowzero.zero.layout import row_scatter  # noqa: E402
from hf_lowzero.zero.runtime import comm  # noqa: E402

ROUNDS, WARMUP = 20, 2
MODELS = {  # name: (build, steps per round)
    "many_small_300": (lambda: ManySmall(150), 30),
    "many_small_2000": (lambda: ManySmall(1000), 6),
    "gpt2": (lambda: gpt2(4, 256, dropout=0.0), 3),
}


def no_all_reduce(tensor: torch.Tensor, group, async_op: bool = False, op: str = "sum") -> None:
    """``comm.all_reduce`` that leaves each rank's tensor as it is (``zero2_no_norm_sync``)."""


SWITCHES = {"POINT_TO_POINT_MIN_BYTES": comm, "all_reduce": comm}  # name: its module
CURRENT = {name: getattr(module, name) for name, module in SWITCHES.items()}
# The float64 norm's step-level variant is gone: the step's norm is the blocked one, inside
# StepStats.decide, and nothing swaps it; the two norms are compared directly below (norm_timings).
VARIANTS = {  # setup name: (Setup kind, comm attributes that differ from the current code, ZeroConfig fields)
    "ddp_fused": ("ddp_fused", {}, {}),
    "zero1": ("zero1", {}, {}),
    "zero1_reduce_scatter": ("zero1", {}, {}),
    "zero1_torch_unpack": ("zero1", {}, {}),
    "zero1_overlap": ("zero1", {}, {"overlap_allgather": True}),
    "zero1_torch_step": ("zero1", {}, {}),
    "zero2_torch_step": ("zero2", {}, {}),
    "zero1_verify_every_1": ("zero1", {}, {"verify_every": 1}),
    "zero1_verify_off": ("zero1", {}, {"verify_every": "off"}),
    "zero2": ("zero2", {}, {}),
    "zero2_p2p_small_buckets": ("zero2", {"POINT_TO_POINT_MIN_BYTES": 0}, {}),
    "zero2_no_norm_sync": ("zero2", {"all_reduce": no_all_reduce}, {}),
}


BUILT_WITHOUT = {  # variant: (module, limit) set to 0 while it is built (the limit is read at wrap time)
    "zero1_reduce_scatter": (replicated, "REPLICATED_MAX_BYTES"),  # [Note: replicated reduction] off
    "zero1_torch_unpack": (row_scatter, "GRAIN"),  # [Note: one call per unpack] off
}


TORCH_STEP = ("zero1_torch_step", "zero2_torch_step")  # torch's fused step of the rows, not our host kernel


def build_setup(variant: str, build) -> Setup:
    kind, _, config = VARIANTS[variant]
    if variant in TORCH_STEP:  # a step hook on the inner optimizer sends its step to torch's own
        setup = Setup(kind, build(), 1, config)
        setup.opt.optim.register_step_pre_hook(lambda *_: None)
        return setup
    if variant not in BUILT_WITHOUT:
        return Setup(kind, build(), 1, config)
    module, name = BUILT_WITHOUT[variant]
    limit = getattr(module, name)
    setattr(module, name, 0)
    try:
        return Setup(kind, build(), 1, config)
    finally:
        setattr(module, name, limit)


def use(variant: str) -> None:
    _, limits, _ = VARIANTS[variant]
    for name, value in (CURRENT | limits).items():
        setattr(SWITCHES[name], name, value)


def collective_timings(repeats: int = 40, compute_ms: float = 2.0) -> list[dict]:
    """Median ms of one reduce-scatter and one all-gather, gloo's own against our point-to-point
    exchange, each right after ``compute_ms`` of host compute (as at the end of backward or after
    the optimizer step), at a few sizes; every rank runs it, rank 0's numbers are kept."""
    rows = []
    for per_rank in (20_000, 200_000, 1_400_000):
        full, row, workspace = torch.zeros(2 * per_rank), torch.zeros(per_rank), torch.zeros(2 * per_rank)
        for op in ("reduce_scatter", "all_gather"):
            medians = {}
            for how, limit in (("gloo", 1 << 62), ("point_to_point", 0)):
                comm.POINT_TO_POINT_MIN_BYTES = limit
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    while time.perf_counter() - start < compute_ms / 1000:
                        pass
                    start = time.perf_counter()
                    if op == "reduce_scatter":
                        comm.reduce_scatter(row, full, None, workspace=workspace)
                    else:
                        comm.all_gather(full, row, None)
                    times.append(1000 * (time.perf_counter() - start))
                medians[how] = statistics.median(times)
            rows.append(
                {"op": op, "floats_per_rank": per_rank, "ms_gloo": medians["gloo"], "ms_p2p": medians["point_to_point"]}
            )
    use("zero2")
    return rows


def timed_on_cpu(run, turns: list[float]):
    """``run`` that adds the CPU seconds of this process it takes to ``turns[-1]``."""

    def timed() -> None:
        start = time.process_time()
        run()
        turns[-1] += time.process_time() - start

    return timed


def body(rank: int, world_size: int, out: str, rounds: int, models: list[str], variants: list[str]) -> None:
    torch.set_num_threads(1)
    rows = []
    for kind in models:
        build, steps = MODELS[kind]
        loss_of = loss_fn(kind, rank)
        setups = {name: build_setup(name, build) for name in variants}
        torch.set_num_threads(1)
        cpu: dict[str, list[float]] = {name: [] for name in setups}  # this rank's CPU seconds per turn
        runs = {name: timed_on_cpu(functools.partial(setup.step, loss_of), cpu[name]) for name, setup in setups.items()}

        def before(name: str, cpu: dict[str, list[float]] = cpu) -> None:
            use(name)
            cpu[name].append(0.0)

        times = interleaved_ms_per_step(runs, rounds, steps, WARMUP, before=before)
        cpu_ms = {name: [1000 * t / steps for t in turns[1:]] for name, turns in cpu.items()}  # [0]: the warm-up
        use("zero2")
        for name, setup in setups.items():
            row = {"model": kind, "setup": name, "ms_per_step": statistics.median(times[name])}
            row.update({f"vs_ddp_fused{k}": v for k, v in ratios(times, name, "ddp_fused").items()})
            row["cpu_ms_per_step"] = statistics.median(cpu_ms[name])
            row.update({f"cpu_vs_ddp_fused{k}": v for k, v in ratios(cpu_ms, name, "ddp_fused").items()})
            row["max_param_diff"] = max_param_diff(setup, setups["ddp_fused"])
            rows.append(row)
        del setups
    collectives = collective_timings() if len(models) == len(MODELS) else []
    if rank == 0:
        Path(out).write_text(json.dumps({"steps": rows, "collectives": collectives}))


def norm_timings(numel: int = 2_800_000, repeats: int = 20) -> str:
    """Both norms of one row of GPT-2 4x256's size at W=2, single thread: ms per call, and each
    one's relative error against a float64 sum of squares."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    row = torch.randn(numel, generator=g)
    exact = row.double().square().sum().item()
    lines = []
    for name, norm in (("fp32 blocks summed in float64", squared_norm), ("float64 reduction", float64_squared_norm)):
        norm([row])
        start = time.perf_counter()
        for _ in range(repeats):
            value = norm([row]).item()
        ms = 1000 * (time.perf_counter() - start) / repeats
        lines.append(f"- {name}: {ms:.2f} ms, relative error {abs(value - exact) / exact:.1e}")
    single = torch.linalg.vector_norm(row).double().square().item()
    lines.append(f"- (one fp32 reduction, for comparison: relative error {abs(single - exact) / exact:.1e})")
    return f"\n\nThe squared norm of one {numel:,}-element row:\n\n" + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timed rounds per model (default {ROUNDS})")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: %(default)s")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: %(default)s")
    parser.add_argument("--name", help="results/NAME.{md,json,png} (default: step_ab, or step_ab_subset for a subset)")
    args = parser.parse_args()
    models, variants = args.models.split(","), args.variants.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(variants) - set(VARIANTS))
    if unknown or "ddp_fused" not in variants:
        parser.error(f"unknown models/variants {unknown}, or ddp_fused (the baseline) left out")
    models, variants = [m for m in MODELS if m in models], [v for v in VARIANTS if v in variants]
    everything = len(models) == len(MODELS) and len(variants) == len(VARIANTS)
    name = args.name or ("step_ab" if everything else "step_ab_subset")
    command = f"python benchmarks/step_ab.py --rounds {args.rounds}"
    if not everything:
        command += f" --models {','.join(models)} --variants {','.join(variants)}"
    if args.name:
        command += f" --name {args.name}"
    RESULTS.mkdir(exist_ok=True)
    result = collect(body, 2, rounds=args.rounds, models=models, variants=variants)
    rows, collectives = result["steps"], result["collectives"]
    header = (
        "# A/B of step-time changes, world size 2, CPU/gloo, 1 thread per rank\n\n"
        f"`{command}`: variants interleaved, {args.rounds} rounds of "
        f"{', '.join(f'{MODELS[kind][1]} ({kind})' for kind in models)} steps after {WARMUP} warm-up "
        "steps; ms_per_step = median wall time over rounds; vs_ddp_fused = per-round ratio to DDP with fused AdamW "
        "(median, min, max); cpu_ms_per_step and cpu_vs_ddp_fused: the same for rank 0's CPU time (the process's, "
        "threads included), which a loaded machine disturbs less; max_param_diff = largest absolute difference "
        "of any param from ddp_fused's after all the steps. zero1_verify_every_1 and zero1_verify_off (diagnostics: "
        "what a verify step costs, and what the checks' default, verify_every='auto', costs): checks at every "
        "step, and none. zero1_reduce_scatter: stage 1 without the replicated reduction (the bucket "
        "reduce-scattered, the norm and flags all-reduced: three syncs per step, not two). zero1_torch_unpack: the "
        "gathered bucket unpacked by torch's split_with_sizes_copy, not by one call of our kernel. "
        "zero1_overlap: the all-gather left in flight to the next forward (the Trainer's default). "
        "zero1_torch_step / zero2_torch_step: the inner step by torch's fused AdamW, not our host kernel (the same "
        "bits). zero2_p2p_small_buckets: point-to-point "
        f"exchanges for buckets under {comm.POINT_TO_POINT_MIN_BYTES / 2**20:g} MiB too; zero2_no_norm_sync (a "
        "diagnostic: what the step's one small all-reduce costs): the norm/used-flags all-reduce skipped, each "
        "rank using its own rows' norm, which trains the same here only because nothing is clipped and every "
        "param is used on every rank."
    )
    columns = ["model", "setup", "ms_per_step", "vs_ddp_fused", "vs_ddp_fused_min", "vs_ddp_fused_max"]
    columns += ["cpu_ms_per_step", "cpu_vs_ddp_fused", "cpu_vs_ddp_fused_min", "cpu_vs_ddp_fused_max"]
    footer = ""
    if collectives:
        lines = [
            f"| {c['op']} | {c['floats_per_rank']:,} | {c['ms_gloo']:.2f} | {c['ms_p2p']:.2f} |" for c in collectives
        ]
        footer = norm_timings() + (
            "\n\nOne collective right after 2 ms of host compute, median ms of 40 (W=2, fp32; the bucket sizes "
            "of the models above are 40,800 (300 tensors), 272,000 (2,000) and 5.6M (GPT-2) floats in all):\n\n"
            "| op | floats per rank | gloo's own | point-to-point |\n|---|---|---|---|\n" + "\n".join(lines) + "\n"
        )
    print(write_results(name, rows, columns + ["max_param_diff"], header, footer))
    bar_plot(
        RESULTS / f"{name}.png",
        [f"{r['model']} {r['setup']}" for r in rows],
        [r["vs_ddp_fused"] for r in rows],
        [(r["vs_ddp_fused_min"], r["vs_ddp_fused_max"]) for r in rows],
        xlabel="step time / DDP (fused AdamW), median of rounds (lower is faster)",
        title="World size 2, CPU/gloo: one change at a time",
    )


if __name__ == "__main__":
    main()
