"""How much communication the GPU step hides, on one GPU with a second rank emulated.

    python benchmarks/gpu_overlap.py                      # needs a CUDA GPU; writes results/gpu_overlap.{md,json,png}
    python benchmarks/gpu_overlap.py --cpu-smoke          # the same code on CPU, a tiny model, into a temp dir

Rank 0 of a world of 2 trains GPT-2 1.2B (24 x 2048; or the largest of MODELS that fits) at 4 x 512
tokens, bf16 params, fused AdamW, ZeRO stage 2, on ``EmulatedGroup`` (``benchmarks/emulated_nccl.py``):
NCCL's streams and events, the real reduction and gather kernels, and a sleep on NCCL's stream for
the bytes a rank sends over a link of 100, 50, 25 or 12.5 GB/s. Three setups live side by side: the
all-gather overlapped with the next forward (``ZeroConfig(overlap_allgather=True)``, the Trainer's
default), not overlapped, and world size 1 (the same model and optimizer, no communication).

For each link each W=2 setup runs with nothing sleeping, then with only the reduce-scatters
sleeping, only the all-gathers, and every collective. Hidden, per collective and link, in each
round: ``1 - (step with its sleeps - step with none, just before) / its wire time``, the wire time
being the sum of its sleeps per step (bytes / bandwidth). Targets: reduce-scatter >= 90% hidden wherever its wire
time is below the backward it overlaps, all-gather >= 80% wherever below the forward (with the
overlap on). Also: host syncs per phase (forward, backward, step, gather; ``host_syncs.py``) and the
step time against W=1 in the same round.

Timing: ``warmup`` steps per setup, then ``rounds`` rounds in which every setup and sleep mode runs
a block in turn ([Note: steady-state blocks]); medians and ranges of the rounds. One step per link
with every sleep timed by CUDA events checks the sleeps against the bytes / bandwidth they stand for.

# [Note: steady-state blocks]
# With the all-gather overlapped, a step's gathers are waited for in the next step's forward. A
# block timed from one synchronize to the next would get the gathers before it for free (done
# during the synchronize) and wait for its last step's in full (nothing left to hide them behind):
# it would report (n-1)/n of what is hidden. So a block runs one untimed step first (under the
# block's sleeps), then ``steps`` steps timed from the start of the first one's forward, which
# waits for the untimed step's gathers, to the end of the last one's ``step()``, which leaves its
# gathers to the next forward (CUDA events on the compute stream; the host clock on CPU, where
# ``wait()`` blocks the host). Every timed step then waits for one step's gathers, as in training.
# The device is synchronized after each block, so the next one starts with nothing in flight.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Three 1.2B setups share one GPU: growing segments keep the caching allocator from fragmenting (set
# before CUDA starts; a value already in the environment wins).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import RESULTS, gpt2_on  # noqa: E402
from benchmarks.emulated_nccl import BACKEND, KINDS, Wire, calibrate_sleep, emulated_world  # noqa: E402
from benchmarks.host_syncs import PHASES, HostSyncs  # noqa: E402
from benchmarks.overlap_report import write_report  # noqa: E402
from hf_lowzero import LowLevelZeroOptimizer  # noqa: E402
from hf_lowzero.zero.zero_config import ZeroConfig  # noqa: E402

FLAG = "overlap_allgather"
MODES = {"none": frozenset(), "rs": frozenset({"reduce_scatter"}), "ag": frozenset({"all_gather"})}
MODES["all"] = frozenset(KINDS)
MEASURED = {"rs": "reduce_scatter", "ag": "all_gather"}  # the mode that sleeps on one kind alone


@dataclass(frozen=True)
class Settings:
    device: torch.device
    models: tuple[tuple[int, int, int], ...]  # (n_layer, n_embd, n_head), largest first
    links: tuple[float, ...]  # GB/s
    batch: int
    seq: int
    vocab: int
    bucket_mb: float
    warmup: int
    rounds: int
    steps: int
    smoke: bool


GPU = Settings(
    device=torch.device("cuda"), models=((24, 2048, 16), (24, 1600, 16), (24, 1280, 16), (24, 1024, 16)),
    links=(100.0, 50.0, 25.0, 12.5), batch=4, seq=512, vocab=50257, bucket_mb=25.0, warmup=2, rounds=4, steps=3,
    smoke=False,
)  # fmt: skip
# On CPU: a tiny GPT-2, links slow enough for time.sleep, buckets small enough to be several.
SMOKE = Settings(
    device=torch.device("cpu"), models=((2, 64, 4),), links=(0.01, 0.004), batch=2, seq=32, vocab=512,
    bucket_mb=0.05, warmup=1, rounds=2, steps=2, smoke=True,
)  # fmt: skip


@dataclass
class Setup:
    name: str
    world_size: int
    overlap: bool | None  # the all-gather overlapped with the next forward; None at W=1
    model: torch.nn.Module
    opt: LowLevelZeroOptimizer
    losses: list = dataclasses.field(default_factory=list)  # the last loss of each block, checked at the end


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flag_missing() -> bool:
    """Whether this checkout's ZeroConfig lacks ``overlap_allgather`` (added by issue 45)."""
    return FLAG not in {f.name for f in dataclasses.fields(ZeroConfig)}


