"""The memory plan as a picture: each setup's peak per device, stacked by part, against the device.

    python benchmarks/plan_picture.py      # ~30 s on 2 cores; results/plan_picture.{png,md,json}

The plan of the guide's example (docs/plan.md): GPT-2 124M from its config, 4 devices of 12 GiB,
bf16, per-device batch 8 x 1024 tokens, fused AdamW. Each bar is one setup's busiest-rank peak,
split into the parts the plan reports (params, gradients, masters, optimizer state, activations,
buffers); the line is the usable device memory (the device less the 10% the plan keeps).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import GPT2Config  # noqa: E402

from benchmarks.common import RESULTS, write_results  # noqa: E402
from hf_lowzero import LowZeroTrainingArguments, plan_memory  # noqa: E402

GIB = 2**30
COLORS = {
    "params": "tab:blue",
    "gradients": "tab:orange",
    "master": "tab:green",
    "optimizer_state": "tab:red",
    "frozen": "tab:gray",
    "activations": "tab:purple",
    "buffers": "tab:brown",
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        GPT2Config().save_pretrained(tmp)  # GPT-2 124M's config
        args = LowZeroTrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=8,
            bf16=True,
            optim="adamw_torch_fused",
            report_to=[],
            use_cpu=True,  # bf16 arguments on a machine without a GPU; backend="nccl" plans the GPUs
        )
        plan = plan_memory(tmp, args, world_size=4, device_memory="12GiB", seq_len=1024, backend="nccl")
    rows = [
        {
            "setup": r.label,
            **{k: round(v / GIB, 3) for k, v in r.breakdown.items()},
            "peak_GiB": round(r.peak_bytes / GIB, 2),
        }
        for r in plan.rows
    ]
    usable = plan.rows[0].peak_bytes + plan.rows[0].headroom_bytes  # headroom = usable - peak
    _plot(plan.rows, usable, RESULTS / "plan_picture.png")
    write_results(
        "plan_picture",
        rows,
        list(rows[0]),
        header=(
            "# The memory plan as a picture\n\n`python benchmarks/plan_picture.py`: GPT-2 124M, 4 x 12 GiB, bf16, "
            f"batch 8 x 1024, fused AdamW; GiB per device; usable {usable / GIB:.2f} GiB. "
            "[Plot](plan_picture.png)."
        ),
    )
    print(f"recommended: {plan.recommended.label}; wrote {RESULTS / 'plan_picture.png'}")


def _plot(rows, usable: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    labels = [r.label for r in rows]
    left = [0.0] * len(rows)
    for part, color in COLORS.items():
        widths = [r.breakdown.get(part, 0) / GIB for r in rows]
        if any(widths):
            ax.barh(labels, widths, left=left, color=color, label=part.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
    ax.axvline(usable / GIB, color="k", lw=1.2, ls="--", label="usable device memory")
    ax.invert_yaxis()
    ax.set_xlabel("peak per device (GiB)")
    ax.set_title("Where each setup's peak goes: GPT-2 124M, 4 x 12 GiB, bf16, batch 8 x 1024")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
