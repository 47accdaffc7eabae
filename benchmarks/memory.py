"""Per-rank memory of DDP vs ZeRO stage 1 and 2, against the ZeRO formulas.

    python benchmarks/memory.py                  # all three tables (~30 min on 2 cores, mostly the 124M one)
    python benchmarks/memory.py --part formula   # world sizes 1, 2, 4; fp32 and bf16; ~23M-param GPT-2
    python benchmarks/memory.py --part peak      # peak RSS while training, GPT-2 124M shape, W = 2, 4
    python benchmarks/memory.py --part baselines # peak RSS: ours vs DDP, DeepSpeed, FSDP2, ZeRO-O; ~4 min
    python benchmarks/memory.py --part states    # bytes/param: AdamW fp32 vs 8-bit states (torchao, bnb); ~1 min

Model-state bytes come from the live tensors after two training steps, with the gradients of the
next backward held (params + gradients + optimizer state, master rows included; for DDP its
params, .grad and AdamW state, not its reducer buckets). comm_buffers_MiB is ZeRO's pooled
communication scratch (reported by memory_report(), bounded by the buckets in flight). peak_train_rss_MiB
is the process's peak resident memory over the two steps (2 micro-batches each, the first under
no_sync() for DDP and stage 1, as Trainer runs them), measured from a VmHWM reset taken after the
model is built: torch runtime and params included, import and init transients not; peak_vs_ddp
divides it by DDP's. The baselines table measures that peak for every setup of
``benchmarks.common.Setup`` (DDP with default and fused AdamW, ZeroRedundancyOptimizer, FSDP2,
DeepSpeed ZeRO-1/2, ours), the largest over ranks; DeepSpeed is skipped, with a printed line, when
it is not installed, and imported (and its process group adopted) before the peak window opens,
as torch and transformers are. The formulas, with Adam (K = 12 bytes/param: fp32
master + 2 moments) and p bytes per param: DDP (fp32) 16Ψ; stage 1 and stage 2 pΨ + 16Ψ/W (fp32
gradient rows; both reduce-scatter); stage 1 while accumulating under no_sync() 2pΨ + 16Ψ/W (the
full local gradients). "frozen" freezes all but the attention projections (a LoRA-like Ψ_t of
trainable params): pΨ + 16Ψ_t/W, frozen params add nothing to gradients or optimizer state.
Writes results/memory.{md,json,png}, results/memory_peak.* and results/memory_baselines.*.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from benchmarks.common import (  # noqa: E402
    RESULTS,
    SETUPS,
    Setup,
    bar_plot,
    collect,
    deepspeed_missing,
    gpt2,
    peak_rss_bytes,
    reset_peak_rss,
    write_results,
)
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.zero.runtime.comm import all_gather_object  # noqa: E402
from hf_lowzero.zero.runtime.memory import tensor_bytes  # noqa: E402

SMALL = (6, 512, 8192)  # n_layer, n_embd, vocab: ~23M params, for the formula table
GPT2_124M = (12, 768, 50257)  # the GPT-2 124M shape, for the peak-RSS table
STEPS = 2  # optimizer steps, each of 2 micro-batches (gradient accumulation)


def formula(mode: str, dtype: str, psi: int, trainable: int, world: int) -> float:
    p = 2 if dtype == "bf16" else 4  # bytes of a param (and of its full gradient)
    if mode == "ddp":
        return 16 * psi  # fp32 params, fp32 grads, AdamW's two fp32 moments
    full_grads = p * psi if mode == "zero1_no_sync" else 0  # accumulating locally: full gradients
    return p * psi + full_grads + 16 * trainable / world  # params + (fp32 grad rows + master + moments) / W


def body(rank: int, world_size: int, mode: str, dtype: str, out: str, size: tuple[int, int, int] = SMALL) -> None:
    model = gpt2(*size)
    if mode == "zero2_frozen":
        for name, p in model.named_parameters():
            p.requires_grad_("attn.c_attn" in name)
    psi = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    xs = [torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(rank + 10 * i)) for i in range(2)]
    if dtype == "bf16":
        model.bfloat16()
    reset_peak_rss()  # the training peak: wrapping, optimizer state, buckets, activations
    if mode == "ddp":
        module = DDP(model)
        opt = torch.optim.AdamW(module.parameters())
        backward, no_sync = (lambda loss: loss.backward()), module.no_sync
    else:
        module = model
        opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(p for p in model.parameters() if p.requires_grad),
                                    stage=int(mode[4]))  # fmt: skip
        backward = opt.backward
        no_sync = opt.no_sync if mode.startswith("zero1") else contextlib.nullcontext
    for _ in range(STEPS):  # ACCUMULATION micro-batches per step; the first ones under no_sync
        for i, x in enumerate(xs):
            with no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
                backward(module(input_ids=x, labels=x).loss / len(xs))
        opt.step()
        opt.zero_grad()
    peak = peak_rss_bytes()
    # Model states with the gradients of a next backward held (under no_sync for "zero1_no_sync").
    with no_sync() if mode == "zero1_no_sync" else contextlib.nullcontext():
        backward(module(input_ids=xs[0], labels=xs[0]).loss)
    comm = 0
    if mode == "ddp":
        states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        model_state = (
            tensor_bytes(model.parameters()) + tensor_bytes(p.grad for p in model.parameters()) + tensor_bytes(states)
        )
    else:
        report = opt.memory_report()
        model_state, comm = report.model_state_bytes, report.comm_buffers
    if rank == 0:
        row = {
            "mode": mode, "dtype": dtype if mode != "ddp" else "fp32", "world_size": world_size, "params_M": psi / 1e6,
            "trainable_M": trainable / 1e6, "model_state_MiB": model_state / 2**20,
            "formula_MiB": formula(mode, dtype, psi, trainable, world_size) / 2**20, "comm_buffers_MiB": comm / 2**20,
            "peak_train_rss_MiB": peak / 2**20,
        }  # fmt: skip
        Path(out).write_text(json.dumps(row))


def run(world: int, mode: str, dtype: str, size: tuple[int, int, int], rows: list[dict]) -> dict:
    row = collect(body, world, mode=mode, dtype=dtype, size=size)
    ddp = next((r for r in rows if r["mode"] == "ddp" and r["world_size"] == world), row)
    row["vs_ddp"] = row["model_state_MiB"] / ddp["model_state_MiB"]
    row["vs_formula"] = row["model_state_MiB"] / row["formula_MiB"]
    row["peak_vs_ddp"] = row["peak_train_rss_MiB"] / ddp["peak_train_rss_MiB"]
    rows.append(row)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description="Per-rank memory of DDP vs ZeRO stage 1 and 2")
    parser.add_argument("--part", choices=["formula", "peak", "baselines", "states", "all"], default="all")
    part = parser.parse_args().part
    RESULTS.mkdir(exist_ok=True)
    if part in ("formula", "all"):
        formula_table()
    if part in ("peak", "all"):
        peak_table()
    if part in ("baselines", "all"):
        baselines_table()
    if part in ("states", "all"):
        states_table()


STATE_KINDS = {  # optimizer -> (package it needs, bytes of state per element: the formula's K)
    "adamw_fp32": (None, 8.0),
    "adamw_8bit_torchao": ("torchao", 2.0),
    "adamw_8bit_bnb": ("bitsandbytes", 2.0),
}


def state_inner(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adamw_8bit_torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=1e-3)
    if kind == "adamw_8bit_bnb":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


STATE_MODELS = {  # name: (n_layer, n_embd, vocab)
    "gpt2_2x256_v8192": (2, 256, 8192),  # the tied embedding is 57% of the params: one tensor > total/W
    "gpt2_4x256_v1024": (4, 256, 1024),  # no tensor over 8% of the params
}


def states_body(rank: int, world_size: int, kind: str, mode: str, model_name: str, out: str) -> None:
    n_layer, n_embd, vocab = STATE_MODELS[model_name]
    model = gpt2(n_layer, n_embd, vocab=vocab)
    psi = sum(p.numel() for p in model.parameters())
    if mode == "ddp":
        ddp = DDP(model)
        opt = state_inner(kind, list(model.parameters()))
        state_of, zero = opt.state, None
    else:
        zero = LowLevelZeroOptimizer(model, state_inner(kind, list(model.parameters())), stage=2)
        state_of = zero.optim.state
    for step in range(STEPS):
        x = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(rank + 10 * step))
        if zero is None:
            ddp(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            zero.backward(model(input_ids=x, labels=x).loss)
            zero.step()
            zero.zero_grad()
    state = tensor_bytes(v for e in state_of.values() for v in e.values() if isinstance(v, torch.Tensor))
    if zero is None:
        held = tensor_bytes(model.parameters()) * 2 + state  # params + their gradients (at backward) + state
    else:
        report = zero.memory_report()
        held = report.params + report.master_rows + report.grad_buffers + state
    per_rank = all_gather_object((state, held), None)
    if rank == 0:
        k = STATE_KINDS[kind][1]
        formula = 4 + 4 + k if mode == "ddp" else 4 + (4 + 4 + k) / world_size  # fp32 params, master, grad rows
        worst_state, worst_held = max(s for s, _ in per_rank), max(h for _, h in per_rank)
        Path(out).write_text(json.dumps({
            "model": model_name, "optimizer": kind, "mode": mode, "world_size": world_size, "params_M": psi / 1e6,
            "state_B_per_param": worst_state / psi, "model_state_B_per_param": worst_held / psi,
            "formula_B_per_param": formula, "vs_formula": worst_held / psi / formula,
        }))  # fmt: skip


def states_table() -> None:
    rows: list[dict] = []
    for model_name in STATE_MODELS:
        for kind, (package, _) in STATE_KINDS.items():
            if package and importlib.util.find_spec(package) is None:
                print(f"{kind}: skipped, {package} is not installed (pip install -e .[test])", flush=True)
                continue
            for world in (1, 2, 4):
                for mode in ("ddp", "zero2"):
                    row = collect(states_body, world, kind=kind, mode=mode, model_name=model_name)
                    key = (model_name, kind, "ddp", world)
                    same = [r for r in rows if (r["model"], r["optimizer"], r["mode"], r["world_size"]) == key]
                    row["vs_ddp"] = row["model_state_B_per_param"] / (same or [row])[0]["model_state_B_per_param"]
                    rows.append(row)
                    print(row, flush=True)
    header = (
        "# Bytes per parameter per rank: AdamW fp32 states against 8-bit states, DDP against ZeRO-2\n\n"
        "`python benchmarks/memory.py --part states`: fp32 params, 2 steps; the largest rank. model_state = params\n"
        "+ gradients (DDP: full `.grad`; ZeRO-2: fp32 gradient rows) + fp32 master rows (ZeRO) + optimizer state.\n"
        "Formula: DDP 4 + 4 + K, ZeRO-2 4 + (4 + 4 + K)/W, with K = 8 bytes of AdamW state per element, 2 for\n"
        "8-bit states (plus block scales; bitsandbytes keeps tensors under 4096 elements in 32 bits). 8-bit\n"
        "optimizers get whole-parameter ownership: the largest rank holds at least the largest tensor. On\n"
        "gpt2_2x256_v8192 that is the 8192x256 tied embedding, 57% of the params, so that rank sits above the\n"
        "formula at W=2 and 4; on gpt2_4x256_v1024 no tensor holds more than 8%."
    )
    cols = ["model", "optimizer", "mode", "world_size", "params_M", "state_B_per_param", "model_state_B_per_param"]
    print(write_results("memory_states", rows, cols + ["formula_B_per_param", "vs_formula", "vs_ddp"], header))


def formula_table() -> None:
    modes = [("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("zero1_no_sync", "fp32")]
    modes += [("zero2_frozen", "fp32"), ("zero1", "bf16"), ("zero2", "bf16")]
    rows: list[dict] = []
    for world in (1, 2, 4):
        for mode, dtype in modes:
            run(world, mode, dtype, SMALL, rows)
    cols = ["mode", "dtype", "world_size", "params_M", "trainable_M", "model_state_MiB", "formula_MiB"]
    cols += ["vs_formula", "vs_ddp", "comm_buffers_MiB", "peak_train_rss_MiB", "peak_vs_ddp"]
    n_layer, n_embd, _ = SMALL
    header = (
        f"# Per-rank memory, GPT-2 {n_layer}x{n_embd} (AdamW), after two steps, gradients held\n\n"
        "`python benchmarks/memory.py`; vs_ddp = model-state bytes / DDP's at the same world size."
    )
    print(write_results("memory", rows, cols, header))
    plot(rows)


def peak_table() -> None:
    peak_rows: list[dict] = []
    for world in (2, 4):
        for mode, dtype in [("ddp", "fp32"), ("zero1", "fp32"), ("zero2", "fp32"), ("zero2", "bf16")]:
            run(world, mode, dtype, GPT2_124M, peak_rows)
    header = (
        "# Peak resident memory per rank while training, GPT-2 124M shape (AdamW, 2 micro-batches per step)\n\n"
        "`python benchmarks/memory.py`; peak_vs_ddp = peak_train_rss_MiB / DDP's at the same world size "
        "(whole process: ~480 MiB of torch/transformers runtime included in every row)."
    )
    cols = ["mode", "dtype", "world_size", "params_M", "model_state_MiB", "formula_MiB", "comm_buffers_MiB"]
    print(write_results("memory_peak", peak_rows, cols + ["peak_train_rss_MiB", "peak_vs_ddp"], header))
    bar_plot(
        RESULTS / "memory_peak.png",
        [f"W={r['world_size']} {r['mode']} {r['dtype']}" for r in peak_rows],
        [r["peak_vs_ddp"] for r in peak_rows],
        xlabel="peak RSS per rank while training / DDP's (lower is less memory)",
        title="GPT-2 124M shape, CPU/gloo",
    )


def baseline_body(rank: int, world_size: int, name: str, out: str) -> None:
    model = gpt2(*SMALL)
    xs = [torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(rank + 10 * i)) for i in range(2)]
    if name.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    reset_peak_rss()  # the training peak: wrapping, optimizer state, buckets, activations
    setup = Setup(name, model, micro=len(xs))
    for _ in range(STEPS):
        setup.step(lambda module, i: module(input_ids=xs[i], labels=xs[i]).loss)
    peak = torch.tensor(peak_rss_bytes())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"setup": name, "world_size": world_size, "peak_train_rss_MiB": peak.item() / 2**20})
        )


def baselines_table() -> None:
    names = SETUPS
    skipped = deepspeed_missing()
    if skipped:
        print(skipped, flush=True)
        names = [n for n in SETUPS if not n.startswith("deepspeed")]
    rows: list[dict] = []
    for world in (2, 4):
        for name in names:
            row = collect(baseline_body, world, name=name)
            ddp = next((r for r in rows if r["setup"] == "ddp" and r["world_size"] == world), row)
            row["peak_vs_ddp"] = row["peak_train_rss_MiB"] / ddp["peak_train_rss_MiB"]
            rows.append(row)
            print(row, flush=True)
    n_layer, n_embd, _ = SMALL
    header = (
        f"# Peak resident memory per rank while training, GPT-2 {n_layer}x{n_embd}, every setup\n\n"
        "`python benchmarks/memory.py --part baselines`: fp32, AdamW, 2 steps of 2 micro-batches; the largest peak "
        "over ranks, from a VmHWM reset after the model is built (and DeepSpeed imported); peak_vs_ddp = "
        "peak_train_rss_MiB / DDP's (default AdamW) at the same world size. "
        + (skipped or "DeepSpeed ZeRO-1/2 with torch AdamW as client optimizer (`benchmarks.common.deepspeed_config`).")
    )
    print(write_results("memory_baselines", rows, ["setup", "world_size", "peak_train_rss_MiB", "peak_vs_ddp"], header))
    bar_plot(
        RESULTS / "memory_baselines.png",
        [f"W={r['world_size']} {r['setup']}" for r in rows],
        [r["peak_vs_ddp"] for r in rows],
        xlabel="peak RSS per rank while training / DDP's (lower is less memory)",
        title=f"GPT-2 {n_layer}x{n_embd}, CPU/gloo",
    )


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
