"""bf16 master rows: the bytes they save and what they cost in loss, against fp32 masters.

    python benchmarks/master_precision.py            # ~2 min on a 2-core CPU machine (1 thread)
    python benchmarks/master_precision.py --steps 60 # shorter, noisier

The GPT-2 benchmark model (4 layers, width 256, dropout off) with a byte vocabulary and bf16 params
trains at world size 1 (gloo, CPU, one thread) with the real ``LowLevelZeroOptimizer`` and AdamW at
two constant learning rates: 1e-3, and 1e-5, where most updates are smaller than half a bf16 ulp of
the weight they change. Per learning rate, three runs from the same init on the same batches:
fp32 masters (the baseline), bf16 masters with nearest rounding, bf16 masters with stochastic
rounding. The data is byte-level text: Python standard library sources (fixed for a Python version),
random windows drawn from one seeded generator.

Reports, per run: the final loss and the mean of the last 20 losses, each as a ratio to the fp32-master
run of the same learning rate; the master bytes per rank (``memory_report().master_rows``); the mean
step time (one run after another, not interleaved: indicative only).

Writes results/master_precision.md, results/master_precision.json and results/master_precision.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402

LRS = (1e-3, 1e-5)
SETUPS = {  # name -> ZeroConfig overrides
    "fp32 masters": {"master_dtype": "fp32"},
    "bf16 nearest": {"master_dtype": "bf16", "master_rounding": "nearest"},
    "bf16 stochastic": {"master_dtype": "bf16", "master_rounding": "stochastic"},
}
BATCH, SEQ, LAST = 8, 32, 20
STDLIB_FILES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "typing.py", "inspect.py")


def corpus() -> torch.Tensor:
    """Bytes of a few standard library sources, as token ids (vocabulary 256)."""
    root = Path(argparse.__file__).parent
    text = b"".join((root / name).read_bytes() for name in STDLIB_FILES)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def train_body(rank: int, world_size: int, out: str, steps: int) -> None:
    torch.set_num_threads(1)
    data = corpus()
    results = []
    for lr in LRS:
        for name, overrides in SETUPS.items():
            model = gpt2(4, 256, vocab=256, dropout=0.0).to(torch.bfloat16)
            opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=lr), **overrides)
            g = torch.Generator().manual_seed(0)  # the same batches for every run
            losses, start = [], time.perf_counter()
            for _ in range(steps):
                starts = torch.randint(0, data.numel() - SEQ, (BATCH,), generator=g)
                x = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
                loss = model(input_ids=x, labels=x).loss
                opt.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            seconds = time.perf_counter() - start
            report = opt.memory_report()
            results.append(
                {
                    "lr": lr,
                    "setup": name,
                    "losses": losses,
                    "master_bytes": report.master_rows,
                    "optimizer_state_bytes": report.optimizer_state,
                    "ms_per_step": 1000 * seconds / steps,
                }
            )
            print(f"lr {lr:g} {name}: final loss {losses[-1]:.4f}, {1000 * seconds / steps:.0f} ms/step", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def rows_of(results: list[dict]) -> list[dict]:
    rows = []
    for run in results:
        base = next(r for r in results if r["lr"] == run["lr"] and r["setup"] == "fp32 masters")
        last = sum(run["losses"][-LAST:]) / LAST
        base_last = sum(base["losses"][-LAST:]) / LAST
        rows.append(
            {
                "lr": f"{run['lr']:g}",
                "setup": run["setup"],
                "first loss": run["losses"][0],
                "final loss": run["losses"][-1],
                f"mean last {LAST}": last,
                "final / fp32": run["losses"][-1] / base["losses"][-1],
                f"last {LAST} / fp32": last / base_last,
                "master MiB": run["master_bytes"] / 2**20,
                "master / fp32": run["master_bytes"] / base["master_bytes"],
                "opt state MiB": run["optimizer_state_bytes"] / 2**20,
                "ms/step": run["ms_per_step"],
            }
        )
    return rows


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LRS), figsize=(5 * len(LRS), 3.8))
    for ax, lr in zip(axes, LRS):
        for run in (r for r in results if r["lr"] == lr):
            losses = torch.tensor(run["losses"])
            smooth = losses.unfold(0, 10, 1).mean(1) if losses.numel() >= 10 else losses
            ax.plot(range(len(smooth)), smooth.tolist(), label=run["setup"])
        ax.set_title(f"AdamW lr {lr:g}, bf16 params, W=1")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean of 10 steps)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "master_precision.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    a = parser.parse_args(argv)
    results = collect(train_body, 1, steps=a.steps)
    rows = rows_of(results)
    columns = list(rows[0])
    header = (
        "# bf16 master rows\n\n`python benchmarks/master_precision.py`. GPT-2 4x256 (byte vocabulary, dropout "
        f"off), bf16 params, world size 1 (gloo, CPU, 1 thread), AdamW at a constant lr, {a.steps} steps of "
        f"{BATCH} x {SEQ} tokens of Python standard library source, the same init and batches in every run. "
        "Ratios are to the fp32-master run of the same lr (loss: lower is better)."
    )
    print(write_results("master_precision", rows, columns, header, data={"rows": rows, "runs": results}))
    plot(results)


if __name__ == "__main__":
    main()
