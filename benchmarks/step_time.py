"""Step time of ZeRO stage 1/2 against DDP, world size 2 on CPU, setups interleaved.

    python benchmarks/step_time.py              # ~5 min; results/step_time.{md,json,png}

All setups of one model live in the same process group and are timed in turns, A B C A B C ...,
ROUNDS rounds of STEPS optimizer steps each (after warm-up), so that a machine that drifts or
hiccups affects every setup alike. Reported: the median step time over rounds, and the ratio to
the DDP baseline of the same model computed per round (median, min, max).

Baselines: ``ddp`` is DDP with ``torch.optim.AdamW(model.parameters())`` as a user writes it
(torch's default kernel on CPU: the for-loop); ``ddp_fused`` gives DDP the fused AdamW kernel
that ZeRO picks for its host rows, to separate the kernel choice from the sharding. Models:
GPT-2 4x256 (5.6M params, 52 tensors), 300 tiny Linear layers (600 tensors) and 1000 of them
(2000 tensors), which expose per-parameter overhead. ``ms_our_python`` is the self time of
hf_lowzero's own Python functions per step (cProfile over extra steps, outside the timed rounds).
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from benchmarks.common import RESULTS, ManySmall, bar_plot, collect, gpt2, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402

ROUNDS, STEPS, WARMUP, PROFILED = 15, 3, 2, 3
PACKAGE = str(Path(__file__).resolve().parents[1] / "hf_lowzero")


class Setup:
    """One way to train a model: forward module, backward, step, and no_sync for accumulation."""

    def __init__(self, name: str, model: torch.nn.Module, micro: int) -> None:
        self.name, self.micro = name, micro
        if name.startswith("ddp"):
            self.module = DDP(model)
            fused = {"fused": True} if name.startswith("ddp_fused") else {}
            self.opt = torch.optim.AdamW(self.module.parameters(), **fused)
            self.backward = lambda loss: loss.backward()
            self.no_sync = self.module.no_sync
        else:
            stage = int(name[4])
            self.module = model
            self.opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=stage)
            self.backward = self.opt.backward
            self.no_sync = self.opt.no_sync if stage == 1 else contextlib.nullcontext

    def step(self, loss_of) -> None:
        for i in range(self.micro):
            with self.no_sync() if i < self.micro - 1 else contextlib.nullcontext():
                self.backward(loss_of(self.module, i) / self.micro)
        self.opt.step()
        self.opt.zero_grad()


MODELS = {
    "gpt2": (lambda: gpt2(4, 256), ["ddp", "ddp_fused", "zero1", "zero2"], 1),
    "gpt2_accum4": (lambda: gpt2(4, 256), ["ddp_accum4", "ddp_fused_accum4", "zero1_accum4", "zero2_accum4"], 4),
    "many_small_600": (lambda: ManySmall(300), ["ddp", "ddp_fused", "zero1", "zero2"], 1),
    "many_small_2000": (lambda: ManySmall(1000), ["ddp", "ddp_fused", "zero1", "zero2"], 1),
}


def loss_fn(kind: str, rank: int):
    g = torch.Generator().manual_seed(rank)
    if kind.startswith("gpt2"):
        xs = [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(4)]
        return lambda module, i: module(input_ids=xs[i], labels=xs[i]).loss
    xs = [torch.randn(64, 16, generator=g) for _ in range(4)]
    return lambda module, i: module(xs[i]).square().mean()


def our_python_ms(setup: Setup, loss_of) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(PROFILED):
        setup.step(loss_of)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    own = sum(v[2] for k, v in stats.items() if k[0].startswith(PACKAGE))
    return 1000 * own / PROFILED


def body(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    rows = []
    for kind, (build, names, micro) in MODELS.items():
        loss_of = loss_fn(kind, rank)
        setups = [Setup(name, build(), micro) for name in names]
        for setup in setups:
            for _ in range(WARMUP):
                setup.step(loss_of)
        times = {s.name: [] for s in setups}
        for _ in range(ROUNDS):
            for setup in setups:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS):
                    setup.step(loss_of)
                times[setup.name].append(1000 * (time.perf_counter() - start) / STEPS)
        baseline = names[0]
        for setup in setups:
            ratios = [t / b for t, b in zip(times[setup.name], times[baseline])]
            rows.append(
                {
                    "model": kind,
                    "setup": setup.name,
                    "ms_per_step": statistics.median(times[setup.name]),
                    "vs_ddp": statistics.median(ratios),
                    "vs_ddp_min": min(ratios),
                    "vs_ddp_max": max(ratios),
                    "ms_our_python": our_python_ms(setup, loss_of) if setup.name.startswith("zero") else "",
                    "buckets": len(setup.opt.buckets) if setup.name.startswith("zero") else "",
                }
            )
        del setups
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = collect(body, 2)
    for row in rows:
        ddp_fused = next(r for r in rows if r["model"] == row["model"] and r["setup"].startswith("ddp_fused"))
        row["vs_ddp_fused"] = row["ms_per_step"] / ddp_fused["ms_per_step"]
    header = (
        "# Step time, world size 2, CPU/gloo, 1 thread per rank\n\n"
        f"`python benchmarks/step_time.py`: setups interleaved, {ROUNDS} rounds of {STEPS} steps; "
        "vs_ddp = the per-round ratio to DDP with default AdamW (median, min, max); vs_ddp_fused = "
        "median step time / that of DDP with fused AdamW; ms_our_python = self time of hf_lowzero's "
        "Python per step (cProfile)."
    )
    columns = ["model", "setup", "ms_per_step", "vs_ddp", "vs_ddp_min", "vs_ddp_max", "vs_ddp_fused"]
    print(write_results("step_time", rows, columns + ["ms_our_python", "buckets"], header))
    bar_plot(
        RESULTS / "step_time.png",
        [f"{r['model']} {r['setup']}" for r in rows],
        [r["vs_ddp"] for r in rows],
        [(r["vs_ddp_min"], r["vs_ddp_max"]) for r in rows],
        xlabel="step time / DDP (default AdamW), median of rounds (lower is faster)",
        title="World size 2, CPU/gloo",
    )


if __name__ == "__main__":
    main()
