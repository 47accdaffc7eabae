"""Checkpoint checksums: what they add to writing and reading one rank's shard file.

    python benchmarks/checkpoint_io.py

One rank's shard of GPT-2 6x512 (~23M params) with AdamW at W=1: master rows, exp_avg and
exp_avg_sq, 69M fp32 elements (265 MiB) in one safetensors file. Save: ``save_file`` + fsync +
rename without checksums, against the same with every tensor's per-chunk CRC-32 in the file's
metadata ([Note: checksums]), as ``save_checkpoint`` writes it. Load: every tensor read as a
slice through ``safe_open`` and copied out (as loading copies slices into rows), against
``ShardReader.read`` (chunk-aligned read, verify, copy out). The file is in the page cache, so
the load ratio is the worst case; a cold read from disk hides more of it. Interleaved A B A B
over ROUNDS rounds; median of the per-round ratios and their spread, and the CRC-32 time alone.

Writes results/checkpoint_io.md and results/checkpoint_io.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.common import gpt2, write_results  # noqa: E402
from hf_lowzero.checkpoint.atomic import atomic_write  # noqa: E402
from hf_lowzero.checkpoint.layout import file_checksums  # noqa: E402
from hf_lowzero.checkpoint.reader import ShardReader  # noqa: E402

ROUNDS = 9


def shard_tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for name, p in gpt2(6, 512).named_parameters():
        row = p.detach().reshape(-1).float()
        tensors[f"master/{name}"] = row.clone()
        tensors[f"state/{name}/exp_avg"] = torch.randn_like(row) * 1e-3
        tensors[f"state/{name}/exp_avg_sq"] = torch.rand_like(row) * 1e-6
    return tensors


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def read_plain(file: Path, tensors: dict) -> None:
    """Each tensor copied out of the (memory-mapped) file, as loading copies slices into rows."""
    with safe_open(str(file), framework="pt") as f:
        for key, t in tensors.items():
            torch.empty(t.numel()).copy_(f.get_slice(key)[0 : t.numel()])


def read_verified(file: Path, tensors: dict) -> None:
    reader = ShardReader(file.parent, {"world_size": 1, "files": {}})
    for key, t in tensors.items():
        torch.empty(t.numel()).copy_(reader.read(file.name, key, [t.numel()], 0, t.numel()))


def main() -> None:
    torch.set_num_threads(1)
    tensors = shard_tensors()
    numel = sum(t.numel() for t in tensors.values())
    rows = {"save": [], "load": []}
    with tempfile.TemporaryDirectory() as tmp:
        plain, summed = Path(tmp) / "plain.safetensors", Path(tmp) / "summed.safetensors"
        checksum_s = min(timed(lambda: file_checksums(tensors)) for _ in range(3))
        for _ in range(ROUNDS):
            a = timed(lambda: atomic_write(plain, lambda f: save_file(tensors, f)))
            b = timed(lambda: atomic_write(summed, lambda f: save_file(tensors, f, metadata=file_checksums(tensors))))
            rows["save"].append((a, b))
            a = timed(lambda: read_plain(plain, tensors))
            b = timed(lambda: read_verified(summed, tensors))
            rows["load"].append((a, b))
        size = summed.stat().st_size
    table = []
    for what, pairs in rows.items():
        ratios = [b / a for a, b in pairs]
        table.append(
            {
                "what": what,
                "without (s)": f"{statistics.median(a for a, _ in pairs):.3f}",
                "with checksums (s)": f"{statistics.median(b for _, b in pairs):.3f}",
                "ratio (median)": f"{statistics.median(ratios):.3f}",
                "ratio spread": f"{min(ratios):.3f}-{max(ratios):.3f}",
            }
        )
    header = (
        f"One shard file: {len(tensors)} tensors, {numel / 1e6:.1f}M fp32 elements, {size / 2**20:.0f} MiB. "
        f"CRC-32 of all of it alone: {checksum_s:.3f} s ({size / checksum_s / 2**30:.1f} GiB/s). "
        f"{ROUNDS} interleaved rounds, 1 thread."
    )
    print(header)
    print(write_results("checkpoint_io", table, list(table[0]), header))


if __name__ == "__main__":
    main()
