"""One setup's simulated step as a timeline: the streams as lanes, the collectives over the compute.

    python benchmarks/plan_timeline.py      # ~2 min on 2 cores; results/plan_timeline.{png,md,json}

The guide's example (docs/plan.md: GPT-2 124M from its config, bf16, per-device batch 8 x 1024
tokens, fused AdamW) at stage 2 on 8 H100 of one node: the step the plan simulates, recorded as the
code issues it (``hf_lowzero.timing.record``), priced and scheduled (``hf_lowzero.timing.schedule``).
Each lane is the host or a stream; the step runs between the two dashed lines, the end of the
previous update and the end of this one.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import GPT2Config  # noqa: E402

from benchmarks.common import RESULTS, write_results  # noqa: E402
from hf_lowzero.plan.models import ModelSpec  # noqa: E402
from hf_lowzero.plan.simulate import simulate_step  # noqa: E402
from hf_lowzero.plan.step_records import Setup, TrainingSpec  # noqa: E402
from hf_lowzero.simulation.launch import call_on_fake_gpus  # noqa: E402
from hf_lowzero.timing import Costs, Target, schedule  # noqa: E402

COLORS = {"kernel": "tab:blue", "host": "tab:green", "copy": "tab:orange", "collective": "tab:red"}
WORLD, BATCH, SEQ = 8, 8, 1024


def main() -> None:
    from hf_lowzero import LowZeroTrainingArguments

    args = LowZeroTrainingArguments(
        output_dir="/tmp", report_to=[], use_cpu=True, bf16=True, per_device_train_batch_size=BATCH
    )
    training = TrainingSpec.from_args(args)
    spec = ModelSpec.from_source(GPT2Config())
    step = call_on_fake_gpus(simulate_step, spec, training, Setup(2), WORLD, BATCH, SEQ, backend="nccl")
    target = Target.of("H100")
    timeline = schedule(step.program, Costs(target))
    time = timeline.step_time()
    start, end = timeline.boundaries[-2], timeline.boundaries[-1]
    draw(timeline, start, end, RESULTS / "plan_timeline.png")
    rows = [
        {"lane": lane, "busy_ms": round(sum(b - a for a, b, _ in spans if a < end and b > start) * 1e3, 3)}
        for lane, spans in timeline.lanes.items()
    ]
    header = (
        f"# The simulated step on a timeline\n\nGPT-2 124M, stage 2, {WORLD} x H100 (one node), bf16, batch "
        f"{BATCH} x {SEQ}: step {time.seconds * 1e3:.1f} ms, collectives {time.comm_seconds * 1e3:.2f} ms, "
        f"{time.comm_hidden:.0%} of them hidden. `python benchmarks/plan_timeline.py`."
    )
    data = {"step_time_s": time.seconds, "comm_s": time.comm_seconds, "comm_hidden": time.comm_hidden, "lanes": rows}
    print(write_results("plan_timeline", rows, ["lane", "busy_ms"], header, data=data))


def draw(timeline, start: float, end: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = sorted(
        timeline.lanes,
        key=lambda lane: ("host", "compute", "nccl").index(lane) if lane in ("host", "compute", "nccl") else 3,
    )
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * len(lanes)))
    first = min(a for spans in timeline.lanes.values() for a, _, _ in spans)
    for i, lane in enumerate(lanes):
        for kind in COLORS:
            bars = [(a * 1e3, (b - a) * 1e3) for a, b, k in timeline.lanes[lane] if k == kind]
            if bars:
                ax.broken_barh(bars, (i - 0.35, 0.7), color=COLORS[kind], label=kind)
    for x in (start, end):
        ax.axvline(x * 1e3, color="black", linestyle="--", linewidth=1)
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend(handles.values(), handles.keys(), loc="upper left", ncols=4, fontsize=8)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlim(first * 1e3, end * 1e3 * 1.02)
    ax.set_ylim(-0.6, len(lanes) + 0.4)
    ax.set_xlabel("ms (the step: between the dashed lines)")
    ax.set_title("GPT-2 124M, stage 2, 8 x H100: the simulated step, priced and scheduled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
