"""The memory plan against real steps: predicted next to measured, per model, optimizer and setup.

    python benchmarks/memory_plan.py              # ~4 min on a 2-core CPU machine
    python benchmarks/memory_plan.py --llama70b   # also: how long a Llama-3-70B config takes to plan

For each case the plan's simulation of one step (the real code under ``FakeTensorMode`` on a fake
process group standing for gloo, ``hf_lowzero.plan.simulate``) is set next to the same step run
for real on ``world_size`` gloo ranks and tracked by the same ``MemTracker``
(``hf_lowzero.plan.measure.check_case``): the busiest rank's peak and its model states (params,
gradients, masters, optimizer state, frozen params), each as a ratio predicted / measured. The
targets: model states within 1%, peak within 10%.

Cases: GPT-2, BERT (masked LM), T5 and GPT-2 with a LoRA adapter (tiny configs, built, never
downloaded); at W=2 with AdamW, stage 0 (DDP), 1, 2 and 2 with offload, bf16; at W=4 with
bitsandbytes' 8-bit AdamW and gradient checkpointing, stages 0 and 2; at W=1 in fp32 with
checkpointing, stage 1 with offload; GPT-2 with bf16 masters.

Writes results/memory_plan.md, results/memory_plan.json and results/memory_plan.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, write_results  # noqa: E402
from hf_lowzero.plan.measure import PlanCase, check_case  # noqa: E402

MODELS = ("gpt2", "bert", "t5", "gpt2-lora")


def cases() -> list[PlanCase]:
    out = []
    for model in MODELS:
        for stage, offload in ((0, False), (1, False), (2, False), (2, True)):
            out.append(PlanCase(model, stage=stage, offload=offload, world_size=2))
        for stage in (0, 2):
            out.append(PlanCase(model, optim="adamw_bnb_8bit", gradient_checkpointing=True, stage=stage, world_size=4))
        out.append(PlanCase(model, bf16=False, gradient_checkpointing=True, stage=1, offload=True, world_size=1))
    out.append(PlanCase("gpt2", stage=2, world_size=2, master_dtype="bf16"))
    out.append(PlanCase("gpt2", stage=1, world_size=2, gradient_accumulation_steps=4))
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    measured = [r["measured peak MiB"] for r in rows]
    predicted = [r["planned peak MiB"] for r in rows]
    ax = axes[0]
    ax.scatter(measured, predicted, s=18)
    top = max(measured + predicted) * 1.1
    ax.plot([0, top], [0, top], color="k", lw=0.8, label="planned = measured")
    ax.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="tab:green", alpha=0.15, label="±10%")
    ax.set_xlabel("measured peak per rank (MiB)")
    ax.set_ylabel("planned peak per rank (MiB)")
    ax.set_title("Peak: plan vs a real step")
    ax.legend()
    ax = axes[1]
    ax.scatter(range(len(rows)), [r["peak ratio"] for r in rows], s=18, label="peak")
    ax.scatter(range(len(rows)), [r["model states ratio"] for r in rows], s=18, marker="x", label="model states")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhspan(0.9, 1.1, color="tab:green", alpha=0.15)
    ax.set_xlabel("case (see the table)")
    ax.set_ylabel("planned / measured")
    ax.set_title("Ratios per case")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_llama70b() -> dict:
    """Plan a Llama-3-70B config (80 layers, 8192 wide) for 8 x 80 GiB: seconds taken and the result."""
    from transformers import LlamaConfig

    from hf_lowzero.plan import plan_memory
    from hf_lowzero.trainer.arguments import LowZeroTrainingArguments

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        architectures=["LlamaForCausalLM"],
    )
    args = LowZeroTrainingArguments(
        output_dir="/dev/null", use_cpu=True, report_to=[], bf16=True, per_device_train_batch_size=1,
        gradient_checkpointing=True,
    )  # fmt: skip
    start = time.perf_counter()
    # GPUs: the arguments say use_cpu only for bf16 to pass on a machine without one
    plan = plan_memory(config, args, world_size=8, device_memory="80GiB", seq_len=2048, backend="nccl")
    seconds = time.perf_counter() - start
    print(plan.to_text())
    return {"seconds": round(seconds, 1), "plan": plan.to_text()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama70b", action="store_true", help="also time a plan of a Llama-3-70B config")
    a = parser.parse_args()
    rows = []
    for case in cases():
        result = check_case(case)
        row = {
            "case": case.label,
            "planned peak MiB": result["planned_peak"] / 2**20,
            "measured peak MiB": result["measured_peak"] / 2**20,
            "peak ratio": result["peak_ratio"],
            "model states ratio": result["model_states_ratio"],
            "planned sent KiB": result["planned_sent"] / 2**10,
            "measured sent KiB": result["measured_sent"] / 2**10,
        }
        rows.append(row)
        print(f"{row['case']:<70} peak {row['peak ratio']:.3f}  model states {row['model states ratio']:.4f}")
    peak = [r["peak ratio"] for r in rows]
    states = [r["model states ratio"] for r in rows]
    footer = (
        f"\n{len(rows)} cases. Peak ratio {min(peak):.3f} to {max(peak):.3f} (target within 10%: "
        f"{'met' if all(abs(p - 1) <= 0.10 for p in peak) else 'NOT met'}); model states ratio {min(states):.4f} "
        f"to {max(states):.4f} (target within 1%: {'met' if all(abs(s - 1) <= 0.01 for s in states) else 'NOT met'}).\n"
    )
    data: dict = {"cases": rows}
    if a.llama70b:
        timed = time_llama70b()
        data["llama70b"] = timed
        footer += f"\nPlanning a Llama-3-70B config for 8 x 80 GiB took {timed['seconds']} s on this machine.\n"
    header = (
        "# Memory plan vs real steps\n\n`python benchmarks/memory_plan.py` (CPU, gloo; tiny models, batch 4 x 64 "
        "tokens). Planned: the real code simulated under fake tensors; measured: the same step run for real, "
        "same tracker. Ratio = planned / measured, busiest rank."
    )
    columns = list(rows[0])
    print(write_results("memory_plan", rows, columns, header, footer, data=data))
    plot(rows, RESULTS / "memory_plan.png")


if __name__ == "__main__":
    main()
