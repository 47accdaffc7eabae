"""The plan's predicted step time against the GPU benchmarks' measured ones (issue 56: within 15%).

    python benchmarks/gpu_plan_time.py                 # after gpu_single.py, gpu_overlap.py: results/gpu_plan_time.*
    python benchmarks/gpu_plan_time.py --predict-only  # the predictions alone (runs on CPU), printed

The cases, each simulated once on fake GPUs as the plan does (``simulate_step``) and timed for the
device (``--device``, default this machine's GPU, else H100) by ``StepTiming``, the plan's columns:

- ``gpu_single.py``'s Trainer rows: GPT-2 124M, 8 x 512 tokens, bf16, fused AdamW, one GPU: the
  plain Trainer (stage 0, autocast) and ZeRO stage 2;
- ``gpu_overlap.py``'s rank 0 of 2 (the model it took, 4 x 512 tokens, bf16 params, ZeRO stage 2,
  the all-gather overlapped), every collective sleeping for its bytes over each link: one target per
  link, ``--intra-node`` that link and no latency (the emulation sleeps bytes / bandwidth alone);
  and the same model at world size 1.

Measured: those benchmarks' JSON in results/ (``gpu_single.json``'s ``ms_per_step``,
``gpu_overlap.json``'s ``all_ms`` per link and its W=1 step); a case without one is left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, markdown_table, write_results  # noqa: E402

TARGET = 0.15  # issue 56: within 15%
SINGLE = {"shape": (12, 768, 12), "batch": 8, "seq": 512}  # gpu_single.py's GPT-2 124M
OVERLAP = {"shape": (24, 2048, 16), "batch": 4, "seq": 512, "links": (100.0, 50.0, 25.0, 12.5)}  # gpu_overlap.py
SINGLE_SETUPS = {"Trainer, bf16 autocast (plain)": 0, "Trainer, ZeRO stage 2, bf16 params + fp32 masters": 2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One predicted case: its name, the benchmark it is measured by and the row there."""

    name: str
    bench: str
    key: tuple
    predicted_ms: float


def step_times(jobs: list[tuple]) -> list[list[float]]:
    """For each job ``(shape, batch, seq, stage, world_size, targets)``: one step of a GPT-2 of
    ``shape`` (layers, width, heads), bf16, fused AdamW, simulated on fake GPUs; its time in ms (the
    plan's ``step_time_s``) for each target. Needs fake (or real) CUDA in this process."""
    from transformers import GPT2Config

    from hf_lowzero import LowZeroTrainingArguments
    from hf_lowzero.plan.models import ModelSpec
    from hf_lowzero.plan.simulate import simulate_step
    from hf_lowzero.plan.step_records import Setup, TrainingSpec
    from hf_lowzero.plan.timed import StepTiming

    found = []
    for (n_layer, n_embd, n_head), batch, seq, stage, world_size, targets in jobs:
        config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, bos_token_id=0,
                            eos_token_id=0, architectures=["GPT2LMHeadModel"])  # fmt: skip
        spec = ModelSpec.from_source(config).as_on_gpu()
        with tempfile.TemporaryDirectory() as tmp:
            args = LowZeroTrainingArguments(output_dir=tmp, use_cpu=True, bf16=True, optim="adamw_torch_fused",
                                            per_device_train_batch_size=batch, report_to=[])  # fmt: skip
            training = TrainingSpec.from_args(args)
        setup = Setup(stage, False)
        step = simulate_step(spec, training, setup, world_size, batch, seq, backend="nccl")
        timing = [StepTiming(target, training, batch * seq).columns(step, setup)["step_time_s"] for target in targets]
        found.append([1e3 * seconds for seconds in timing])
    return found


def emulated_link(device: str, link_gb_s: float):
    """``device`` over ``gpu_overlap.py``'s emulated link: its bandwidth, no latency (the emulation
    sleeps bytes / bandwidth alone)."""
    from hf_lowzero.timing import Target

    target = Target.of(device, intra_node=f"{link_gb_s}GB/s")
    return dataclasses.replace(target, device=dataclasses.replace(target.device, latency_s=0.0))


