"""A memory snapshot's copy on one GPU: what it stops, and what it costs the step it overlaps.

    python benchmarks/gpu_snapshot.py        # needs a CUDA GPU; writes results/gpu_snapshot.md/.json

GPT-2 124M, bf16, ZeRO stage 2, AdamW, 8 x 512 tokens, world size 1. Interleaved rounds: a step
alone, then ``ShardStager.stage`` (the host's stop: queuing the copy of the fp32 masters and Adam
state, 12 bytes per element, on a side stream into pinned buffers) followed by the next step, which
the copy overlaps, and the host waiting for the copy and reading the buffers (the encoder's part).
Reports the stop, the step with the copy in flight against the step alone, the copy's bandwidth,
and that the snapshot equals the state of the step it was taken at (the next step waited for it).
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

ROUNDS, BATCH, SEQ = 8, 8, 512


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_snapshot.py needs a CUDA GPU; none is visible here")
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_lowzero.checkpoint.save import shard_tensors
    from hf_lowzero.checkpoint.shards import ShardView
    from hf_lowzero.snapshot import ShardStager
    from hf_lowzero.zero.runtime import device as dev

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=SEQ, bos_token_id=0, eos_token_id=0)).cuda().to(torch.bfloat16)
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), fused=True), stage=2)
    x = torch.randint(0, 50257, (BATCH, SEQ), device="cuda")

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(3):
        step()
    stager = ShardStager(opt)
    alone, overlapped, stops, waits, matches = [], [], [], [], []
    nbytes = sum(t.numel() * t.element_size() for t in shard_tensors(ShardView.of(opt))[0].values())
    for _ in range(ROUNDS):
        alone.append(step())
        expected = {k: t.detach().cpu().clone() for k, t in shard_tensors(ShardView.of(opt))[0].items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        staged = stager.stage(step=0)
        stops.append(time.perf_counter() - start)
        overlapped.append(step())
        start = time.perf_counter()
        dev.host_waits(staged.copied)
        waits.append(time.perf_counter() - start)
        matches.append(all(torch.equal(staged.shard[k], v) for k, v in expected.items()))
        staged.release()
    stager.close()
    dist.destroy_process_group()
    median = statistics.median
    rows = [
        {
            "shard_MiB": nbytes / 2**20,
            "stage_stop_ms": 1000 * median(stops),
            "step_alone_ms": 1000 * median(alone),
            "step_with_copy_ms": 1000 * median(overlapped),
            "step_ratio": median(o / a for o, a in zip(overlapped, alone)),
            "copy_left_after_step_ms": 1000 * median(waits),
            "snapshot_equals_its_step": all(matches),
        }
    ]
    header = (
        f"# A memory snapshot's side-stream copy on {torch.cuda.get_device_name()}\n\n`python "
        f"benchmarks/gpu_snapshot.py`: GPT-2 124M bf16, ZeRO stage 2, {ROUNDS} interleaved rounds, medians."
    )
    print(write_results("gpu_snapshot", rows, list(rows[0]), header))
    if not all(matches):
        raise SystemExit("a snapshot differs from the state of the step it was taken at")


if __name__ == "__main__":
    main()
