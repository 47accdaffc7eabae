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

With offload, the same model and optimizer then take a profiled step with our host kernel and,
after a step hook sends the inner step to torch's fused kernel (the path before ``hf_lowzero/zero/host``:
it also widens 16-bit gradient rows into fp32 first), timed steps and a profiled step that way. The
parts of a profiled step (host ms; ``--parts-smoke`` runs them on CPU with a tiny GPT-2, to check the
script without a GPU):

- ``backward``: the forward and backward (the reduced rows' copies to the host overlap it);
- ``grad_norm``: the wait for the last copies and the decision (the norm is taken on the device);
- ``widen_rows``: bf16 gradient rows widened to fp32 (torch's path only);
- ``inner_step``: the host AdamW (the clip factor inside it), our kernel also writing the bf16 params;
- ``all_gather_issue``: the copies back to the GPU and the gather, as issued;
- ``wait``: from ``step()``'s return until the GPU is idle: copies and gathers not yet done.

Writes results/offload.md, results/offload.json and results/offload.png.
"""

from __future__ import annotations

import gc
import json
import os
import socket
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
STEP_PARTS = ("grad_norm", "widen_rows", "inner_step", "all_gather_issue")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torch_step_hook(*_) -> None:
    """A step hook on the inner optimizer: its step is torch's own ([Note: our kernel in torch's place])."""


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
    times = timed_steps(model, opt, x, warmup, steps)
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
    if offload and steps > 1:  # the parts, ours and torch's path (before), on the same model and rows
        row.update({f"ours_{k}": v for k, v in step_parts(model, opt, x).items()})
        hook = opt.optim.register_step_pre_hook(torch_step_hook)
        row["torch_path_ms"] = 1000 * statistics.median(timed_steps(model, opt, x, 1, steps))
        row.update({f"torch_{k}": v for k, v in step_parts(model, opt, x).items()})
        hook.remove()
    del model, opt
    return row


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(model, opt, x: torch.Tensor, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` whole steps of our optimizer (``timed``)."""

    def one_step() -> None:
        opt.backward(model(input_ids=x, labels=x).loss)
        opt.step()

    return timed(one_step, x.device, warmup, steps)


def timed(one_step, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``one_step`` (forward, backward, step), each until the
    device is idle, after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        one_step()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def step_parts(model, opt, x: torch.Tensor) -> dict[str, float]:
    """One step under the profiler: host ms of backward, of each of STEP_PARTS, and the wait after
    ``step()`` (see the module's docstring)."""
    synchronize(x.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        opt.backward(model(input_ids=x, labels=x).loss)
        backward = time.perf_counter()
        opt.step()
        stepped = time.perf_counter()
        synchronize(x.device)
        done = time.perf_counter()
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    parts = {"backward": 1000 * (backward - start)}
    parts |= {part: totals.get(f"hf_lowzero::{part}", 0.0) for part in STEP_PARTS}
    parts["wait"] = 1000 * (done - stepped)
    return {k: round(v, 2) for k, v in parts.items()}


def deepspeed_offload(name: str, n_layer: int, n_embd: int, n_head: int, device: str, batch: int = 4, seq: int = 512):
    """DeepSpeed ZeRO-2 with its optimizer offload (DeepSpeedCPUAdam over pinned host memory), bf16,
    W=1, on ``gpu_measure``'s model and batch: step time and peak memory; or why it could not run."""
    row = {"part": f"{'gpu' if device == 'cuda' else 'cpu smoke'} W=1 bf16 stage 2", "setup": f"{name} deepspeed"}
    if device == "cuda":
        os.environ["DS_ACCELERATOR"] = "cuda"  # benchmarks/common.py tells it "cpu" for the CPU benchmarks
    try:
        import deepspeed

        model = gpt2_on(device, n_layer, n_embd, n_head, seq)
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        x = torch.randint(0, 50257, (batch, seq), device=device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def one_step() -> None:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()

        times = timed(one_step, x.device, WARMUP, STEPS)
    except Exception as error:  # noqa: BLE001 (an optional baseline: any failure is reported, not raised)
        row["not_run"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        return row
    row["ms"] = 1000 * statistics.median(times)
    if device == "cuda":
        row["peak_cuda_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def deepspeed_part(device: str) -> list[dict]:
    """``deepspeed_offload`` for the models of ``gpu_part`` (on CPU: a tiny GPT-2, to check the script)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    models = {"gpt2-124M": (12, 768, 12), "gpt2-1.2B": (24, 2048, 16)} if device == "cuda" else {"tiny": (2, 64, 2)}
    rows = []
    for name, shape in models.items():
        rows.append(deepspeed_offload(name, *shape, device, *(() if device == "cuda" else (2, 32))))
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    return rows


def parts_smoke() -> None:
    """The offload rows' profiled parts on CPU with a tiny bf16 GPT-2 (W=1, gloo): the script's GPU
    path without a GPU. Prints them; writes nothing."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = gpt2_on("cpu", 2, 64, 2, 32)
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2, offload_optimizer=True)
    x = torch.randint(0, 50257, (2, 32))
    timed_steps(model, opt, x, 1, 2)
    ours = step_parts(model, opt, x)
    hook = opt.optim.register_step_pre_hook(torch_step_hook)
    theirs = step_parts(model, opt, x)
    hook.remove()
    print({"ours": ours, "torch": theirs, "paths": opt.host_step.last_path})
    dist.destroy_process_group()


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
    if "--parts-smoke" in sys.argv[1:]:
        parts_smoke()
        deepspeed_part("cpu")
        return
    if "--deepspeed" in sys.argv[1:]:  # gpu_check.sh: its own step, so a slow op build risks no other row
        if not torch.cuda.is_available():
            raise SystemExit("--deepspeed needs a CUDA GPU; none is visible here (--parts-smoke runs it on CPU)")
        rows = deepspeed_part("cuda")
        columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("part", "setup"), k))
        for row in rows:
            for k in columns:
                row.setdefault(k, "")
        header = (
            f"# DeepSpeed ZeRO-2 with optimizer offload on {torch.cuda.get_device_name()}\n\n"
            "`python benchmarks/offload.py --deepspeed`: the models and batch of gpu_offload.md."
        )
        print(write_results("gpu_offload_deepspeed", rows, columns, header))
        return
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
