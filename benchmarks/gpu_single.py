"""Single-GPU path (NCCL, world size 1): ZeRO bf16/fp16 vs plain PyTorch (fp32 params + autocast +
fused AdamW) on a ~124M-param GPT-2 config: step time and peak CUDA memory.

    python benchmarks/gpu_single.py        # needs a CUDA GPU; writes results/gpu_single.md/.json

ZeRO at world size 1 shards nothing; what it buys on one GPU is 16-bit params and gradients with
fp32 master weights (2Ψ + 2Ψ + 12Ψ bytes instead of autocast's 4Ψ + 4Ψ + 8Ψ plus casts).
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
    rows = [
        measure("plain fp32 params + autocast bf16 + fused AdamW", plain_autocast(torch.bfloat16)),
        measure("zero2 bf16 params + fp32 master", zero(torch.bfloat16, 2)),
        measure("zero1 bf16 params + fp32 master", zero(torch.bfloat16, 1)),
        measure("plain fp32 params + autocast fp16 + fused AdamW", plain_autocast(torch.float16)),
        measure("zero2 fp16 params + fp32 master", zero(torch.float16, 2)),
    ]
    for row in rows:
        base = rows[0] if "bf16" in row["setup"] else rows[3]
        row["time_vs_plain"] = row["ms_per_step"] / base["ms_per_step"]
        row["memory_vs_plain"] = row["peak_cuda_GiB"] / base["peak_cuda_GiB"]
    header = (
        f"# Single GPU ({torch.cuda.get_device_name()}), GPT-2 124M, batch {BATCH}x{SEQ}\n\n"
        "`python benchmarks/gpu_single.py`; ratios against plain PyTorch with the same 16-bit dtype."
    )
    cols = ["setup", "ms_per_step", "time_vs_plain", "peak_cuda_GiB", "memory_vs_plain"]
    print(write_results("gpu_single", rows, cols, header))


if __name__ == "__main__":
    main()