def build(settings: Settings, shape, name: str, group, overlap: bool | None) -> Setup:
    model = gpt2_on(settings.device, *shape, settings.seq, vocab=settings.vocab)
    inner = torch.optim.AdamW(model.parameters(), fused=True)
    flag = {} if overlap is None or flag_missing() else {FLAG: overlap}
    config = ZeroConfig(
        stage=2, reduce_bucket_mb=settings.bucket_mb, verify_every="off", process_group=group, **flag
    )  # integrity checks off: an "auto" verify step would land in some blocks and not others
    world_size = 1 if group is not None else dist.get_world_size()
    return Setup(name, world_size, overlap, model, LowLevelZeroOptimizer(model, inner, config))


def train_step(setup: Setup, x: torch.Tensor, syncs: HostSyncs | None = None, marks=None) -> torch.Tensor:
    """One optimizer step; ``marks(name)`` (when given) is called after each phase."""
    phase = syncs.phase if syncs is not None else lambda name: contextlib.nullcontext()
    mark = marks or (lambda name: None)
    with phase("forward"):
        loss = setup.model(input_ids=x, labels=x).loss
    mark("forward")
    with phase("backward"):
        setup.opt.backward(loss)
    mark("backward")
    with phase("step"):
        setup.opt.step()
        setup.opt.zero_grad()
    mark("step")
    return loss.detach()


def fitting_setups(settings: Settings, x_of, w1_group) -> tuple[tuple, list[Setup]]:
    """The three setups of the largest model of ``settings.models`` that fits, each stepped once."""
    for shape in settings.models:
        setups: list[Setup] = []
        try:
            setups.append(build(settings, shape, "W=2, overlap on", None, True))
            setups.append(build(settings, shape, "W=2, overlap off", None, False))
            setups.append(build(settings, shape, "W=1", w1_group, None))
            for setup in setups:
                train_step(setup, x_of())
            synchronize(settings.device)
            return shape, setups
        except torch.OutOfMemoryError:
            print(f"GPT-2 {shape} does not fit three times: trying a smaller one", flush=True)
        setups.clear()
        gc.collect()
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()
    raise SystemExit(f"none of {settings.models} fits three times on {settings.device}")


def variants(setups: list[Setup], links) -> list[tuple[Setup, str, float | None]]:
    """(setup, sleep mode, link) in the order each round runs them: for each link, each W=2 setup
    with nothing sleeping (the run its sleeping runs are paired with), then sleeping on the
    reduce-scatters, on the all-gathers, on everything; last W=1."""
    pairs = [s for s in setups if s.world_size > 1]
    out = [(setup, mode, link) for link in links for setup in pairs for mode in ("none", "rs", "ag", "all")]
    return out + [(setup, "none", None) for setup in setups if setup.world_size == 1]


def configure(wire: Wire, mode: str, link: float | None) -> None:
    wire.sleeping = MODES[mode]
    if link is not None:
        wire.gb_per_s = link


