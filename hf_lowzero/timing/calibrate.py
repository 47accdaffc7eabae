"""``cpu``: this machine as a device, measured once (at most 20 s) and cached.

What the time model needs of a CPU rank, measured with torch as the step runs it:

- the matmul rate (fp32 and bf16 ``mm`` of 512 x 512), with one thread and with all of torch's;
- the memory bandwidth of the ops around the matmuls ([Note: elementwise bandwidth]), with one
  thread and with all;
- the rates the ops of a step reach ([Note: rates in a step] in ``step_rates.py``): a reference
  step's matmuls against the 512 x 512 ``mm``, its flash attention's FLOPs, and each per-element
  op's bandwidth ([Note: the CPU's own rates]), with one thread and with all;
- the cost per op of an eager step: a small MLP's forward and backward on one thread, timed, over
  the aten ops it dispatches (Python, autograd and the dispatcher included: what a step of small
  ops pays);
- the cost per tensor of a multi-tensor op ([Note: a cost per tensor]);
- gloo's latency and bandwidth: an all-reduce of one element and of 16 MiB between two local ranks
  (two gloo groups in two threads of this process, over loopback as local processes talk).

[Note: elementwise bandwidth] The bytes an op moves are priced at one bandwidth. A ``copy_`` of
32 MiB streams at the machine's best (24 GB/s here, quiet); the ops a step issues around its matmuls
(layer norm, GELU, softmax and their backward, on activations of a few MiB) reach half of that or
less: they compute ``exp`` and ``erf`` per element and reduce along rows. So the figure is theirs:
a layer norm, a GELU, a product, a residual add and a softmax on a 512 x 512 activation, forward and
backward, their bytes counted as ``counting.py`` counts them, over their time less the dispatch of
their ops.

[Note: the CPU's own rates] On a GPU, attention runs near the matmul rate and every other op near
memory bandwidth. A CPU thread does not: its flash attention works on blocks of a few dozen rows,
and reached a third to two thirds of the 512 x 512 matmul's rate; layer norm, GELU (``erf``),
softmax and their backward compute per element and reached 0.35 to 0.45 of the bandwidth of the ops
around them, and ``tanh`` (GPT-2's ``gelu_new``) a tenth. So ``cpu`` prices each at the rate it
reached in the reference step ([Note: rates in a step]): the attention's FLOPs, and the bytes of
each op of ``counting.PER_ELEMENT_MATH`` at its own bandwidth (``math``), or at theirs together
(``bandwidth_math``) where the step did not run it.

[Note: a cost per tensor] A ``_foreach_*`` op or a fused optimizer step (``_fused_adamw_``) is one
op to the dispatcher, but a CPU runs it tensor by tensor, and pays for each: over 64 tensors of 4
elements, 1.1 us a tensor for a norm, 0.4 us for an add, a product or an AdamW step, on top of
their bytes. A Trainer's step runs four of them over every gradient (the norm and the scaling of
``max_grad_norm``, the optimizer's step per group): a model of many small tensors pays it. So ``cpu``
measures each (the op over 64 such tensors, less over one, per tensor) and prices a multi-tensor op
at its bytes plus its tensors at its own figure (an op it did not measure at their mean). A GPU's
multi-tensor kernels take many tensors per launch: no cost per tensor there.

[Note: calibrated in CPU time] Every figure is timed in CPU seconds of this process (user and
system: ``time.process_time``), the best of three (the reference step's: the median of five steps), not
in wall seconds: a machine shared with other work runs this process part of the time only, and a
wall clock would measure its load, not its rates (under a load of 5 on 2 cores, wall-clock rates
came out at a third to a fifth of the quiet machine's). With several threads, the work is over the
CPU seconds per thread (what the threads give when they run at once). Gloo's figures are the CPU
seconds of each rank's side (sending and receiving over loopback is the kernel's copying, which
counts as system time), so a collective's wait for a slower peer is not in them: the time model
prices a step on a machine of its own.

The figures are kept as JSON under ``HF_LOWZERO_CACHE`` (default ``~/.cache/hf_lowzero``), keyed by
the CPU, its core count, torch's version and the figures' version (``FIGURES``); delete the file to measure again.

Example::

    device = cpu_device()            # measured on the first call, read from the cache after
    device.measured["gloo_latency_s"], device.matmul_flops["fp32"]
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from datetime import timedelta
from pathlib import Path

import torch

from hf_lowzero.timing.devices import Device
from hf_lowzero.timing.step_rates import step_rates

CACHE_ENV = "HF_LOWZERO_CACHE"
SECONDS_PER_FIGURE = 0.4
PER_TENSOR_SECONDS = 0.015  # each of the multi-tensor ops' timings: short calls, 16 of them
FIGURES = 4  # the figures' version: a cache of other figures is measured again


def cpu_device() -> Device:
    """This machine as a ``Device`` (see the module docstring)."""
    path = cache_path()
    if path.is_file():
        measured = json.loads(path.read_text())
    else:
        measured = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(measured, indent=1))
        os.replace(partial, path)
    return device_from(measured)


def device_from(measured: dict) -> Device:
    """The ``cpu`` device of a calibration's figures (rates at all of its threads)."""
    return Device(
        name="cpu",
        memory_bytes=0,
        matmul_flops={"fp32": measured["matmul_fp32"][1], "bf16": measured["matmul_bf16"][1]},
        memory_bandwidth=measured["bandwidth"][1],
        intra_node=measured["gloo_bandwidth"],
        inter_node=measured["gloo_bandwidth"],
        pcie=measured["bandwidth"][1],
        source=f"measured on this machine ({measured['cpu']}, {measured['threads']} threads)",
        launch_s=0.0,
        dispatch_s=measured["dispatch_s"],
        latency_s=measured["gloo_latency_s"],
        host_flops_per_thread=measured["matmul_fp32"][0],
        host_bandwidth_per_thread=measured["bandwidth"][0],
        host_bandwidth=measured["bandwidth"][1],
        is_host=True,
        measured=measured,
    )


