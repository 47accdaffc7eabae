"""Shared pieces of the benchmarks: models, the ZeRO/DDP/... setups, result tables."""

from __future__ import annotations

import contextlib
import gc
import json
import resource
import tempfile
from pathlib import Path

import torch
from torch import nn

from hf_lowzero.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def gpt2(n_layer: int, n_embd: int, vocab: int = 8192, seed: int = 0):
    """A GPT-2 built from a config (no download). n_layer=6, n_embd=512 is ~23M params."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=8, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


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


def write_results(name: str, rows: list[dict], columns: list[str], header: str) -> str:
    RESULTS.mkdir(exist_ok=True)
    table = markdown_table(rows, columns)
    (RESULTS / f"{name}.md").write_text(f"{header}\n\n{table}")
    (RESULTS / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return table


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
