"""Step time of ZeRO stage 1/2 against DDP, ZeroRedundancyOptimizer and FSDP2, world size 2 on CPU.

    python benchmarks/step_time.py

Each setup trains the same model in the same invocation (gloo, 2 ranks, 1 thread each); the
number is the median wall time of an optimizer step over 10 steps after 3 warm-up steps, and the
ratio is against DDP's median in the same run. Two models: a ~5M-param GPT-2 and a model of 300
tiny Linear layers (600 parameters) that exposes per-parameter overhead.
Writes results/step_time.md, results/step_time.json and results/step_time.png.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from benchmarks.common import RESULTS, ManySmall, gpt2, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402

WARMUP, STEPS = 3, 10


def setups():
    """name -> (micro-batches, builder(model) -> (forward_module, backward(loss), step(), no_sync ctx))."""

    def ddp(model):
        m = DDP(model)
        opt = torch.optim.AdamW(m.parameters())
        return m, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()), m.no_sync

    def zero(stage, overlap):
        def build(model):
            opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=stage,
                                        overlap_communication=overlap)  # fmt: skip
            no_sync = opt.no_sync if stage == 1 else contextlib.nullcontext
            return model, opt.backward, lambda: (opt.step(), opt.zero_grad()), no_sync

        return build

    def zero_redundancy(model):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        m = DDP(model)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW)
        return m, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()), m.no_sync

    def fsdp2(model):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters())
        return model, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()), contextlib.nullcontext

    return {
        "ddp": (1, ddp),
        "zero1": (1, zero(1, True)),
        "zero1_no_overlap": (1, zero(1, False)),
        "zero2": (1, zero(2, True)),
        "zero2_no_overlap": (1, zero(2, False)),
        "torch_ZeroRedundancyOptimizer": (1, zero_redundancy),
        "fsdp2_no_reshard": (1, fsdp2),
        "ddp_accum4": (4, ddp),
        "zero1_accum4": (4, zero(1, True)),
        "zero2_accum4": (4, zero(2, True)),
    }


def batches(kind: str, rank: int, n: int):
    g = torch.Generator().manual_seed(rank)
    if kind == "gpt2":
        return [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(n)]
    return [torch.randn(64, 16, generator=g) for _ in range(n)]


def loss_of(kind, module, x):
    return module(input_ids=x, labels=x).loss if kind == "gpt2" else module(x).square().mean()


def body(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    rows = []
    for kind in ("gpt2", "many_small"):
        for name, (micro, build) in setups().items():
            if kind == "many_small" and name not in ("ddp", "zero1", "zero2"):
                continue
            model = gpt2(4, 256) if kind == "gpt2" else ManySmall()
            try:
                module, backward, step, no_sync = build(model)
            except Exception as e:  # a baseline that does not run here is reported, not fatal
                rows.append({"model": kind, "setup": name, "ms_per_step": float("nan"), "vs_ddp": float("nan"),
                             "note": f"{type(e).__name__}: {str(e)[:60]}"})  # fmt: skip
                continue
            data = batches(kind, rank, micro)
            times = []
            for i in range(WARMUP + STEPS):
                dist.barrier()
                start = time.perf_counter()
                for j, x in enumerate(data):
                    with no_sync() if j < micro - 1 else contextlib.nullcontext():
                        backward(loss_of(kind, module, x) / micro)
                step()
                if i >= WARMUP:
                    times.append(time.perf_counter() - start)
            rows.append({"model": kind, "setup": name, "ms_per_step": 1000 * statistics.median(times), "note": ""})
    if rank == 0:
        for row in rows:
            baseline = "ddp_accum4" if "accum4" in row["setup"] else "ddp"
            base = next(r for r in rows if r["model"] == row["model"] and r["setup"] == baseline)
            row["vs_ddp"] = row["ms_per_step"] / base["ms_per_step"]
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "_time.json"
    run_distributed(body, 2, out=str(out))
    rows = json.loads(out.read_text())
    out.unlink()
    header = (
        "# Step time, world size 2, CPU/gloo, 1 thread per rank (median of 10 steps)\n\n"
        "`python benchmarks/step_time.py`; vs_ddp = time / DDP's time (DDP with the same accumulation)."
    )
    print(write_results("step_time", rows, ["model", "setup", "ms_per_step", "vs_ddp", "note"], header))
    plot(rows)


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["model"] == "gpt2" and r["ms_per_step"] == r["ms_per_step"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["setup"] for r in sel], [r["vs_ddp"] for r in sel], color="tab:blue")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("step time / DDP step time (lower is faster)")
    ax.set_title("GPT-2 4x256, world size 2, CPU/gloo")
    fig.tight_layout()
    fig.savefig(RESULTS / "step_time.png", dpi=120)


if __name__ == "__main__":
    main()