def timed_rounds(settings: Settings, setups, wire: Wire, x) -> dict[tuple, list[float]]:
    """ms per step of every variant in every round (key: setup name, mode, link)."""
    runs = variants(setups, settings.links)
    for setup in setups:
        configure(wire, "none", None)
        for _ in range(settings.warmup):
            train_step(setup, x)
    times: dict[tuple, list[float]] = {(s.name, mode, link): [] for s, mode, link in runs}
    for r in range(settings.rounds):
        began = time.perf_counter()
        for setup, mode, link in runs:
            configure(wire, mode, link)
            times[(setup.name, mode, link)].append(block_ms(settings, setup, x))
        print(f"round {r + 1}/{settings.rounds}: {time.perf_counter() - began:.1f} s", flush=True)
    configure(wire, "none", None)
    return times


def block_ms(settings: Settings, setup: Setup, x) -> float:
    """ms per step of one block: [Note: steady-state blocks]."""
    train_step(setup, x)
    start = _clock(settings.device)
    for _ in range(settings.steps):
        loss = train_step(setup, x)
    end = _clock(settings.device)
    synchronize(settings.device)
    setup.losses.append(loss)
    return _elapsed_ms(start, end) / settings.steps


def phase_ms(settings: Settings, setup: Setup, x, steps: int = 3) -> dict[str, float]:
    """Median ms of each phase of a step with nothing sleeping (CUDA events; host clock on CPU)."""
    samples: dict[str, list[float]] = {name: [] for name in ("forward", "backward", "step")}
    for _ in range(steps):
        synchronize(settings.device)
        marks: list[tuple[str, object]] = [("start", _clock(settings.device))]
        train_step(setup, x, marks=lambda name, marks=marks: marks.append((name, _clock(settings.device))))
        synchronize(settings.device)
        for (_, begin), (name, end) in zip(marks, marks[1:]):
            samples[name].append(_elapsed_ms(begin, end))
    return {name: statistics.median(values) for name, values in samples.items()}


def _clock(device: torch.device):
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(begin, end) -> float:
    return begin.elapsed_time(end) if isinstance(begin, torch.cuda.Event) else 1000 * (end - begin)


def host_syncs(setup: Setup, x) -> dict:
    """Host syncs per phase of one step after another (whose gathers, overlapped, this step's
    forward waits for), and where each was (CUDA only)."""
    syncs = HostSyncs()
    with syncs.counting():
        train_step(setup, x, syncs=syncs)
    synchronize(x.device)
    sites = [{"phase": phase, "site": site, "syncs": n} for (phase, site), n in sorted(syncs.sites.items())]
    return {"setup": setup.name, **syncs.counts(), "ours": dict(syncs.ours), "sites": sites}


def wire_per_step(setup: Setup, wire: Wire, x) -> dict[str, int]:
    """Payload bytes per step of each collective kind (nothing sleeping)."""
    configure(wire, "none", None)
    wire.payload_bytes.clear()
    train_step(setup, x)
    return dict(wire.payload_bytes)


def measured_sleeps(settings: Settings, setup: Setup, wire: Wire, x, payload: dict[str, int]) -> list[dict]:
    """For each link, one step with every collective sleeping and every sleep timed: measured
    against nominal (bytes / bandwidth) seconds per kind."""
    rows = []
    for link in settings.links:
        configure(wire, "all", link)
        wire.slept = []
        train_step(setup, x)
        synchronize(settings.device)
        slept = wire.slept_seconds()
        wire.slept = None
        for kind in ("reduce_scatter", "all_gather"):
            nominal = wire.wire_seconds(kind, payload.get(kind, 0), setup.world_size)
            ratio = slept[kind] / nominal if nominal else 0.0
            rows.append({"link_GB_s": link, "kind": kind, "nominal_ms": 1000 * nominal,
                         "slept_ms": 1000 * slept[kind], "ratio": ratio})  # fmt: skip
    configure(wire, "none", None)
    return rows


