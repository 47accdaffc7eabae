"""What the divide pass costs where the collective cannot divide (gloo): packing a bucket with and
without ``flat.div_(W)``, on CPU, one thread.

    python benchmarks/divide_pass.py        # ~20 s; results/divide_pass.{md,json}

On NCCL the reduce-scatter averages itself (``PREMUL_SUM`` with 1/W, [Note: the divide in the
collective] in ``hf_lowzero/zero/runtime/comm.py``), so the pass is gone there. Gloo has no such op, so the
packed bucket is divided before it is sent. This times exactly that: the packing kernel
(``torch._chunk_cat`` of GPT-2 4x256's gradients into one rank-major bucket of W=2, as
``pack_bucket`` does) alone and followed by the divide, interleaved over rounds, and reports the
divide's share of a CPU training step measured in the same run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import gpt2, write_results  # noqa: E402

ROUNDS, REPEATS, W = 15, 10, 2


def _ms(fn, repeats: int = REPEATS) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) * 1000 / repeats


def main() -> None:
    torch.set_num_threads(1)
    model = gpt2(4, 256, dropout=0.0)
    x = torch.randint(0, 8192, (8, 128))
    grads = [torch.randn_like(p).reshape(-1) for p in model.parameters()]
    numel = sum(-(-g.numel() // W) * W for g in grads)
    flat = torch.empty(numel)

    def pack():
        torch._chunk_cat(grads, dim=0, num_chunks=W, out=flat.view(W, numel // W))

    def pack_divide():
        pack()
        flat.div_(W)

    def train_step():
        model(input_ids=x, labels=x).loss.backward()

    pack_ms, divide_ms, step_ms = [], [], []
    for _ in range(ROUNDS):
        a, b = _ms(pack), _ms(pack_divide)
        pack_ms.append(a)
        divide_ms.append(b - a)
        step_ms.append(_ms(train_step, 2))
    row = {
        "bucket_MB": round(numel * 4 / 1e6, 1),
        "ms_pack": round(statistics.median(pack_ms), 2),
        "ms_divide": round(statistics.median(divide_ms), 2),
        "divide_vs_pack": round(statistics.median(d / p for d, p in zip(divide_ms, pack_ms)), 2),
        "ms_forward_backward": round(statistics.median(step_ms), 1),
        "divide_share_of_step": round(statistics.median(d / s for d, s in zip(divide_ms, step_ms)), 3),
    }
    print(row)
    write_results(
        "divide_pass",
        [row],
        list(row),
        header=(
            "# The divide pass on gloo\n\n"
            f"`python benchmarks/divide_pass.py`: GPT-2 4x256 (5.6M params), CPU, 1 thread, W={W}; "
            f"{ROUNDS} interleaved rounds (medians). `ms_divide`: `flat.div_(W)` after packing the bucket; "
            "`divide_share_of_step`: that against one forward and backward of a batch of 8x128 measured "
            "in the same rounds. On NCCL the collective divides (PREMUL_SUM) and this pass is gone."
        ),
    )


if __name__ == "__main__":
    main()
