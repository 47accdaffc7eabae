"""The offloaded step's host time against the host kernel alone, on the same rows and threads.

    python benchmarks/offload_host.py                   # 32M elements, this machine's threads
    python benchmarks/offload_host.py --numel 8e6 --rounds 5
    python benchmarks/offload_host.py --threads 1 --clock cpu   # CPU time: a machine shared with other jobs

Kernels alone, on fp32 rows of the same shapes (the baseline is torch's fused CPU AdamW,
``torch.optim.AdamW(fused=True)``): ``DeepSpeedCPUAdam`` (when DeepSpeed is installed and builds
its op), and our kernel (``hf_lowzero/zero/host``) alone and also writing the params' bf16 copy.

Our step, one rank (W=1, gloo, CPU): ``LowLevelZeroOptimizer(offload_optimizer=True)``, stage 2, with
AdamW (fused), for fp32 and bf16 params, with and without clipping (``clip_grad_norm=1.0``; the
gradients are far larger, so every step clips), twice: with our host kernel ("ours") and with
today's path, torch's fused kernel stepping the same host rows ("torch's step": a step hook on the
inner optimizer sends it there). Two times per step:

- **step**: the whole ``step()`` and the wait for the params. On CPU the "device" is the host, so
  this includes work a GPU does: writing the updated rows into the params (at W=1 the gather is that
  copy: on a GPU a copy on the device) and, for torch's step with bf16 params, the cast to bf16
  (on a GPU it runs on the device).
- **host**: the step less the time in ``ParamGather.issue`` (the gather: on a GPU, copies and
  device work issued asynchronously). What is left is what the host must do per step on a GPU
  machine: the skip/clip decision, the inner step (our kernel writes the bf16 copy inside it).
  The norm is taken during backward ([Note: the norm before the copy]), so it is in neither.

All setups are timed in one process, interleaved (A B C ... A B C ..., ``--rounds`` rounds of
``--steps`` steps); a round's time of a setup is its fastest step (the machine may be shared: the
fastest is the least disturbed), its ratio over the kernel's in the same round. The table gives the
medians and the spread (min-max) of the ratios. Each step setup then takes one profiled step: ms in
the decision, the inner step and the gather issue.

Writes results/offload_host.md, .json and .png (``--name``: another name; the GPU check writes
results/gpu_offload_host.*: the lent machine's host cores).
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

from benchmarks.common import RESULTS, bar_plot, write_results  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402
from hf_lowzero.zero.host import kernel as host  # noqa: E402
from hf_lowzero.zero.update.allgather import ParamGather  # noqa: E402

PARTS = ("hf_lowzero::grad_norm", "hf_lowzero::inner_step", "hf_lowzero::all_gather_issue")
CLOCK = [time.perf_counter]  # --clock cpu: time.process_time, the CPU time of this rank's threads
IN_GATHER = [0.0]  # seconds spent in ParamGather.issue since the last reset
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


def timed_gather_issue():
    """Count the time in ``ParamGather.issue`` into IN_GATHER (the gather: the device's work on a GPU)."""
    issue = ParamGather.issue

    def timed(self, *args, **kwargs):
        start = CLOCK[0]()
        try:
            return issue(self, *args, **kwargs)
        finally:
            IN_GATHER[0] += CLOCK[0]() - start

    ParamGather.issue = timed


def ours(shapes, dtype: torch.dtype, clip: float, torch_step: bool):
    model = Rows(shapes, dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if torch_step:  # today's path: torch's kernel steps the host rows ([Note: our kernel in torch's place])
        inner.register_step_pre_hook(lambda *_: None)
    opt = LowLevelZeroOptimizer(model, inner, stage=2, offload_optimizer=True, clip_grad_norm=clip)

    def step() -> tuple[float, float, float]:
        start = CLOCK[0]()
        opt.backward(model())
        middle = CLOCK[0]()
        IN_GATHER[0] = 0.0
        opt.step()
        opt.wait_for_params()
        total = CLOCK[0]() - middle
        return total, total - IN_GATHER[0], middle - start

    return step, opt


def kernel(shapes, make):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(torch.Size(s).numel(), generator=g) * 0.02 for s in shapes]
    for row in rows:
        row.grad = torch.randn(row.numel(), generator=g)
    opt = make(rows)

    def step() -> tuple[float, float, float]:
        start = CLOCK[0]()
        opt.step()
        took = CLOCK[0]() - start
        return took, took, 0.0

    return step, None


class OurKernel:
    """Our host kernel over fp32 rows with AdamW's defaults (``lr=1e-4``), as an optimizer's ``step``."""

    def __init__(self, rows, out_dtype: torch.dtype | None) -> None:
        self.kernel = host.host_kernel()
        self.hyper = host.AdamHyper(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True)
        self.tensors = [
            host.AdamTensors(r, r.grad, torch.zeros_like(r), torch.zeros_like(r), torch.zeros(()),
                             torch.empty(r.numel(), dtype=out_dtype) if out_dtype else None)
            for r in rows
        ]  # fmt: skip

    def step(self) -> None:
        self.kernel.step(self.tensors, [self.hyper] * len(self.tensors), grad_scale=None,
                         threads=torch.get_num_threads())  # fmt: skip


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
    timed_gather_issue()
    shapes = layer_shapes(numel)
    setups = {"fused AdamW (kernel)": kernel(shapes, lambda rows: torch.optim.AdamW(rows, lr=1e-4, fused=True))}
    make_ds, ds_why = deepspeed_maker()
    if make_ds is not None:
        setups["DeepSpeedCPUAdam"] = kernel(shapes, make_ds)
    ours_why = getattr(host.host_kernel(), "why", None)
    if ours_why is None:
        setups["our kernel"] = kernel(shapes, lambda rows: OurKernel(rows, None))
        setups["our kernel + bf16 copy"] = kernel(shapes, lambda rows: OurKernel(rows, torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16):
        for clip in (0.0, 1.0):
            for torch_step in (False, True):
                name = (
                    f"{'torch' if torch_step else 'ours'}: {str(dtype).split('.')[1]}, {'clip' if clip else 'no clip'}"
                )
                setups[name] = ours(shapes, dtype, clip, torch_step)
    for step, _ in setups.values():
        step()
        step()  # warm-up: state created, kernels chosen
    times = {name: [] for name in setups}  # per round: (step, host, backward) of its fastest step
    for _ in range(rounds):
        for name, (step, _) in setups.items():
            times[name].append(min(step() for _ in range(steps)))
    base = [t for t, _, _ in times["fused AdamW (kernel)"]]
    rows = []
    for name, (step, opt) in setups.items():
        ratios = sorted(t / b for (t, _, _), b in zip(times[name], base))
        host_ratios = sorted(h / b for (_, h, _), b in zip(times[name], base))
        row = {
            "setup": name,
            "step ms": round(statistics.median(t for t, _, _ in times[name]) * 1e3, 1),
            "step x kernel": round(statistics.median(ratios), 2),
            "spread": f"{ratios[0]:.2f}-{ratios[-1]:.2f}",
            "host ms": round(statistics.median(h for _, h, _ in times[name]) * 1e3, 1) if opt else "",
            "host x kernel": round(statistics.median(host_ratios), 2) if opt else "",
            "host spread": f"{host_ratios[0]:.2f}-{host_ratios[-1]:.2f}" if opt else "",
            "backward ms": round(statistics.median(b for _, _, b in times[name]) * 1e3, 1) if opt else "",
            "path": (opt.host_step.last_path if opt.host_step else "torch") if opt else "",
        }
        row.update(profile_parts(step) if opt is not None else dict.fromkeys(PART_NAMES, ""))
        rows.append(row)
    out.update(rows=rows, numel=sum(torch.Size(s).numel() for s in shapes), threads=threads, deepspeed=ds_why,
               ours=ours_why)  # fmt: skip


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
    rows, numel, threads, ds_why, ours_why = (out[k] for k in ("rows", "numel", "threads", "deepspeed", "ours"))
    columns = ["setup", "path", "step ms", "step x kernel", "spread", "host ms", "host x kernel", "host spread"]
    columns += ["backward ms", *PART_NAMES]
    header = (
        f"# The offloaded step's host time against the host kernel\n\n"
        f"`python benchmarks/offload_host.py --numel {args.numel:g} --rounds {args.rounds} --threads {threads} "
        f"--clock {args.clock}`: W=1, gloo, "
        f"{numel / 1e6:.1f}M elements in {len(layer_shapes(numel))} tensors, {threads} threads, "
        f"AdamW; kernels alone on fp32 rows of the same shapes, then our `step()` (stage 2, offload) with our "
        f"host kernel (ours) and with torch's fused kernel (torch), against torch's fused CPU AdamW alone; "
        f"medians over {args.rounds} interleaved rounds of each round's fastest of {args.steps} steps. "
        f"**host**: the step less the gather (what the host does per step on a GPU machine; see the script's "
        f"docstring); the last three columns are ms of one profiled step."
    )
    footer = "" if ds_why is None else f"\nDeepSpeedCPUAdam not measured: {ds_why}\n"
    footer += "" if ours_why is None else f"\nOur kernel not available: {ours_why}\n"
    data = {"numel": numel, "threads": threads, "deepspeed": ds_why, "ours": ours_why, "rows": rows}
    print(write_results(args.name, rows, columns, header, footer, data=data))
    plotted = [r for r in rows if r["host x kernel"] != ""] + [r for r in rows if r["host x kernel"] == ""]
    host = [r["host x kernel"] != "" for r in plotted]
    bar_plot(
        RESULTS / f"{args.name}.png", [r["setup"] for r in plotted],
        [r["host x kernel"] if h else r["step x kernel"] for r, h in zip(plotted, host)],
        spans=[tuple(map(float, (r["host spread"] if h else r["spread"]).split("-"))) for r, h in zip(plotted, host)],
        xlabel="host part of step() / torch's fused AdamW (kernels: their own time); bars: min-max of rounds",
        title=f"offloaded step, host part, {numel / 1e6:.0f}M elements, {threads} thread(s)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
