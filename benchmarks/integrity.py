"""What the integrity checks cost: step time with verify_every 1, 10 and auto against checks off.

    python benchmarks/integrity.py               # ~3 min; results/integrity.{md,json,png}
    python benchmarks/integrity.py --rounds 4    # fewer rounds, wider spreads

W=2 on CPU (gloo, one thread per rank), GPT-2 4x256 (5.6M params, fp32, AdamW), ZeRO stage 2, one
micro-batch per step. The four setups live in one process group, each with its own model and
optimizer, timed in turns (A B C D A B C D ...) over ROUNDS rounds of STEPS steps, so that a
drifting machine affects them alike. Reported per setup: the median step time, its ratio to
"off" computed per round (median, min, max), the verify steps taken, the interval "auto" settled on,
the host time of one verify step (hashing, checksums, the all-gather and the verdict), and the
bytes one verify step all-gathers per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import RESULTS, collect, gpt2, interleaved_ms_per_step, ratio_plot, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402

ROUNDS, STEPS, WARMUP = 8, 10, 3
SETUPS = {"off": "off", "verify_every 1": 1, "verify_every 10": 10, "auto": "auto"}


def body(rank: int, world_size: int, out: str, rounds: int) -> None:
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randint(0, 8192, (4, 64), generator=g) for _ in range(4)]
    optimizers, runs = {}, {}
    for name, every in SETUPS.items():
        model = gpt2(4, 256, dropout=0.0)
        opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), stage=2, verify_every=every)
        optimizers[name] = opt
        counter = iter(range(10**9))

        def run(model=model, opt=opt, counter=counter) -> None:
            x = xs[next(counter) % len(xs)]
            opt.backward(model(input_ids=x, labels=x).loss)
            opt.step()
            opt.zero_grad()

        runs[name] = run
    times = interleaved_ms_per_step(runs, rounds, STEPS, WARMUP)
    rows = []
    for name, opt in optimizers.items():
        ratios = [t / base for t, base in zip(times[name], times["off"])]
        checks = opt.integrity.checks
        rows.append(
            {
                "setup": name,
                "ms_per_step": statistics.median(times[name]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "verify_steps": checks,
                "steps": WARMUP + rounds * STEPS,
                "interval": opt.integrity.interval if name == "auto" else SETUPS[name],
                "ms_per_verify_step": 1000 * opt.integrity.verify_seconds / checks if checks else 0.0,
                "KiB_gathered_per_verify": opt.integrity.bytes_gathered / checks / 1024 if checks else 0.0,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    rows = collect(body, 2, rounds=parser.parse_args().rounds)
    header = (
        "# Integrity checks: step time\n\n`python benchmarks/integrity.py`: W=2, gloo, 1 thread per rank, GPT-2 "
        f"4x256 fp32, AdamW, ZeRO stage 2; {ROUNDS} interleaved rounds of {STEPS} steps; ratio = setup / checks off "
        "per round (median, min, max). A verify step hashes every param, checksums every bucket (2 probes in "
        "fp32) and all-gathers the numbers; `KiB_gathered_per_verify` is that all-gather's output per rank."
    )
    print(write_results("integrity", rows, list(rows[0]), header))
    ratio_plot(
        RESULTS / "integrity.png",
        rows,
        "step time / checks off (median, min-max over rounds)",
        "integrity checks, GPT-2 4x256, W=2, CPU",
    )


if __name__ == "__main__":
    main()
