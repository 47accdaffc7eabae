"""Shared pieces of the benchmarks: models, the ZeRO/DDP/DeepSpeed/... setups, result tables."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
# DeepSpeed picks its accelerator at import; without a GPU it must be told (and we never want CUDA).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
INSTALL_BENCH = 'pip install -c constraints.txt -e ".[bench]"'


def gpt2(n_layer: int, n_embd: int, vocab: int = 8192, seed: int = 0, dropout: float = 0.1):
    """A GPT-2 built from a config (no download). n_layer=6, n_embd=512 is ~23M params.
    ``dropout=0.0`` makes training deterministic, so that setups can be compared param for param."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=8, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def gpt2_on(
    device, n_layer: int, n_embd: int, n_head: int, seq: int, vocab: int = 50257, dtype=torch.bfloat16, dropout=0.1
):
    """A GPT-2 of that shape built in ``dtype`` straight on ``device`` (no download): a model too big
    for a GPU fails there, not in host memory. (24, 2048, 16) is the 1.2B of ``offload.py``;
    ``dropout=0.0`` makes two runs of the same seed and data comparable step by step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, vocab_size=vocab, bos_token_id=0,
        eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return GPT2LMHeadModel(config)
    finally:
        torch.set_default_dtype(previous)


class ManySmall(nn.Module):
    """Hundreds of tiny parameters: exposes per-parameter hook and bookkeeping overhead."""

    def __init__(self, layers: int = 300, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def deepspeed_missing() -> str | None:
    """None when DeepSpeed imports; else the line to print: its setups are skipped, and how to get it."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return f"DeepSpeed skipped ({e}); install it with: {INSTALL_BENCH}"
    return None


def deepspeed_config(stage: int, micro: int) -> dict:
    """DeepSpeed ZeRO stage 1/2 in fp32, as the other setups train: no clipping, no loss scaling,
    ``micro`` micro-batches per optimizer step; bucket sizes and overlap at DeepSpeed's defaults."""
    return {
        # DeepSpeed reads the batch size only for its own data loader and throughput log; we feed the batches.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**30,
    }


SETUPS = ["ddp", "ddp_fused", "zero_redundancy", "fsdp2", "deepspeed1", "deepspeed2", "zero1", "zero2"]


class Setup:
    """One way to train ``model`` on the current process group, ``micro`` micro-batches per step.

    ``ddp``: DDP + ``torch.optim.AdamW(params)`` as a user writes it (on CPU torch's default kernel
    is the for-loop); ``ddp_fused``: the same with ``fused=True``, the kernel ZeRO uses on its host
    rows; ``zero_redundancy``: DDP + torch's ``ZeroRedundancyOptimizer`` over AdamW; ``fsdp2``:
    ``fully_shard`` on each GPT-2 block, then the root (ZeRO-3: params resharded after forward);
    ``deepspeed1``/``deepspeed2``: a DeepSpeed engine, ZeRO stage 1/2, torch AdamW as its client
    optimizer (:func:`deepspeed_config`); ``zero1``/``zero2``: ours with the optimizer API's
    defaults (the all-gather waited in the step; ``zero_config``: ZeroConfig fields besides the
    stage, ``{"overlap_allgather": True}`` for the Trainer's overlap). Every one runs AdamW with its
    default hyperparameters in fp32 without clipping. Accumulating, DDP-based setups and stage 1
    run the first micro-batches under ``no_sync``; FSDP2 and stage 2 reduce-scatter every one;
    DeepSpeed decides itself (``gradient_accumulation_steps``, ``engine.step()`` per micro-batch).

    Example::

        setup = Setup("deepspeed2", gpt2(4, 256), micro=4)
        setup.step(lambda module, i: module(input_ids=xs[i], labels=xs[i]).loss)
    """

    def __init__(self, name: str, model: nn.Module, micro: int, zero_config: dict | None = None) -> None:
        if name not in SETUPS:
            raise ValueError(f"unknown setup {name!r}; expected one of {SETUPS}")
        self.name, self.model, self.micro = name, model, micro
        self.no_sync = contextlib.nullcontext
        self.finish = self._optimizer_step
        if name in ("ddp", "ddp_fused", "zero_redundancy"):
            self.module = DDP(model)
            self.no_sync = self.module.no_sync
            if name == "zero_redundancy":
                self.opt = ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=torch.optim.AdamW)
            else:
                fused = {"fused": True} if name == "ddp_fused" else {}
                self.opt = torch.optim.AdamW(self.module.parameters(), **fused)
            self.backward = lambda loss: loss.backward()
        elif name == "fsdp2":
            mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
            for block in getattr(getattr(model, "transformer", None), "h", []):
                fully_shard(block, mesh=mesh)
            self.module = fully_shard(model, mesh=mesh)
            self.opt = torch.optim.AdamW(model.parameters())
            self.backward = lambda loss: loss.backward()
        elif name.startswith("deepspeed"):
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group run_distributed made
            config = deepspeed_config(int(name[-1]), micro)
            client = torch.optim.AdamW(model.parameters())
            self.module, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
            self.backward = self._deepspeed_backward
            self.finish = lambda: None  # engine.step() stepped and zeroed at the accumulation boundary
        else:
            stage = int(name[-1])
            self.module = model
            self.opt = LowLevelZeroOptimizer(
                model, torch.optim.AdamW(model.parameters()), stage=stage, **(zero_config or {})
            )
            self.backward = self.opt.backward
            self.no_sync = self.opt.no_sync if stage == 1 else contextlib.nullcontext

    def _optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def _deepspeed_backward(self, loss: torch.Tensor) -> None:
        # step() below already divided the loss by the micro-batch count, as for every setup.
        self.module.backward(loss, scale_wrt_gas=False)
        self.module.step()

    def step(self, loss_of, seconds: list[float] | None = None) -> None:
        """One optimizer step over ``micro`` micro-batches; ``loss_of(module, i)`` is micro-batch i's
        loss. ``seconds``, when given, receives each micro-batch's forward and backward wall time,
        then the optimizer step's."""
        clock = [time.perf_counter()]
        for i in range(self.micro):
            with self.no_sync() if i < self.micro - 1 else contextlib.nullcontext():
                loss = loss_of(self.module, i) / self.micro
                clock.append(time.perf_counter())
                self.backward(loss)
            clock.append(time.perf_counter())
        self.finish()
        clock.append(time.perf_counter())
        if seconds is not None:
            seconds += [end - start for start, end in zip(clock, clock[1:])]

    def full_params(self) -> list[torch.Tensor]:
        """Every param, whole (FSDP2's are gathered: call on all ranks together), in model order;
        ours after their overlapped all-gathers landed ([Note: params are current])."""
        if isinstance(self.opt, LowLevelZeroOptimizer):
            self.opt.wait_for_params()
        return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in self.model.parameters()]


