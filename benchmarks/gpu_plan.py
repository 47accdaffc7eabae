"""The memory plan against a real step on one GPU: ``torch.cuda.max_memory_allocated``, three setups.

    python benchmarks/gpu_plan.py        # needs a CUDA GPU; writes results/gpu_plan.md/.json

GPT-2 4x512 (vocabulary 8000), bf16, AdamW, 8 x 256 tokens, world size 1: plain DDP's step (stage 0),
ZeRO stage 2, and stage 2 with optimizer offload. The plan is made on fake CUDA tensors (the GPU code
paths, ``[Note: planning on fake GPUs]`` in ``hf_lowzero/plan/simulate.py``); the real step runs the
same code on the GPU. Ratios: planned / measured peak, planned / measured model states and host bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import write_results  # noqa: E402

SETUPS = [(0, False), (2, False), (2, True)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_plan.py needs a CUDA GPU; none is visible here")
    from transformers import GPT2Config

    from hf_lowzero.plan.measure import PlanCase, case_training
    from hf_lowzero.plan.models import ModelSpec
    from hf_lowzero.plan.simulate import Setup, simulate_step

    config = GPT2Config(
        n_layer=4, n_embd=512, n_head=8, vocab_size=8000, n_positions=512, architectures=["GPT2LMHeadModel"]
    )
    spec = ModelSpec.from_source(config)
    training = case_training(PlanCase(bf16=True, batch_size=8))
    planned = {s: simulate_step(spec, training, Setup(*s), 1, 8, 256, backend="nccl") for s in SETUPS}
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    try:
        for setup in SETUPS:
            torch.cuda.empty_cache()
            real = simulate_step(spec, training, Setup(*setup), 1, 8, 256, fake=False)
            plan = planned[setup]
            rows.append(
                {
                    "setup": Setup(*setup).label,
                    "simulated_on": plan.device,
                    "planned_peak_MiB": plan.peak / 2**20,
                    "allocator_peak_MiB": real.allocator_peak / 2**20,
                    "peak_ratio": plan.peak / real.allocator_peak,
                    "model_states_ratio": plan.model_states / real.model_states,
                    "planned_host_MiB": plan.host / 2**20,
                    "measured_host_MiB": real.host / 2**20,
                }
            )
    finally:
        dist.destroy_process_group()
    header = (
        f"# The memory plan on {torch.cuda.get_device_name()}\n\n`python benchmarks/gpu_plan.py`: GPT-2 4x512, "
        "bf16, AdamW, 8 x 256 tokens, W=1; planned on fake CUDA tensors, measured with "
        "torch.cuda.max_memory_allocated over one real step (after a warm-up step)."
    )
    print(write_results("gpu_plan", rows, list(rows[0]), header))


if __name__ == "__main__":
    main()