def predictions(device: str, single: dict = SINGLE, overlap: dict = OVERLAP) -> list[Case]:
    """Every case's prediction for ``device`` (see the module docstring), simulated where fake CUDA
    runs (this process on a GPU machine, a fresh one elsewhere)."""
    from hf_lowzero.simulation.launch import call_on_fake_gpus, fake_cuda_here
    from hf_lowzero.timing import Target

    one, links = Target.of(device), overlap["links"]
    shape, batch, seq = overlap["shape"], overlap["batch"], overlap["seq"]
    jobs = [(single["shape"], single["batch"], single["seq"], stage, 1, [one]) for stage in SINGLE_SETUPS.values()]
    jobs.append((shape, batch, seq, 2, 1, [one]))
    jobs.append((shape, batch, seq, 2, 2, [emulated_link(device, link) for link in links]))  # one step, each link
    here = importlib.import_module("benchmarks.gpu_plan_time").step_times  # by its module's name: pickled
    times = here(jobs) if fake_cuda_here() else call_on_fake_gpus(here, jobs)
    cases = [Case(f"single: {name}", "gpu_single", (name,), ms[0]) for name, ms in zip(SINGLE_SETUPS, times)]
    cases.append(Case("overlap: W=1", "gpu_overlap", ("W1",), times[2][0]))
    for link, ms in zip(links, times[3]):
        cases.append(Case(f"overlap: W=2, {link:g} GB/s", "gpu_overlap", ("W2", link), ms))
    return cases


def measured(results: Path) -> dict[tuple, float]:
    """The benchmarks' measured ms per step by (bench, key), from their JSON in ``results``."""
    from benchmarks.overlap_report import W1

    found = {}
    single = results / "gpu_single.json"
    if single.is_file():
        for row in json.loads(single.read_text())["trainer"]:
            found[("gpu_single", row["setup"])] = row["ms_per_step"]
    overlap = results / "gpu_overlap.json"
    if overlap.is_file():
        data = json.loads(overlap.read_text())
        for row in data["variants"]:
            if row["setup"] == W1 and row["mode"] == "none":
                found[("gpu_overlap", "W1")] = row["ms"]
        for row in data["summary"]:
            if "overlap on" in row["setup"]:
                found[("gpu_overlap", "W2", row["link_GB_s"])] = row["all_ms"]
    return found


def compare(cases: list[Case], found: dict[tuple, float]) -> list[dict]:
    """Predicted against measured, per case that was measured."""
    rows = []
    for case in cases:
        ms = found.get((case.bench, *case.key))
        if ms is None:
            continue
        ratio = case.predicted_ms / ms
        rows.append({"case": case.name, "predicted_ms": round(case.predicted_ms, 2), "measured_ms": round(ms, 2),
                     "ratio": round(ratio, 3), "within_15%": abs(ratio - 1) <= TARGET})  # fmt: skip
    return rows


def default_device() -> str:
    """This machine's GPU where the device table has it, else H100."""
    import torch

    from hf_lowzero.timing import find_device

    if torch.cuda.is_available():
        try:
            return find_device(torch.cuda.get_device_name(0)).name
        except ValueError:
            pass
    return "H100"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None, help="the device to predict for (default: this GPU, else H100)")
    parser.add_argument("--predict-only", action="store_true", help="print the predictions, compare nothing")
    a = parser.parse_args()
    device = a.device or default_device()
    cases = predictions(device)
    if a.predict_only:
        print(markdown_table([dataclasses.asdict(c) for c in cases], ["name", "bench", "predicted_ms"]))
        return
    rows = compare(cases, measured(RESULTS))
    if not rows:
        raise SystemExit("no measured step to compare: run benchmarks/gpu_single.py and gpu_overlap.py first")
    header = (
        f"# The plan's step time against the GPU benchmarks, {device}\n\n"
        "`python benchmarks/gpu_plan_time.py` (in `gpu_check.sh` after `gpu_single.py` and `gpu_overlap.py`): "
        "the plan's simulated step timed for the device against the benchmarks' measured medians. "
        f"ratio = predicted / measured; target: within {TARGET:.0%}."
    )
    columns = ["case", "predicted_ms", "measured_ms", "ratio", "within_15%"]
    print(write_results("gpu_plan_time", rows, columns, header, data={"device": device, "rows": rows}))
    missed = [r["case"] for r in rows if not r["within_15%"]]
    if missed:
        raise SystemExit(f"not within {TARGET:.0%}: {', '.join(missed)}")


if __name__ == "__main__":
    main()
