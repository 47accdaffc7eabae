"""Optimizer offload: step time and memory with and without it, and which host kernel to step with.

    python benchmarks/offload.py              # CPU parts always; GPU parts when CUDA is available
    python benchmarks/offload.py --gpu-only   # the GPU parts alone (results/gpu_offload.md; gpu_check.sh)

CPU (world size 2, gloo, 1 thread per rank, GPT-2 4x256 fp32): stage 1, stage 2, and stage 2
with 2 micro-batches (host staging and adds), with and without offload, measured in one process
group, interleaved A B A B (ROUNDS rounds of STEPS steps each), so that a drifting machine cannot
fake a difference; reports the median of the per-round ratios and their spread. On CPU "host" and
"device" are the same memory: this is the cost of the offload path itself.

Host kernel: AdamW over the row shards of GPT-2 124M at W=8 (148 rows, 15.6M elements), for-loop
vs foreach vs fused, on this machine's threads.

GPU (world size 1, NCCL, bf16, stage 2): GPT-2 124M and a ~1.2B config: step time and peak CUDA
memory with and without offload, against 2Ψ (bf16 params) + bucket buffers + activations; and the
widest GPT-2 (24 layers) that fits: without offload with the Trainer's fused AdamW and with torch's
default foreach AdamW (whose step makes temporaries the size of the shard), and with offload (the
host's kernel left open). The inner AdamW is otherwise the Trainer's: fused on the GPU, left open
with offload. A width is probed by one step, and a probe must leave no memory behind. With
offload the host holds 16 bytes per param (fp32 masters, AdamW's two moments, fp32 gradient rows), so
the offload search stops at the width whose host share would pass half the host's available memory:
past that the host, not the GPU, is what runs out (and the kernel kills the process instead of
raising), and that bound is what the row reports. Each search stops after PROBE_BUDGET_S seconds and
says so (a probe with offload pins and steps gigabytes on the host).

Writes results/offload.md, results/offload.json and results/offload.png.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, gpt2_on, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.trainer.auto import node_available_memory  # noqa: E402

ROUNDS, STEPS, WARMUP = 15, 3, 2
PROBE_BUDGET_S = 60  # per widest-model search: each probe with offload pins and steps gigabytes on the host


def cpu_overhead_body(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 8192, (4, 64), generator=g)
    rows = []
    for stage, micro in ((1, 1), (2, 1), (2, 2)):
        setups = {}
        for offload in (False, True):
            model = gpt2(4, 256)
            opt = LowLevelZeroOptimizer(
                model, torch.optim.AdamW(model.parameters()), stage=stage, offload_optimizer=offload
            )
            setups[offload] = (model, opt)

        def one_step(model, opt, micro=micro):
            for _ in range(micro):  # stage 2 accumulation adds through the host staging buffers
                opt.backward(model(input_ids=x, labels=x).loss / micro)
            opt.step()

        for model, opt in setups.values():
            for _ in range(WARMUP):
                one_step(model, opt)
        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for offload, (model, opt) in setups.items():  # A B A B ...
                dist.barrier()
                start = time.perf_counter()
                for _ in range(STEPS):
                    one_step(model, opt)
                times[offload].append((time.perf_counter() - start) / STEPS)
        ratios = [on / off for on, off in zip(times[True], times[False])]
        rows.append(
            {
                "part": "cpu W=2 gloo",
                "setup": f"stage {stage}" + (f", {micro} micro-batches" if micro > 1 else ""),
                "ms_no_offload": 1000 * statistics.median(times[False]),
                "ms_offload": 1000 * statistics.median(times[True]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def host_kernels() -> list[dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shapes = [p.numel() for p in GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).parameters()]
    world = 8
    grads = [torch.randn(-(-n // world)) for n in shapes]
    results = {}
    for kind, kwargs in [("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})]:
        params = [torch.zeros_like(g) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
        times = []
        for i in range(WARMUP + 2 * STEPS):
            start = time.perf_counter()
            opt.step()
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
        results[kind] = 1000 * statistics.median(times)
    return [
        {
            "part": f"host AdamW, {torch.get_num_threads()} threads",
            "setup": kind,
            "ms": ms,
            "vs_for_loop": ms / results["for-loop"],
        }
        for kind, ms in results.items()
    ]


# ----------------------------------------------------------------------------------------- GPU


def gpu_measure(
    name: str,
    n_layer: int,
    n_embd: int,
    n_head: int,
    offload: bool,
    batch: int = 4,
    seq: int = 512,
    warmup: int = WARMUP,
    steps: int = STEPS,
    kernel: str | None = None,
) -> dict:
    """One setup's step time and memory. ``kernel``: the inner AdamW's ("fused", "foreach", "open"), or
    None for the Trainer's (``trainers_kernel``)."""
    kernel = kernel or trainers_kernel(offload)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = gpt2_on("cuda", n_layer, n_embd, n_head, seq)
    psi = sum(p.numel() for p in model.parameters())
    choice = {"fused": {"fused": True}, "foreach": {"foreach": True}, "open": {}}[kernel]
    inner = torch.optim.AdamW(model.parameters(), **choice)
    opt = LowLevelZeroOptimizer(model, inner, stage=2, offload_optimizer=offload)
    x = torch.randint(0, 50257, (batch, seq), device="cuda")
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    report = opt.memory_report()
    row = {
        "part": "gpu W=1 bf16 stage 2",
        "setup": f"{name} offload={offload}",
        "adamw": kernel,
        "params_M": psi / 1e6,
        "ms": 1000 * statistics.median(times),
        "peak_cuda_GiB": torch.cuda.max_memory_allocated() / 2**30,
        "two_psi_GiB": 2 * psi / 2**30,
        "on_cuda_GiB": report.by_device.get("cuda:0", 0) / 2**30,
        "on_host_GiB": report.by_device.get("cpu", 0) / 2**30,
    }
    del model, opt
    return row


