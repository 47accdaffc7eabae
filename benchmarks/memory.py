"""Per-rank memory of DDP vs ZeRO stage 1 and 2, against the ZeRO formulas.

    python benchmarks/memory.py            # world sizes 1, 2, 4; fp32 and bf16; ~23M-param GPT-2

Model-state bytes come from the live tensors after one training step (params + gradients +
optimizer state, master rows included; for DDP its params, .grad and AdamW state, not its reducer
buckets). Peak RSS is the whole process (torch runtime included). The formulas, with Adam
(K = 12 bytes/param: fp32 master + 2 moments) and p bytes per param: DDP (fp32) 16Ψ;
stage 1 2pΨ + 12Ψ/W; stage 2 pΨ + 16Ψ/W (fp32 gradient rows). Writes results/memory.md,
results/memory.json and results/memory.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from benchmarks.common import RESULTS, gpt2, peak_rss_bytes, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402
from hf_lowzero.zero.memory import tensor_bytes  # noqa: E402

N_LAYER, N_EMBD = 6, 512


def formula(mode: str, dtype: str, psi: int, world: int) -> float:
    p = 2 if dtype == "bf16" else 4  # bytes of a param (and of its full gradient)
    if mode == "ddp":
        return 16 * psi  # fp32 params, fp32 grads, AdamW's two fp32 moments
    if mode == "zero1":
        return 2 * p * psi + 12 * psi / world  # params + full grads + (master + 2 moments) / W
    return p * psi + 16 * psi / world  # params + (fp32 grad rows + master + 2 moments) / W


def body(rank: int, world_size: int, mode: str, dtype: str, out: str) -> None:
    model = gpt2(N_LAYER, N_EMBD)
    psi = sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(rank))
    if mode == "ddp":
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters())
        ddp(input_ids=x, labels=x).loss.backward()
        opt.step()
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        model_state = (
            tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in model.parameters()) + tensor_bytes(states)
        )
    else:
        if dtype == "bf16":
            model.bfloat16()
        opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=int(mode[-1]))
        opt.backward(model(input_ids=x, labels=x).loss)
        report_after_backward = opt.memory_report()  # stage 2 holds its fp32 gradient rows here
        opt.step()
        model_state = max(report_after_backward.model_state_bytes, opt.memory_report().model_state_bytes)
    if rank == 0:
        row = {
            "mode": mode, "dtype": dtype if mode != "ddp" else "fp32", "world_size": world_size, "params_M": psi / 1e6,
            "model_state_MiB": model_state / 2**20, "formula_MiB": formula(mode, dtype, psi, world_size) / 2**20,
            "peak_rss_MiB": peak_rss_bytes() / 2**20,
        }  # fmt: skip
        Path(out).write_text(json.dumps(row))


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    rows = []
    out = RESULTS / "_row.txt"
    for world in (1, 2, 4):
        for mode, dtype in [
            ("ddp", "fp32"),
            ("zero1", "fp32"),
            ("zero2", "fp32"),
            ("zero1", "bf16"),
            ("zero2", "bf16"),
        ]:
            run_distributed(body, world, mode=mode, dtype=dtype, out=str(out))
            row = json.loads(out.read_text())
            ddp = next((r for r in rows if r["mode"] == "ddp" and r["world_size"] == world), row)
            row["vs_ddp"] = row["model_state_MiB"] / ddp["model_state_MiB"]
            row["vs_formula"] = row["model_state_MiB"] / row["formula_MiB"]
            rows.append(row)
            print(row, flush=True)
    out.unlink()
    cols = [
        "mode",
        "dtype",
        "world_size",
        "params_M",
        "model_state_MiB",
        "formula_MiB",
        "vs_formula",
        "vs_ddp",
        "peak_rss_MiB",
    ]
    header = (
        f"# Per-rank memory, GPT-2 {N_LAYER}x{N_EMBD} (AdamW), after one step\n\n"
        "`python benchmarks/memory.py`; vs_ddp = model-state bytes / DDP's at the same world size."
    )
    print(write_results("memory", rows, cols, header))
    plot(rows)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, dtype in sorted({(r["mode"], r["dtype"]) for r in rows}):
        sel = [r for r in rows if (r["mode"], r["dtype"]) == (mode, dtype)]
        ws = [r["world_size"] for r in sel]
        (line,) = ax.plot(ws, [r["model_state_MiB"] for r in sel], marker="o", label=f"{mode} {dtype} (measured)")
        ax.plot(ws, [r["formula_MiB"] for r in sel], ls="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("world size")
    ax.set_ylabel("model-state MiB per rank")
    ax.set_xticks([1, 2, 4])
    ax.set_title("Per-rank model states (dashed: ZeRO formula)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "memory.png", dpi=120)


if __name__ == "__main__":
    main()
