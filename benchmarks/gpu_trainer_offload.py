"""The Trainer with optimizer offload on one GPU, against the same run without offload.

    python benchmarks/gpu_trainer_offload.py              # needs a CUDA GPU; writes results/gpu_trainer_offload.*
    python benchmarks/gpu_trainer_offload.py --cpu-smoke  # the same code on CPU, a tiny model, into a temp dir

``LowZeroTrainer``, ZeRO stage 2, ``bf16=True``, ``optim="adamw_torch_fused"``, a constant learning
rate, GPT-2 124M with dropout off on 4 x 512 tokens of a pattern it can learn, STEPS steps, twice:
without and with ``zero_offload_optimizer``. Same seed, data and steps, so the runs differ only in
where AdamW steps the fp32 masters (the GPU's fused kernel, or the host's): every step's loss must
be within TOLERANCE of the other run's (relative), or the script fails. Also each run's median step
time and peak CUDA memory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.common import RESULTS, gpt2_on, write_results  # noqa: E402
from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments  # noqa: E402

STEPS, WARMUP, BATCH, LR = 30, 5, 4, 5e-4
TOLERANCE = 0.01  # relative difference of a step's loss
FIRST_STEP_TOLERANCE = 1e-4  # before any update: the same weights and data (the logged loss has 4 decimals)
GPU_SHAPE, SMOKE_SHAPE = (12, 768, 12, 512, 50257), (2, 64, 4, 32, 512)  # n_layer, n_embd, n_head, seq, vocab


class StepTimes(TrainerCallback):
    """Wall time of each optimizer step, the device synchronized at both ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        _synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _synchronize()
        self.times.append(time.perf_counter() - self.start)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Pattern(torch.utils.data.Dataset):
    """Sequences ``start, start + 7, start + 14, ...`` modulo ``tokens``: learnable within a few steps."""

    def __init__(self, n: int, seq: int, tokens: int) -> None:
        self.n, self.seq, self.tokens = n, seq, tokens

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        start = torch.randint(0, self.tokens, (1,), generator=torch.Generator().manual_seed(i))
        ids = (start + 7 * torch.arange(self.seq)) % self.tokens
        return {"input_ids": ids, "labels": ids}


def train(offload: bool, shape: tuple, device: str) -> dict:
    n_layer, n_embd, n_head, seq, vocab = shape
    model = gpt2_on(device, n_layer, n_embd, n_head, seq, vocab=vocab, dtype=torch.float32, dropout=0.0)
    times = StepTimes()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        args = LowZeroTrainingArguments(
            output_dir=out, zero_stage=2, zero_offload_optimizer=offload, bf16=True, optim="adamw_torch_fused",
            learning_rate=LR, lr_scheduler_type="constant", per_device_train_batch_size=BATCH, max_steps=STEPS,
            logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=device == "cpu",
            dataloader_pin_memory=device == "cuda",
        )  # fmt: skip
        trainer = LowZeroTrainer(
            model=model, args=args, train_dataset=Pattern(BATCH * STEPS, seq, min(vocab, 1000)), callbacks=[times]
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "setup": f"offload={offload}",
        "losses": losses,
        "final_loss": losses[-1],
        "ms_per_step": 1000 * statistics.median(times.times[WARMUP:]),
        "peak_cuda_GiB": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run on CPU with a tiny model (a smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results; "
                        "with --cpu-smoke a new temporary folder)")  # fmt: skip
    args = parser.parse_args()
    smoke, out = args.cpu_smoke, args.out
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_trainer_offload.py needs a CUDA GPU; none is visible here (--cpu-smoke)")
    out = out or (Path(tempfile.mkdtemp(prefix="gpu_trainer_offload_smoke_")) if smoke else RESULTS)
    shape, device = (SMOKE_SHAPE, "cpu") if smoke else (GPU_SHAPE, "cuda")
    began = time.perf_counter()
    rows = [train(offload, shape, device) for offload in (False, True)]
    plain, offloaded = (row["losses"] for row in rows)
    differences = [abs(a - b) / abs(a) for a, b in zip(plain, offloaded)]
    worst = max(differences)
    agree = len(plain) == len(offloaded) == STEPS and differences[0] <= FIRST_STEP_TOLERANCE and worst <= TOLERANCE
    machine = torch.cuda.get_device_name() if device == "cuda" else "CPU (SMOKE TEST, not GPU results)"
    verdict = (
        f"losses {'agree' if agree else 'DISAGREE'}: largest relative difference {worst:.2e} over {len(plain)} "
        f"steps (at most {TOLERANCE:g}, the first step's {FIRST_STEP_TOLERANCE:g}); final loss {plain[-1]:.4f} "
        f"without offload, {offloaded[-1]:.4f} with"
    )
    rows[1]["time_vs_no_offload"], rows[0]["time_vs_no_offload"] = rows[1]["ms_per_step"] / rows[0]["ms_per_step"], 1.0
    header = (
        f"# The Trainer with optimizer offload on {machine}\n\n`python benchmarks/gpu_trainer_offload.py"
        f"{' --cpu-smoke' if smoke else ''}` ({time.perf_counter() - began:.0f} s): LowZeroTrainer, ZeRO stage 2, "
        f"bf16, adamw_torch_fused, lr {LR:g} constant, GPT-2 {shape[0]} x {shape[1]}, dropout off, {BATCH} x "
        f"{shape[3]} tokens, {STEPS} steps; step time the median after {WARMUP}.\n\n{verdict}"
    )
    columns = ["setup", "final_loss", "ms_per_step", "time_vs_no_offload", "peak_cuda_GiB"]
    print(write_results("gpu_trainer_offload", rows, columns, header, directory=out))
    print(verdict)
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
