"""Loss curves at W = 1, 2 and 4 with a fixed global batch, "ddp" against "exact".

    python benchmarks/exact_curves.py      # ~3 min; results/exact_curves.{md,json,png}

GPT-2 2x64 with dropout 0.1, fp32, AdamW (lr 3e-3), ZeRO stage 2, clipping at 1.0; GLOBAL micro-batches of
4 sequences (arithmetic progressions of tokens: learnable) per step, micro-batch m on rank m % W, STEPS
steps, the same data at every W. Both seed the RNG per global micro-batch
(``hf_lowzero.trainer.exact.micro_batch_seed``, as the Trainer does with ``--zero_reduction exact``), so
that the same dropout masks fall at every W and only the reduction differs: "ddp" divides each loss by
the micro-batches per rank (as Trainer does) and sums in floating point; "exact" passes each
micro-batch's own loss.
Reported: per mode and W the final loss and the largest |param difference| from the same mode at W=1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.trainer.exact import micro_batch_seed  # noqa: E402

GLOBAL, STEPS, WORLD_SIZES = 8, 40, (1, 2, 4)


def body(rank: int, world_size: int, out: str, reduction: str) -> None:
    model = gpt2(2, 64, vocab=512, dropout=0.1)
    opt = LowLevelZeroOptimizer(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), stage=2, reduction=reduction, clip_grad_norm=1.0
    )
    local = GLOBAL // world_size
    curve = []
    for step in range(STEPS):
        losses = torch.zeros(GLOBAL, dtype=torch.float64)
        for m in range(rank, GLOBAL, world_size):
            g = torch.Generator().manual_seed(STEPS * m + step)
            start, stride = torch.randint(0, 512, (4, 1), generator=g), torch.randint(1, 8, (4, 1), generator=g)
            x = (start + stride * torch.arange(32)) % 512
            torch.manual_seed(micro_batch_seed(0, step, m))
            loss = model(input_ids=x, labels=x).loss
            losses[m] = loss.item()
            opt.backward(loss if reduction == "exact" else loss / local)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(losses)  # each micro-batch's loss in its slot: the same sum at any W
        curve.append(losses.sum().item() / GLOBAL)
    opt.wait_for_params()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    if rank == 0:
        Path(out).write_text(json.dumps({"curve": curve, "params": params.tolist()}))


def main() -> None:
    runs = {(r, w): collect(body, w, reduction=r) for r in ("ddp", "exact") for w in WORLD_SIZES}
    rows = []
    for (reduction, world_size), run in runs.items():
        reference = torch.tensor(runs[(reduction, 1)]["params"])
        rows.append(
            {
                "reduction": reduction,
                "W": world_size,
                "final_loss": run["curve"][-1],
                "max_param_diff_vs_W1": (torch.tensor(run["params"]) - reference).abs().max().item(),
            }
        )
    header = (
        "# Exact reduction: loss curves at W = 1, 2, 4\n\n`python benchmarks/exact_curves.py`: GPT-2 2x64, "
        f"dropout 0.1, fp32, AdamW, stage 2, clip 1.0; {GLOBAL} micro-batches of 4 sequences per step, {STEPS} "
        "steps, the same global batches at every W. `max_param_diff_vs_W1`: the largest |difference| of any "
        "parameter from the same reduction's run at W=1 after the last step."
    )
    curves = {f"{r} W={w}": run["curve"] for (r, w), run in runs.items()}
    print(write_results("exact_curves", rows, list(rows[0]), header, data={"rows": rows, "curves": curves}))
    plot(rows, curves)


def plot(rows: list[dict], curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, curve in curves.items():
        style = "-" if name.startswith("exact") else ":"
        left.plot(range(1, len(curve) + 1), curve, style, label=name)
    left.set_xlabel("step")
    left.set_ylabel("loss (mean over the global batch)")
    left.legend()
    left.set_title("loss curves: exact at W = 1, 2, 4 lie on each other")
    diffs = [r for r in rows if r["W"] != 1]
    labels = [f"{r['reduction']} W={r['W']}" for r in diffs]
    right.barh(labels, [max(r["max_param_diff_vs_W1"], 1e-12) for r in diffs], color="tab:blue")
    for i, r in enumerate(diffs):
        diff = r["max_param_diff_vs_W1"]
        right.text(2e-12, i, "0: bit-identical" if diff == 0 else f"{diff:.1e}", va="center", color="k")
    right.set_xscale("log")
    right.set_xlim(1e-12, 1)
    right.set_xlabel("max |param - param at W=1| after the last step")
    right.invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS / "exact_curves.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
