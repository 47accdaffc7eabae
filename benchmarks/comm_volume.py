"""Bytes each rank sends per optimizer step, by collective, against the theoretical minimum.

    python benchmarks/comm_volume.py       # world sizes 2 and 4; stage 1 and 2; 1 and 4 micro-batches

Counted in hf_lowzero.zero.comm (ring-algorithm bytes: all-reduce sends 2(W-1)/W of its payload,
reduce-scatter and all-gather (W-1)/W). The minimum for one data-parallel step is
2Ψ(W-1)/W elements (a reduce-scatter of the gradients plus an all-gather of the params).
Writes results/comm_volume.md and results/comm_volume.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.zero.comm import comm_stats  # noqa: E402


def body(rank: int, world_size: int, out: str) -> None:
    rows = []
    for stage in (1, 2):
        for micro in (1, 4):
            model = gpt2(2, 256)
            psi = sum(p.numel() for p in model.parameters())
            opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=stage)
            comm_stats.reset()
            for i in range(micro):
                x = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(10 * rank + i))
                local = opt.no_sync() if stage == 1 and i < micro - 1 else contextlib.nullcontext()
                with local:
                    opt.backward(model(input_ids=x, labels=x).loss / micro)
            opt.step()
            minimum = 2 * psi * (world_size - 1) / world_size * 4  # fp32 elements -> bytes
            sent = sum(comm_stats.sent_bytes.values())
            rows.append({
                "world_size": world_size, "stage": stage, "micro_batches": micro, "params_M": psi / 1e6,
                "all_reduce_MiB": comm_stats.sent_bytes["all_reduce"] / 2**20,
                "reduce_scatter_MiB": comm_stats.sent_bytes["reduce_scatter"] / 2**20,
                "all_gather_MiB": comm_stats.sent_bytes["all_gather"] / 2**20,
                "sent_MiB": sent / 2**20, "minimum_MiB": minimum / 2**20, "vs_minimum": sent / minimum,
            })  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for world in (2, 4):
        rows += collect(body, world)
    cols = ["world_size", "stage", "micro_batches", "params_M", "all_reduce_MiB", "reduce_scatter_MiB",
            "all_gather_MiB", "sent_MiB", "minimum_MiB", "vs_minimum"]  # fmt: skip
    header = (
        "# Bytes sent per rank per optimizer step (GPT-2 2x256, fp32)\n\n"
        "`python benchmarks/comm_volume.py`; minimum = 2Ψ(W-1)/W elements."
    )
    print(write_results("comm_volume", rows, cols, header))


if __name__ == "__main__":
    main()
