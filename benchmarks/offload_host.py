"""The offloaded step's host time against the host kernel alone, on the same rows and threads.

    python benchmarks/offload_host.py                   # 32M elements, this machine's threads
    python benchmarks/offload_host.py --numel 8e6 --rounds 5
    python benchmarks/offload_host.py --threads 1 --clock cpu   # CPU time: a machine shared with other jobs

One rank (W=1, gloo, CPU): our ``LowLevelZeroOptimizer(offload_optimizer=True)`` with AdamW (its
host kernel left open, so the fused CPU one), for fp32 and bf16 params, with and without clipping
(``clip_grad_norm=1.0``; the gradients are far larger, so every step clips). Against it, on fp32
rows of the same shapes: torch's fused CPU AdamW alone (``torch.optim.AdamW(fused=True)``) and,
when DeepSpeed is installed and builds its op, ``DeepSpeedCPUAdam``. All setups are timed in one
process, interleaved (A B C ... A B C ..., ``--rounds`` rounds of ``--steps`` steps); a round's
time of a setup is its fastest step (the machine may be shared: the fastest is the least
disturbed), its ratio our ``step()`` over the kernel's step in the same round. The table gives the
median and spread of the ratios, and the backward's time beside our step's: on CPU the norm taken
as buckets are reduced runs there ([Note: the norm before the copy]). The gradients come from a
backward through the real hooks and buckets; on CPU the "device" is the host, so a step's time is
everything it does on the host. Each setup then takes one profiled step: where its time goes (norm
and decision, the inner step, the write back into the params).

Writes results/offload_host.md and results/offload_host.json (``--name``: another name; the GPU
check writes results/gpu_offload_host.*: the lent machine's host cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402

PARTS = ("hf_lowzero::grad_norm", "hf_lowzero::inner_step", "hf_lowzero::all_gather_issue")
CLOCK = [time.perf_counter]  # --clock cpu: time.process_time, the CPU time of this rank's threads
PART_NAMES = [part.split("::")[1] for part in PARTS]


def layer_shapes(numel: int) -> list[tuple[int, ...]]:
    """Tensor shapes summing to about ``numel``: 8 layers of a square weight, a bias and two thin ones."""
    width = int((numel / 8 / 1.5) ** 0.5)
    return [s for _ in range(8) for s in ((width, width), (width,), (width // 4, width), (width // 4, width))]


class Rows(nn.Module):
    """Params of the given shapes; ``forward`` is a loss whose gradients are a fixed random tensor."""

    def __init__(self, shapes, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g).to(dtype) * 0.02) for s in shapes)
        self.noise = [torch.randn(s, generator=g).to(dtype) for s in shapes]

    def forward(self) -> torch.Tensor:
        return sum((p * n).sum() for p, n in zip(self.ps, self.noise))


def ours(shapes, dtype: torch.dtype, clip: float):
    model = Rows(shapes, dtype)
    opt = LowLevelZeroOptimizer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), stage=2, offload_optimizer=True, clip_grad_norm=clip
    )

    def step() -> tuple[float, float]:
        start = CLOCK[0]()
        opt.backward(model())
        middle = CLOCK[0]()
        opt.step()
        opt.wait_for_params()
        return CLOCK[0]() - middle, middle - start

    return step, opt


def kernel(shapes, make):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(torch.Size(s).numel(), generator=g) * 0.02 for s in shapes]
    for row in rows:
        row.grad = torch.randn(row.numel(), generator=g)
    opt = make(rows)

    def step() -> tuple[float, float]:
        start = CLOCK[0]()
        opt.step()
        return CLOCK[0]() - start, 0.0

    return step, None


def deepspeed_maker():
    """``DeepSpeedCPUAdam`` as a maker of optimizers, or why not (not installed, the op did not build)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = [torch.zeros(8)]
        probe[0].grad = torch.ones(8)
        DeepSpeedCPUAdam(probe, lr=1e-4, adamw_mode=True).step()
    except Exception as error:  # noqa: BLE001 (an optional baseline: any failure is reported, not raised)
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    return (lambda rows: DeepSpeedCPUAdam(rows, lr=1e-4, adamw_mode=True)), None