def measure() -> dict:
    """Measure this machine (see the module docstring); about 15 s."""
    threads = torch.get_num_threads()
    figures: dict = {"cpu": platform.processor() or platform.machine(), "threads": threads}
    for name, fn in (("matmul_fp32", _matmul(torch.float32)), ("matmul_bf16", _matmul(torch.bfloat16))):
        figures[name] = [_with_threads(1, fn), _with_threads(threads, fn)]
    figures["bandwidth"] = [_with_threads(1, _bandwidth), _with_threads(threads, _bandwidth)]
    in_step = [step_rates(1), step_rates(threads)]  # [Note: rates in a step] in step_rates.py
    figures["matmul_step"] = [r["matmul_flops"] / alone for r, alone in zip(in_step, figures["matmul_fp32"])]
    figures["attention"] = [r["attention"] for r in in_step]
    one, everyone = (r["attention_by_head"] for r in in_step)  # {head size: {keys: rate}}
    figures["attention_by_head"] = {
        h: {keys: [rate, everyone.get(h, {}).get(keys, rate)] for keys, rate in by_keys.items()}
        for h, by_keys in one.items()
    }
    figures["bandwidth_math"] = [r["bandwidth_math"] for r in in_step]
    figures["math"] = {op: [one, in_step[1]["math"].get(op, one)] for op, one in in_step[0]["math"].items()}
    figures["dispatch_s"] = _with_threads(1, _dispatch)  # Python's share: one thread (more spin on a loaded machine)
    figures["per_tensor_s"] = _with_threads(1, _per_tensor)  # [Note: a cost per tensor]
    figures.update(_gloo())
    return figures


def _with_threads(n: int, fn) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _rate(work_per_call: float, call, seconds: float = SECONDS_PER_FIGURE) -> float:
    """Work per CPU second per thread of ``call`` ([Note: calibrated in CPU time]), repeated for about
    ``seconds`` of CPU time (the best of three)."""
    call()
    best = float("inf")
    threads = torch.get_num_threads()
    for _ in range(3):
        calls, start = 0, time.process_time()
        while (elapsed := time.process_time() - start) < seconds / 3:
            call()
            calls += 1
        best = min(best, elapsed / threads / calls)
    return work_per_call / best


def _matmul(dtype: torch.dtype):
    n = 512
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return lambda: _rate(2 * n**3, lambda: torch.mm(a, b))


