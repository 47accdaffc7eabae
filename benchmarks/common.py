"""Shared pieces of the benchmarks: models, the ZeRO/DDP/... setups, result tables."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch
from torch import nn

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


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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