def max_param_diff(a: Setup, b: Setup) -> float:
    """Largest absolute difference between the params of two setups of the same model, over all ranks."""
    diff = max((x - y).abs().max() for x, y in zip(a.full_params(), b.full_params(), strict=True))
    diff = diff.clone()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def interleaved_ms_per_step(
    runs: dict[str, Callable[[], None]],
    rounds: int,
    steps: int,
    warmup: int,
    before: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Time ``runs`` (each call one training step) interleaved, A B A B ...: each runs ``warmup``
    steps, then in each of ``rounds`` rounds each runs ``steps`` steps in turn, every rank starting
    together. Returns, per name, the ms per step of each round. ``before(name)`` runs, untimed,
    ahead of each turn of ``name`` (a variant's switches)."""
    before = before or (lambda name: None)
    for name, run in runs.items():
        before(name)
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            before(name)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                run()
            times[name].append(1000 * (time.perf_counter() - start) / steps)
    return times


def reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM to the current RSS)."""
    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """The process's peak resident memory since :func:`reset_peak_rss` (or since it started)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def collect(body, world_size: int, **kwargs):
    """Run ``body(rank, world_size, out=PATH, **kwargs)`` on ``world_size`` ranks (gloo) and return
    the JSON that rank 0 wrote to ``PATH``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        run_distributed(body, world_size, out=str(out), **kwargs)
        return json.loads(out.read_text())


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(
    name: str,
    rows: list[dict],
    columns: list[str],
    header: str,
    footer: str = "",
    data: object = None,
    directory: Path = RESULTS,
) -> str:
    """``results/NAME.md`` (header, table of ``rows``, footer) and ``results/NAME.json`` (``data``,
    or ``rows`` when None), or the same in ``directory``; returns the table and footer."""
    directory.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, columns)
    (directory / f"{name}.md").write_text(f"{header}\n\n{table}{footer}")
    (directory / f"{name}.json").write_text(json.dumps(rows if data is None else data, indent=1))
    return table + footer


def bar_plot(path: Path, labels: list[str], values: list[float], spans=None, xlabel="", title="", ref=1.0) -> None:
    """A horizontal bar chart (PNG) of ``values`` with optional (low, high) ``spans`` as error bars
    and a reference line at ``ref``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.2))
    xerr = None
    if spans is not None:
        xerr = [[v - lo for v, (lo, _) in zip(values, spans)], [hi - v for v, (_, hi) in zip(values, spans)]]
    ax.barh(labels, values, xerr=xerr, color="tab:blue", ecolor="k")
    if ref is not None:
        ax.axvline(ref, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_plot(path: Path, rows: list[dict], xlabel: str, title: str) -> None:
    """``bar_plot`` of rows of interleaved ratios: ``setup``, ``ratio_median`` and its min-max span."""
    bar_plot(
        path,
        [r["setup"] for r in rows],
        [r["ratio_median"] for r in rows],
        spans=[(r["ratio_min"], r["ratio_max"]) for r in rows],
        xlabel=xlabel,
        title=title,
    )