def _bandwidth() -> float:
    """Bytes per second of the ops around a transformer's matmuls ([Note: elementwise bandwidth])."""
    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB: a small model's activations, as the step's
    norm = torch.nn.LayerNorm(512)

    def block() -> None:
        h = norm(x)
        y = torch.nn.functional.gelu(h) * h + x
        torch.softmax(y, dim=-1).sum().backward()

    return _bytes_per_second(block)


def _bytes_per_second(block) -> float:
    """The bytes ``block``'s ops move per second of their own, its ops' dispatch left out."""
    ops, nbytes = _counted(block)
    seconds = 1.0 / _rate(1.0, block) - ops * _with_threads(1, _dispatch)
    return nbytes / max(seconds, 1e-9)


def _counted(fn) -> tuple[int, int]:
    """The ops ``fn`` issues (queries left out) and their bytes, as ``counting.py`` counts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_lowzero.timing.counting import is_query, op_work

    found = [0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not is_query(func):
                found[0] += 1
                found[1] += op_work(func, args, kwargs or {}, out).nbytes
            return out

    with Count():
        fn()
    return found[0], found[1]


def _dispatch() -> float:
    """Seconds per aten op of a small MLP's eager forward and backward (its kernels next to nothing)."""
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(8)])
    x = torch.randn(2, 8)

    def step() -> None:
        model(x).sum().backward()

    return 1.0 / _rate(1.0, step) / _counted(step)[0]


def _per_tensor() -> dict[str, float]:
    """CPU seconds for each tensor of a multi-tensor op ([Note: a cost per tensor]): the ops of a
    Trainer's step over 64 tensors of 4 elements, less over one, per tensor."""
    small = [[torch.randn(4) for _ in range(64)] for _ in range(4)]
    step = torch.tensor(1.0)
    adamw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0, "eps": 1e-8, "amsgrad": False,
             "maximize": False}  # fmt: skip
    ops = {
        "aten._foreach_norm": lambda n: torch._foreach_norm(small[0][:n]),
        "aten._foreach_mul_": lambda n: torch._foreach_mul_(small[0][:n], step),
        "aten._foreach_add_": lambda n: torch._foreach_add_(small[0][:n], small[1][:n]),
        "aten._fused_adamw_": lambda n: torch._fused_adamw_(*(t[:n] for t in small), [], [step] * n, **adamw),
    }
    seconds = {name: [1.0 / _rate(1.0, functools.partial(op, n), PER_TENSOR_SECONDS) for n in (64, 1)]
               for name, op in ops.items()}  # fmt: skip
    return {name: max(many - one, 0.0) / 63 for name, (many, one) in seconds.items()}


def _gloo() -> dict:
    """Gloo's all-reduce between two ranks of this machine: two groups in two threads of this
    process over loopback TCP, as two local processes talk (no process to start: this may run
    inside a rank or a pool's worker)."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("calibrate", store), rank, 2, timedelta(seconds=60))

    def seconds_per_all_reduce(numel: int, repeats: int) -> float:
        tensors = [torch.ones(numel), torch.ones(numel)]

        def run(rank: int) -> None:
            for _ in range(repeats):
                groups[rank].allreduce([tensors[rank]]).wait()

        _in_threads(run)  # warm
        best = float("inf")
        for _ in range(3):
            start = time.process_time()  # both ranks' CPU seconds: each rank's side is half
            _in_threads(run)
            best = min(best, (time.process_time() - start) / 2 / repeats)
        return best

    _in_threads(join)
    latency = seconds_per_all_reduce(1, 100)
    large = 4 * 2**20  # 16 MiB: a ring all-reduce of two ranks sends it once (2(n-1)/n = 1)
    seconds = seconds_per_all_reduce(large, 8)
    return {"gloo_latency_s": latency, "gloo_bandwidth": large * 4 / max(seconds - latency, 1e-9)}


def _in_threads(fn) -> None:
    import threading

    threads = [threading.Thread(target=fn, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def cache_path() -> Path:
    """Where this machine's figures are kept (see the module docstring)."""
    machine = f"{platform.processor()}|{platform.machine()}|{os.cpu_count()}"
    key = f"{FIGURES}|{machine}|{torch.__version__}|{torch.get_num_threads()}"
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "hf_lowzero")) / f"timing_cpu_{tag}.json"
