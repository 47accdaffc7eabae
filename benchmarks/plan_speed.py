"""How long the plan takes for Llama-3-8B on 16 GPUs in 2 nodes, with and without gradient checkpointing.

    python benchmarks/plan_speed.py                          # ~5 min on a loaded 2-core machine
    python benchmarks/plan_speed.py --baseline 484066c       # also the plan at that commit, in the same run

Each case runs the user's command in a fresh process and times it from start to exit::

    python -m hf_lowzero.trainer.plan_cli --model <Llama-3-8B config> --world-size 16 --ranks-per-node 8 \
        --device-memory 80GiB --seq-len 2048 --bf16 [--gradient_checkpointing]

The config is built here (transformers' ``LlamaConfig`` in Llama-3-8B's shape: 32 layers, 4096 wide,
14336 in the MLP, 32 heads, 8 KV heads, a 128256-token vocabulary); nothing is downloaded. The batch
is the Trainer's default (8 per device). The target (issue 56): under 120 s each.

With ``--baseline REF`` the same commands run at commit ``REF`` too (a temporary ``git worktree``;
before the command moved to ``trainer/`` it was ``python -m hf_lowzero.plan``), each killed after
``--timeout`` seconds (then the ratio is at least that time over now's). The table then gives the
ratio baseline / now and whether both plans give the same peak per setup. ``--cases`` times some
cases only; the others keep their rows from the last run.

Writes results/plan_speed.md and results/plan_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, write_results  # noqa: E402
from hf_lowzero.process_guard import run_tied  # noqa: E402

FLAGS = ["--world-size", "16", "--ranks-per-node", "8", "--device-memory", "80GiB", "--seq-len", "2048", "--bf16"]
CASES = {
    "no checkpointing": [],
    "gradient checkpointing": ["--gradient_checkpointing"],
    # one sample: the two peaks the largest batch is drawn through are the update's (issue 56)
    "gradient checkpointing, batch 1": ["--gradient_checkpointing", "--per_device_train_batch_size", "1"],
}
TARGET_S = 120


def llama3_8b_config(folder: Path) -> Path:
    """Llama-3-8B's config.json, written into ``folder``."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)  # fmt: skip
    return folder / "config.json"


def time_plan(checkout: Path, config: Path, flags: list[str], timeout: float, out: Path) -> dict:
    """Run the plan's command of ``checkout`` once: wall and CPU seconds (its processes together),
    exit status, the peaks per setup."""
    module = (
        "hf_lowzero.trainer.plan_cli" if (checkout / "hf_lowzero/trainer/plan_cli.py").is_file() else "hf_lowzero.plan"
    )
    command = [sys.executable, "-m", module, "--model", str(config), *FLAGS, *flags, "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cpu_before, start = _children_cpu(), time.perf_counter()
    try:
        done = run_tied(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "cpu_seconds": None, "status": f"killed after {timeout:.0f} s", "peaks": {}}
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu_before
    if done.returncode not in (0, 1):  # 1: nothing fits, a plan all the same
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    plan = json.loads(out.read_text())
    peaks = {row["label"]: row["peak_bytes"] for row in plan["rows"]}
    best = plan.get("recommended") or {}
    timed = {"seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "status": "done", "peaks": peaks}
    return timed | {"recommended": best.get("label"), "max_batch_size": best.get("max_batch_size"), "text": done.stdout}


def _children_cpu() -> float:
    """CPU seconds of this process's ended children and theirs (user and system)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def row_of(name: str, case: dict) -> dict:
    """A case's row in the table, from its timings (``case["now"]``, and ``case["baseline"]`` if timed)."""
    now = case["now"]
    row = {"case": name, "seconds": now["seconds"], "CPU seconds": now["cpu_seconds"]}
    row[f"under {TARGET_S} s"] = now["seconds"] is not None and now["seconds"] < TARGET_S
    row |= {"recommended": now.get("recommended"), "its largest batch": now.get("max_batch_size")}
    before = case.get("baseline")
    if before is not None:
        row["baseline s"] = before["seconds"] or before["status"]
        row["baseline CPU s"] = before["cpu_seconds"] or "-"
        if before["seconds"]:
            row["baseline / now"] = round(before["seconds"] / now["seconds"], 2)
        else:  # killed: at least the time it ran
            row["baseline / now"] = f">= {float(before['status'].split()[2]) / now['seconds']:.2f}"
        row["same peaks"] = before["peaks"] == now["peaks"] if before["peaks"] else "-"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="a git commit to time the plan at too (same run)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the baseline's plan is killed (600)")
    parser.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="the cases to time (default: all); the "
        "others keep their rows from the last run",
    )  # fmt: skip
    a = parser.parse_args()
    load = os.getloadavg()[0]
    saved = RESULTS / "plan_speed.json"
    data = json.loads(saved.read_text()) if saved.is_file() and a.cases != list(CASES) else {"cases": {}}
    data |= {"flags": FLAGS, "target_s": TARGET_S}
    with tempfile.TemporaryDirectory(prefix="plan_speed_") as tmp:
        tmp = Path(tmp)
        config = llama3_8b_config(tmp / "llama-3-8b")
        baseline = None
        if a.baseline:
            baseline = tmp / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(baseline), a.baseline], cwd=ROOT, check=True)
        try:
            for name in a.cases:
                case = {"now": time_plan(ROOT, config, CASES[name], 3600, tmp / "now.json"), "load": load}
                if baseline is not None:
                    case["baseline"] = time_plan(baseline, config, CASES[name], a.timeout, tmp / "before.json")
                    case["baseline_ref"] = a.baseline
                data["cases"][name] = case
                print(row_of(name, case), flush=True)
        finally:
            if baseline is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
    print(render(data))


def render(data: dict) -> str:
    """results/plan_speed.md from the cases timed (``data["cases"]``, this run's and earlier ones')."""
    rows = [row_of(name, data["cases"][name]) for name in CASES if name in data["cases"]]
    runs = "; ".join(
        f"{name}: load average {case['load']:.1f} at the start, baseline {case.get('baseline_ref', '-')}"
        for name, case in data["cases"].items()
    )
    header = (
        "# How long the plan takes: Llama-3-8B, 16 GPUs in 2 nodes\n\n`python benchmarks/plan_speed.py "
        "[--baseline REF] [--cases ...]`, on "
        + f"{os.cpu_count()} CPU cores. Each: `python -m hf_lowzero.trainer.plan_cli --model <Llama-3-8B config> "
        + " ".join(FLAGS)
        + " [flags of the case]`, wall-clock seconds from start to exit, in a fresh process; CPU seconds: "
        "its processes' together (user and system), what a loaded machine's other work does not change. "
        f"The runs: {runs}."
    )
    footer = "\n" + "".join(f"\n- {note}" for note in data.get("notes", [])) + "\n"
    columns = list(dict.fromkeys(column for row in rows for column in row))
    rows = [{column: row.get(column, "-") for column in columns} for row in rows]  # a case timed without a baseline
    return write_results("plan_speed", rows, columns, header, footer, data=data)


if __name__ == "__main__":
    main()