def check_training(setups: list[Setup]) -> None:
    """Every step applied (a skipped step would skip its all-gather) and every loss finite."""
    for setup in setups:
        losses = torch.stack([loss.float().cpu() for loss in setup.losses])
        if setup.opt.skipped_steps or not torch.isfinite(losses).all():
            raise SystemExit(
                f"{setup.name}: {setup.opt.skipped_steps} steps skipped, losses {losses.tolist()}: the timings "
                "would not be of the step this benchmark means to time"
            )


def run(settings: Settings, out: Path, flag_note: str) -> list[str]:
    """Measure, write ``out``/gpu_overlap.{md,json,png}, return the verdicts."""
    began = time.perf_counter()
    device = settings.device
    wire = Wire(cycles_per_s=calibrate_sleep(device) if device.type == "cuda" else None)
    calibrated = wire.cycles_per_s
    with emulated_world(2, wire):
        w1_group = dist.new_group([0], backend=BACKEND)
        generator = torch.Generator().manual_seed(0)

        def batch() -> torch.Tensor:
            return torch.randint(0, settings.vocab, (settings.batch, settings.seq), generator=generator).to(device)

        shape, setups = fitting_setups(settings, batch, w1_group)
        params = sum(p.numel() for p in setups[0].model.parameters())
        print(f"GPT-2 {shape}: {params / 1e6:.3g}M params, built and stepped in {time.perf_counter() - began:.0f} s")
        x = batch()
        payload = wire_per_step(setups[0], wire, x)
        phases = {s.name: phase_ms(settings, s, x) for s in setups}
        syncs = [host_syncs(s, x) for s in setups] if device.type == "cuda" else []
        for counted in syncs:
            print(f"host syncs, {counted['setup']}: " + ", ".join(f"{p} {counted[p]}" for p in PHASES), flush=True)
        times = timed_rounds(settings, setups, wire, x)
        sleeps = measured_sleeps(settings, setups[0], wire, x, payload)
        check_training(setups)
        context = {
            "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test)",
            "torch": torch.__version__,
            "model": {"n_layer": shape[0], "n_embd": shape[1], "n_head": shape[2], "params": params},
            "settings": {k: str(v) if k == "device" else v for k, v in dataclasses.asdict(settings).items()},
            "payload_bytes_per_step": payload,
            "sleep_cycles_per_s": [calibrated, calibrate_sleep(device) if device.type == "cuda" else None],
            "flag_note": flag_note,
            "phases_ms": phases,
            "host_syncs": syncs,
            "sleeps": sleeps,
            "seconds": time.perf_counter() - began,
        }
        return write_report(out, context, times, settings.links)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-smoke", action="store_true", help="run on CPU with a tiny model (a smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results; "
                        "with --cpu-smoke a new temporary folder)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 4 on a GPU, 2 on CPU)")
    args = parser.parse_args()
    settings = SMOKE if args.cpu_smoke else GPU
    if args.rounds:
        settings = dataclasses.replace(settings, rounds=args.rounds)
    if not settings.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_overlap.py needs a CUDA GPU; none is visible here (--cpu-smoke runs on CPU)")
    flag_note = ""
    if flag_missing():
        if not settings.smoke:
            raise SystemExit(
                f"ZeroConfig has no field {FLAG!r}: this checkout's optimizer cannot overlap its all-gather, which "
                "is what benchmarks/gpu_overlap.py measures. Run it on a checkout that has it (issue 45)."
            )
        flag_note = f"ZeroConfig has no {FLAG!r} field yet: the overlap on and off rows ran the same optimizer"
        print(f"NOTE: {flag_note}", flush=True)
    if settings.smoke:
        torch.set_num_threads(1)  # the other core runs the emulated collectives' thread
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu_overlap_smoke_")) if settings.smoke else RESULTS)
    began = time.perf_counter()
    for line in run(settings, out, flag_note):
        print(line)
    print(f"results in {out} ({time.perf_counter() - began:.0f} s)")
    if settings.smoke:
        print("CPU smoke test: these numbers are not GPU results")


if __name__ == "__main__":
    main()