def trainers_kernel(offload: bool) -> str:
    """The AdamW kernel the Trainer runs: ``adamw_torch_fused`` on the GPU; with offload the kernel left
    open for the host step to choose (its fused CPU kernel)."""
    return "open" if offload else "fused"


def gpt2_params(n_layer: int, n_embd: int, seq: int = 256, vocab: int = 50257) -> int:
    """GPT-2's parameter count: 12 d^2 + 13 d per block, the embeddings and the final norm."""
    return n_layer * (12 * n_embd * n_embd + 13 * n_embd) + (vocab + seq) * n_embd + 2 * n_embd


def widest_that_fits(offload: bool, n_layer: int = 24, kernel: str | None = None) -> tuple[int, str]:
    """Largest n_embd (multiple of 256, 1024 to 16384) whose bf16 stage-2 step runs at W=1, by
    bisection (a handful of probes, each a whole model built and stepped once), and what bounds it:
    the GPU's memory, or, with offload, the host's (see the module's docstring)."""
    kernel = kernel or trainers_kernel(offload)
    high = 64  # in units of 256: 1024 .. 16384
    if offload:
        available = node_available_memory()
        while high > 4 and 16 * gpt2_params(n_layer, high * 256) > available // 2:
            high -= 1
    cap = high
    gc.collect()
    held = torch.cuda.memory_allocated()

    def fits(n_embd: int) -> bool:
        start = time.perf_counter()
        try:
            gpu_measure("probe", n_layer, n_embd, n_embd // 64, offload, 1, 256, warmup=0, steps=1, kernel=kernel)
            verdict = True
        except torch.OutOfMemoryError:
            verdict = False
        # A probe that left memory behind would make every later one run out early: the first GPU
        # runs of this search did, before [Note: hooks hold the optimizer weakly] in zero/grads/backward.py.
        gc.collect()
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated() - held
        if left > 64 << 20:
            raise RuntimeError(
                f"the probe of width {n_embd} left {left / 2**30:.2f} GiB allocated; later widths would be wrong"
            )
        print(
            f"  offload={offload} adamw={kernel} n_embd={n_embd}: {'fits' if verdict else 'out of memory'} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        return verdict

    low, began = 4, time.perf_counter()
    if not fits(low * 256):
        return 0, "GPU memory"
    while low < high:
        if time.perf_counter() - began > PROBE_BUDGET_S:
            return low * 256, f"at least this: the search stopped at its {PROBE_BUDGET_S} s budget"
        middle = (low + high + 1) // 2
        if fits(middle * 256):
            low = middle
        else:
            high = middle - 1
    if low < cap:
        return low * 256, "GPU memory"
    if cap < 64:
        return low * 256, f"host memory (16 B/param within half of {available / 2**30:.0f} GiB available)"
    return low * 256, "the search's range"


def gpu_part() -> list[dict]:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for name, (n_layer, n_embd, n_head) in {"gpt2-124M": (12, 768, 12), "gpt2-1.2B": (24, 2048, 16)}.items():
        pair = [gpu_measure(name, n_layer, n_embd, n_head, offload) for offload in (False, True)]
        pair[1]["vs_no_offload"] = pair[1]["ms"] / pair[0]["ms"]
        for row in pair:
            print(row, flush=True)
        rows += pair
    # the Trainer's fused AdamW, torch's default foreach (its step makes whole-shard temporaries), offload
    for offload, kernel in ((False, "fused"), (False, "foreach"), (True, "open")):
        n_embd, bound = widest_that_fits(offload, kernel=kernel)
        rows.append(
            {
                "part": "gpu widest GPT-2, 24 layers",
                "setup": f"offload={offload}",
                "adamw": kernel,
                "n_embd": n_embd,
                "params_M": gpt2_params(24, n_embd) / 1e6,
                "bound_by": bound,
            }
        )
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    return rows


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    if "--gpu-only" in sys.argv[1:]:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu-only needs a CUDA GPU; none is visible here")
        rows = gpu_part()
        columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("part", "setup"), k))
        for row in rows:
            for k in columns:
                row.setdefault(k, "")
        header = f"# Optimizer offload on {torch.cuda.get_device_name()}\n\n`python benchmarks/offload.py --gpu-only`."
        print(write_results("gpu_offload", rows, columns, header))
        return
    rows = collect(cpu_overhead_body, 2)
    rows += host_kernels()
    if torch.cuda.is_available():
        rows += gpu_part()
    columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("part", "setup"), k))
    for row in rows:
        for k in columns:
            row.setdefault(k, "")
    header = (
        "# Optimizer offload\n\n`python benchmarks/offload.py`. CPU: world size 2, gloo, 1 thread per rank, "
        f"GPT-2 4x256 fp32, {ROUNDS} interleaved rounds of {STEPS} steps; ratio = offload / no offload per round "
        "(median, min, max). Host kernel: AdamW over GPT-2 124M row shards at W=8."
        + ("" if torch.cuda.is_available() else " No GPU was available for this run: GPU rows missing.")
    )
    print(write_results("offload", rows, columns, header))
    plot(rows)


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu = [r for r in rows if r["part"].startswith("cpu")]
    host = [r for r in rows if r["part"].startswith("host")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.bar([r["setup"] for r in cpu], [r["ratio_median"] for r in cpu], color="tab:blue")
    a.errorbar(
        [r["setup"] for r in cpu],
        [r["ratio_median"] for r in cpu],
        yerr=[[r["ratio_median"] - r["ratio_min"] for r in cpu], [r["ratio_max"] - r["ratio_median"] for r in cpu]],
        fmt="none",
        color="k",
    )
    a.axhline(1.0, color="k", lw=0.8)
    a.set_ylabel("step time, offload / no offload")
    a.set_title("offload path overhead, CPU W=2")
    b.bar([r["setup"] for r in host], [r["ms"] for r in host], color="tab:orange")
    b.set_ylabel("ms per AdamW step")
    b.set_title("host AdamW kernel (GPT-2 124M / 8)")
    fig.tight_layout()
    fig.savefig(RESULTS / "offload.png", dpi=120)


if __name__ == "__main__":
    main()
