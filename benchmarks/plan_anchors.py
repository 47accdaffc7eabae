"""The plan's predicted throughput against published runs of the same model, batch, sequence and checkpointing.

    python benchmarks/plan_anchors.py               # both anchors: ~10 min of CPU on 2 cores
    python benchmarks/plan_anchors.py --table-only  # the table again, from the plans already kept

Each anchor runs the plan once, in a fresh process::

    python -m hf_lowzero.trainer.plan_cli --model <Llama-3-8B config> --device <device> --world-size <W> \
        --per_device_train_batch_size <batch> --seq-len 8192 --bf16 --gradient_checkpointing --json FILE

and keeps its whole plan in results/plan_anchor_<name>.json. The table (results/plan_anchors.md and
.json) puts the reported tokens/s per GPU beside the plan's for its stage-0 row (the plain Trainer:
every rank holds the model, like DDP) and its stage-2 row (sharded gradients and optimizer state,
the nearest of ours to FSDP). The config is Llama-3-8B's shape (``plan_speed.llama3_8b_config``):
Llama 3.1 8B has the same layers, widths and vocabulary; only its RoPE scaling differs.

The published runs (see ANCHORS for the settings and sources) use torchtitan's selective activation
checkpointing; the plan knows full checkpointing only (``--gradient_checkpointing``), which
recomputes the whole forward: the gap this makes is said in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, write_results  # noqa: E402
from benchmarks.plan_speed import llama3_8b_config  # noqa: E402

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
ANCHORS = {
    "torchtitan Llama-3.1-8B, 8 H100": {
        "flags": ["--device", "H100", "--device-memory", "95GiB", "--world-size", "8",
                  "--per_device_train_batch_size", "2"],
        "reported_tokens_per_s": 5762,
        "settings": "FSDP2, bf16, local batch 2 x 8192, selective (op) activation checkpointing, no compile, "
                    "no float8; H100 SXM with 96 GB HBM2e at 500 W",
        "source": f"{TORCHTITAN} (Table 1, 'FSDP' row; torch of 2024-12-23)",
    },
    "torchtitan Llama-3-8B, 64 A100": {
        "flags": ["--device", "A100-80GB", "--world-size", "64", "--ranks-per-node", "8",
                  "--per_device_train_batch_size", "1"],
        "reported_tokens_per_s": 2904,
        "settings": "FSDP2, bf16, local batch 1 x 8192, selective (layer) activation checkpointing, no compile; "
                    "8 nodes of 8 A100 80GB",
        "source": f"{TORCHTITAN} (an earlier version: 'Llama 3 performance numbers', 56.8% MFU)",
    },
}  # fmt: skip
COMMON = ["--seq-len", "8192", "--bf16", "--gradient_checkpointing"]


def run_plan(name: str, config: Path) -> None:
    """The anchor's plan, in a fresh process, kept in results/plan_anchor_<slug>.json."""
    out = RESULTS / f"plan_anchor_{slug(name)}.json"
    command = [sys.executable, "-m", "hf_lowzero.trainer.plan_cli", "--model", str(config),
               *ANCHORS[name]["flags"], *COMMON, "--json", str(out)]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def rows() -> list[dict]:
    """One row per anchor and stage: reported against predicted tokens/s per GPU."""
    table = []
    for name, anchor in ANCHORS.items():
        kept = RESULTS / f"plan_anchor_{slug(name)}.json"
        if not kept.is_file():  # its plan not run (or not finished) yet
            continue
        plan = json.loads(kept.read_text())
        for setup in plan["rows"]:
            if setup["offload"] or setup["stage"] not in (0, 2) or setup["tokens_per_s"] is None:
                continue
            reported = anchor["reported_tokens_per_s"]
            table.append({
                "anchor": name, "setup": setup["setup"], "fits": setup["fits"],
                "reported_tokens_per_s": reported, "predicted_tokens_per_s": round(setup["tokens_per_s"]),
                "predicted / reported": round(setup["tokens_per_s"] / reported, 2),
                "predicted_mfu": round(setup["mfu"], 3), "comm_hidden": round(setup["comm_hidden"] or 0.0, 2),
            })  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table-only", action="store_true", help="no plan: the table from the kept plans")
    a = parser.parse_args()
    if not a.table_only:
        with tempfile.TemporaryDirectory() as tmp:
            config = llama3_8b_config(Path(tmp) / "llama-3-8b")
            for name in ANCHORS:
                run_plan(name, config)
    header = (
        "# Published anchors: predicted against reported tokens/s per GPU\n\n"
        "`python benchmarks/plan_anchors.py`: the plan of Llama-3-8B's shape, `--seq-len 8192 --bf16 "
        "--gradient_checkpointing` and each anchor's device, world size and batch. Sources and settings:\n\n"
        + "\n".join(f"- **{n}**: {x['settings']}. {x['source']}" for n, x in ANCHORS.items())
    )
    columns = ["anchor", "setup", "fits", "reported_tokens_per_s", "predicted_tokens_per_s", "predicted / reported",
               "predicted_mfu", "comm_hidden"]  # fmt: skip
    print(write_results("plan_anchors", rows(), columns, header))


if __name__ == "__main__":
    main()
