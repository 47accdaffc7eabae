"""Single-GPU path (NCCL, world size 1) on a ~124M-param GPT-2 config: step time and peak CUDA memory.

    python benchmarks/gpu_single.py        # needs a CUDA GPU; writes results/gpu_single.md/.json

First the Trainer as users run it: ``LowZeroTrainer`` with ``zero_stage=2, bf16=True`` against the
plain ``Trainer`` with ``bf16=True`` (autocast over fp32 params), both with ``optim="adamw_torch_fused"``,
the same data and steps; target: ZeRO at most 1.05x the plain Trainer's step time. Then the optimizer
alone: ZeRO bf16/fp16 vs plain PyTorch (fp32 params + autocast + fused AdamW).

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

from benchmarks.common import markdown_table, write_results  # noqa: E402
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


TRAINER_STEPS, TRAINER_WARMUP, TARGET = 30, 5, 1.05


def trainer_step_ms(zero: bool) -> dict:
    """Median step time of a Trainer run (the plain one, or ZeRO stage 2), bf16, fused AdamW."""
    import tempfile

    from transformers import Trainer, TrainerCallback

    from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.start)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return BATCH * (TRAINER_STEPS + 1)

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 50257, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = LowZeroTrainingArguments(
            output_dir=out, zero_stage=2 if zero else 0, bf16=True, optim="adamw_torch_fused",
            per_device_train_batch_size=BATCH, max_steps=TRAINER_STEPS, save_strategy="no", report_to=[],
            logging_steps=TRAINER_STEPS, disable_tqdm=True, dataloader_pin_memory=True,
        )  # fmt: skip
        cls = LowZeroTrainer if zero else Trainer
        trainer = cls(model=gpt2_124m(), args=args, train_dataset=Tokens(), callbacks=[times])
        trainer.train()
    return {
        "setup": "Trainer, ZeRO stage 2, bf16 params + fp32 masters" if zero else "Trainer, bf16 autocast (plain)",
        "ms_per_step": 1000 * statistics.median(times.times[TRAINER_WARMUP:]),
        "peak_cuda_GiB": torch.cuda.max_memory_allocated() / 2**30,
    }


def trainer_part() -> tuple[list[dict], str]:
    plain, zero2 = trainer_step_ms(zero=False), trainer_step_ms(zero=True)
    ratio = zero2["ms_per_step"] / plain["ms_per_step"]
    zero2["time_vs_plain_trainer"], plain["time_vs_plain_trainer"] = ratio, 1.0
    zero2["memory_vs_plain_trainer"] = zero2["peak_cuda_GiB"] / plain["peak_cuda_GiB"]
    plain["memory_vs_plain_trainer"] = 1.0
    met = "met" if ratio <= TARGET else "NOT met"
    verdict = f"ZeRO stage 2 / plain Trainer step time: {ratio:.3f} (target <= {TARGET}: {met})"
    return [plain, zero2], verdict


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_single.py needs a CUDA GPU; none is visible here")
    trainer_rows, verdict = trainer_part()  # before any process group: the ZeRO Trainer makes its own
    print(verdict)
    if not dist.is_initialized():
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
    trainer_table = markdown_table(
        trainer_rows, ["setup", "ms_per_step", "time_vs_plain_trainer", "peak_cuda_GiB", "memory_vs_plain_trainer"]
    )
    header += (
        f"\n\n## The Trainer (median of {TRAINER_STEPS - TRAINER_WARMUP} steps after {TRAINER_WARMUP})\n\n"
        f"{trainer_table}\n{verdict}\n\n## The optimizer alone"
    )
    print(write_results("gpu_single", rows, cols, header, data={"trainer": trainer_rows, "optimizer": rows}))


if __name__ == "__main__":
    main()
