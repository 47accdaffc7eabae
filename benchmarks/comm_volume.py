"""Bytes each rank sends per optimizer step, by collective, against the theoretical minimum.

    python benchmarks/comm_volume.py       # world sizes 2 and 4; stage 1 and 2; 1 and 4 micro-batches

Counted in hf_lowzero.zero.runtime.comm (ring-algorithm bytes: all-reduce sends 2(W-1)/W of its payload,
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
from hf_lowzero.zero.runtime.comm import all_gather_object, comm_stats  # noqa: E402


def state_bytes(opt: LowLevelZeroOptimizer) -> int:
    return sum(v.numel() * v.element_size() for e in opt.optim.state.values() for v in e.values() if v.dim() > 0)


def body(rank: int, world_size: int, out: str) -> None:
    rows = []
    for partition in ("rows", "params"):
        for stage in (1, 2):
            for micro in (1, 4):
                model = gpt2(2, 256)
                psi = sum(p.numel() for p in model.parameters())
                largest = max(p.numel() for p in model.parameters())
                inner = torch.optim.AdamW(model.parameters())
                opt = LowLevelZeroOptimizer(model, inner, stage=stage, partition=partition)
                comm_stats.reset()
                for i in range(micro):
                    x = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(10 * rank + i))
                    local = opt.no_sync() if stage == 1 and i < micro - 1 else contextlib.nullcontext()
                    with local:
                        opt.backward(model(input_ids=x, labels=x).loss / micro)
                opt.step()
                minimum = 2 * psi * (world_size - 1) / world_size * 4  # fp32 elements -> bytes
                sent = all_gather_object(sum(comm_stats.sent_bytes.values()), None)  # every rank's bytes
                states = all_gather_object(state_bytes(opt), None)
                reduce = comm_stats.sent_bytes["reduce_scatter"] + comm_stats.sent_bytes["reduce_to_owners"]
                gather = comm_stats.sent_bytes["all_gather"] + comm_stats.sent_bytes["gather_from_owners"]
                state_bound = max(1.10 * sum(states) / world_size, 2 * 4 * largest)  # AdamW: 2 fp32 per element
                rows.append({
                    "partition": partition, "world_size": world_size, "stage": stage, "micro_batches": micro,
                    "params_M": psi / 1e6, "all_reduce_MiB": comm_stats.sent_bytes["all_reduce"] / 2**20,
                    "reduce_MiB": reduce / 2**20, "gather_MiB": gather / 2**20,
                    "sent_MiB": sum(sent) / world_size / 2**20, "max_rank_sent_MiB": max(sent) / 2**20,
                    "minimum_MiB": minimum / 2**20, "vs_minimum": sum(sent) / world_size / minimum,
                    "max_rank_vs_minimum": max(sent) / minimum,
                    "max_rank_state_MiB": max(states) / 2**20, "state_per_rank_MiB": sum(states) / world_size / 2**20,
                    "state_vs_bound": max(states) / state_bound,
                })  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for world in (2, 4):
        rows += collect(body, world)
    cols = ["partition", "world_size", "stage", "micro_batches", "params_M", "reduce_MiB", "gather_MiB",
            "sent_MiB", "max_rank_sent_MiB", "minimum_MiB", "vs_minimum", "max_rank_vs_minimum",
            "max_rank_state_MiB", "state_per_rank_MiB", "state_vs_bound"]  # fmt: skip
    header = (
        "# Bytes sent per rank per optimizer step, and optimizer state per rank (GPT-2 2x256, fp32, AdamW)\n\n"
        "`python benchmarks/comm_volume.py`; minimum = 2Ψ(W-1)/W elements per rank. `sent_MiB` is the mean over\n"
        "ranks (row shards: every rank sends the same), `max_rank_sent_MiB` the busiest rank's. With whole\n"
        "params (`partition=params`) a gradient goes only to its owner and an update only from it, point to\n"
        "point: the ranks' total is the minimum; the owner of the largest tensor (the tied 8192x256\n"
        "embedding, 57% of the model at W=4) sends its update to every peer. `state_vs_bound`: the largest\n"
        "rank's AdamW state against max(1.10 x total/W, the largest tensor's state).\n\n"
        "Row shards at stage 2 with 4 micro-batches reduce every micro-batch (2.5x): the price of never\n"
        "holding a full gradient."
    )
    print(write_results("comm_volume", rows, cols, header))


if __name__ == "__main__":
    main()
