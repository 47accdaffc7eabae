"""Single-GPU path (NCCL, world size 1): ZeRO bf16/fp16 vs plain PyTorch (fp32 params + autocast +
fused AdamW) on a ~124M-param GPT-2 config: step time and peak CUDA memory.

    python benchmarks/gpu_single.py        # needs a CUDA GPU; writes results/gpu_single.md/.json

ZeRO at world size 1 shards nothing; what it buys on one GPU is 16-bit params and gradients with
fp32 master weights (2Ψ + 2Ψ + 12Ψ bytes instead of autocast's 4Ψ + 4Ψ + 8Ψ plus casts).

Two baselines per 16-bit dtype, each ratio against both: mixed precision as most people run it
(fp32 params, autocast, fused AdamW), and plain 16-bit training (16-bit params, fused AdamW
stepping them directly, no master copy: the same kernel ZeRO runs on its fp32 rows, the cheapest
way to train in 16 bits, and a lossy one).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402

WARMUP, STEPS, BATCH, SEQ = 3, 20, 8, 512


def gpt2_124m():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_positions=SEQ, bos_token_id=0, eos_token_id=0)).cuda()


def measure(name: str, build) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    forward_backward, step = build()
    x = torch.randint(0, 50257, (BATCH, SEQ), device="cuda")
    times = []
    for i in range(WARMUP + STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward(x)
        step()
        torch.cuda.synchronize()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"setup": name, "ms_per_step": 1000 * statistics.median(times),
            "peak_cuda_GiB": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def plain_autocast(dtype):
    def build():
        model = gpt2_124m()
        opt = torch.optim.AdamW(model.parameters(), fused=True)

        def fb(x):
            with torch.autocast("cuda", dtype=dtype):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()

        return fb, lambda: (opt.step(), opt.zero_grad(set_to_none=True))

    return build


def plain_16bit(dtype):
    def build():
        model = gpt2_124m().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), fused=True)

        def fb(x):
            model(input_ids=x, labels=x).loss.backward()

        return fb, lambda: (opt.step(), opt.zero_grad(set_to_none=True))

    return build


def zero(dtype, stage):
    def build():
        model = gpt2_124m().to(dtype)
        opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), fused=True), stage=stage)
        return (lambda x: opt.backward(model(input_ids=x, labels=x).loss)), (lambda: (opt.step(), opt.zero_grad()))

    return build


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_single.py needs a CUDA GPU; none is visible here")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        rows += [
            measure(f"plain fp32 params + autocast {label} + fused AdamW", plain_autocast(dtype)),
            measure(f"plain {label} params + fused AdamW", plain_16bit(dtype)),
            measure(f"zero2 {label} params + fp32 master", zero(dtype, 2)),
        ]
        if dtype == torch.bfloat16:
            rows.append(measure(f"zero1 {label} params + fp32 master", zero(dtype, 1)))
    for row in rows:
        label = "bf16" if "bf16" in row["setup"] else "fp16"
        autocast = next(r for r in rows if r["setup"].startswith(f"plain fp32 params + autocast {label}"))
        pure = next(r for r in rows if r["setup"] == f"plain {label} params + fused AdamW")
        row["time_vs_autocast"] = row["ms_per_step"] / autocast["ms_per_step"]
        row["time_vs_plain_16bit"] = row["ms_per_step"] / pure["ms_per_step"]
        row["memory_vs_autocast"] = row["peak_cuda_GiB"] / autocast["peak_cuda_GiB"]
        row["memory_vs_plain_16bit"] = row["peak_cuda_GiB"] / pure["peak_cuda_GiB"]
    header = (
        f"# Single GPU ({torch.cuda.get_device_name()}), GPT-2 124M, batch {BATCH}x{SEQ}\n\n"
        "`python benchmarks/gpu_single.py`: median of "
        f"{STEPS} steps after {WARMUP}; ratios against plain PyTorch with the same 16-bit dtype, mixed "
        "precision (fp32 params + autocast) and plain 16-bit params, both with fused AdamW."
    )
    cols = ["setup", "ms_per_step", "time_vs_autocast", "time_vs_plain_16bit", "peak_cuda_GiB"]
    cols += ["memory_vs_autocast", "memory_vs_plain_16bit"]
    print(write_results("gpu_single", rows, cols, header))


if __name__ == "__main__":
    main()