def profile_parts(step) -> dict[str, float]:
    """One step under the profiler: ms in each of PARTS."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages() if e.key in PARTS}
    return {name: round(totals.get(part, 0.0), 2) for name, part in zip(PART_NAMES, PARTS)}


def body(rank: int, world_size: int, numel: int, threads: int, rounds: int, steps: int, clock: str, out: dict) -> None:
    torch.set_num_threads(threads)
    CLOCK[0] = time.process_time if clock == "cpu" else time.perf_counter
    shapes = layer_shapes(numel)
    setups = {"fused AdamW (kernel)": kernel(shapes, lambda rows: torch.optim.AdamW(rows, lr=1e-4, fused=True))}
    make_ds, ds_why = deepspeed_maker()
    if make_ds is not None:
        setups["DeepSpeedCPUAdam"] = kernel(shapes, make_ds)
    for dtype in (torch.float32, torch.bfloat16):
        for clip in (0.0, 1.0):
            name = f"ours, {str(dtype).split('.')[1]}, {'clip 1.0' if clip else 'no clip'}"
            setups[name] = ours(shapes, dtype, clip)
    for step, _ in setups.values():
        step()
        step()  # warm-up: state created, fused kernel chosen
    times = {name: [] for name in setups}  # per round: (step, backward) of its fastest step
    for _ in range(rounds):
        for name, (step, _) in setups.items():
            times[name].append(min(step() for _ in range(steps)))
    base = [t for t, _ in times["fused AdamW (kernel)"]]
    rows = []
    for name, (step, opt) in setups.items():
        ratios = sorted(t / b for (t, _), b in zip(times[name], base))
        row = {
            "setup": name,
            "step ms": round(statistics.median(t for t, _ in times[name]) * 1e3, 1),
            "x kernel": round(statistics.median(ratios), 2),
            "spread": f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
            "backward ms": round(statistics.median(b for _, b in times[name]) * 1e3, 1) if opt else "",
        }
        row.update(profile_parts(step) if opt is not None else dict.fromkeys(PART_NAMES, ""))
        rows.append(row)
    out.update(rows=rows, numel=sum(torch.Size(s).numel() for s in shapes), threads=threads, deepspeed=ds_why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=32e6, help="elements of the rows (default 32M)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="host threads (default: all)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3, help="steps per setup per round (the fastest counts)")
    parser.add_argument("--name", default="offload_host", help="results/NAME.md and results/NAME.json")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu: the CPU time of the rank's threads (a machine shared with other jobs), not the wall clock",
    )  # fmt: skip
    args = parser.parse_args()
    import multiprocessing

    out = multiprocessing.Manager().dict()
    run_distributed(
        body,
        1,
        numel=int(args.numel),
        threads=args.threads,
        rounds=args.rounds,
        steps=args.steps,
        clock=args.clock,
        out=out,
    )
    rows, numel, threads, ds_why = out["rows"], out["numel"], out["threads"], out["deepspeed"]
    columns = ["setup", "step ms", "x kernel", "spread", "backward ms", *PART_NAMES]
    header = (
        f"# The offloaded step's host time against the host kernel\n\n"
        f"`python benchmarks/offload_host.py --numel {args.numel:g} --rounds {args.rounds} --threads {threads} "
        f"--clock {args.clock}`: W=1, gloo, "
        f"{numel / 1e6:.1f}M elements in {len(layer_shapes(numel))} tensors, {threads} threads, "
        f"AdamW; our `step()` (stage 2, offload) against torch's fused CPU AdamW on fp32 rows of the same "
        f"shapes, medians over {args.rounds} interleaved rounds of each round's fastest of {args.steps} steps; "
        f"the last three columns are ms of one profiled step."
    )
    footer = "" if ds_why is None else f"\nDeepSpeedCPUAdam not measured: {ds_why}\n"
    data = {"numel": numel, "threads": threads, "deepspeed": ds_why, "rows": rows}
    print(write_results(args.name, rows, columns, header, footer, data=data))


if __name__ == "__main__":
    main()
