"""The cost model: seconds for each piece of a step's work on a ``Target`` ([Note: the cost model]).

Example::

    costs = Costs(Target.of("H100"))
    costs.kernel(op_work(func, args, kwargs, out))       # max(FLOPs / rate, bytes / bandwidth) + launch
    costs.collective("reduce_scatter", 2**28, 8)          # latency + 7/8 * bytes / bus bandwidth

# [Note: the cost model]
# - A kernel on a GPU costs the larger of its FLOPs at the matmul rate of its dtype and its bytes at
#   memory bandwidth, plus a launch cost. Both rates are taken at ``MATMUL_EFFICIENCY`` and
#   ``MEMORY_EFFICIENCY`` of the datasheet's peak: what large, well-shaped kernels reach.
# - An op on host tensors (offload's host step, the CPU's own ops) costs the same at the host's rates,
#   which grow with its threads up to the machine's bandwidth.
# - The host pays ``dispatch_s`` for every op it issues, kernel or not; a kernel starts no earlier
#   than the host issued it, so a step of many small ops is the host's speed.
# - A copy between host and device memory costs its bytes at the PCIe rate.
# - A collective costs a latency plus its algorithm's bytes over the bus bandwidth of its group:
#   ring all-reduce 2(n-1)/n of the tensor, reduce-scatter, all-gather and all-to-all (n-1)/n, a
#   send or receive the whole; over the network where the group spans nodes (``Target.bus_bandwidth``).
#   A group of one sends nothing.
# - On ``cpu`` every op is the host's, at the rates ``calibrate.py`` measured at one thread and at
#   all (efficiency 1; in between, linear up to all's), and a collective is gloo's measured latency
#   and bandwidth. Its flash attention takes its FLOPs at the attention rate it measured for its
#   head size (between two sizes measured, on a line in their logarithms) and its keys per sequence
#   (1 / rate = a + b / keys, through the two lengths measured), a multi-tensor op pays for each of
#   its tensors ([Note: a cost per tensor] in ``calibrate.py``), and the
#   ops that compute per element their bytes at the bandwidth it measured for them ([Note: the
#   CPU's own rates] in ``calibrate.py``), each per-element op it ran in its reference step at the
#   bandwidth that op reached there, and the matmuls at the rate they reached there ([Note: rates
#   in a step] in ``step_rates.py``); a calibration without them prices these as the others.

# [Note: autocast on fake GPUs]
# The plain Trainer's row (stage 0) trains fp32 params under 16-bit autocast. On a GPU, autocast
# runs its matmuls in 16 bits; on the fake GPUs of a CPU-only torch, ``torch.autocast("cuda")`` is
# disabled (no CUDA) and they run in fp32. ``Costs(autocast=True)`` prices fp32 matmuls at the
# 16-bit rate for that row; the bytes of the ops around them stay fp32's (an overestimate).
"""

from __future__ import annotations

import math

from hf_lowzero.timing.counting import CPU_ATTENTION, PER_ELEMENT_MATH, OpWork
from hf_lowzero.timing.devices import Target

MATMUL_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.8

# The share of a collective's tensor each rank sends, as a function of the group size n.
ALGORITHM_BYTES = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "broadcast": lambda n: 1.0,
    "barrier": lambda n: 0.0,
}


class Costs:
    """Seconds for each kind of work on ``target`` ([Note: the cost model])."""

    def __init__(self, target: Target, autocast: bool = False) -> None:
        self.target = target
        device = target.device
        threads = target.host_threads
        if device.is_host:  # measured with one thread and with all: in between, linear up to all's
            m = device.measured
            in_step = _at_threads(m.get("matmul_step", [1.0, 1.0]), threads)  # [Note: rates in a step]
            self.matmul = {d: _at_threads(m[f"matmul_{d}"], threads) * in_step for d in ("fp32", "bf16")}
            self.bandwidth = _at_threads(m["bandwidth"], threads)
            self.host_flops, self.host_bandwidth = self.matmul["fp32"], self.bandwidth
            # [Note: the CPU's own rates]: per op, a FLOP rate (attention) or a bandwidth (per-element math)
            self.own_flops = _per_op(m, "attention", CPU_ATTENTION, threads)
            self.own_bandwidth = _per_op(m, "bandwidth_math", PER_ELEMENT_MATH, threads)
            self.own_bandwidth.update({op: _at_threads(rate, threads) for op, rate in m.get("math", {}).items()})
            by_head = m.get("attention_by_head", {})  # {head size: {keys: [one, all]}}
            self.attention_by_head = sorted(
                (int(h), _per_key(sorted((int(k), _at_threads(r, threads)) for k, r in by_keys.items())))
                for h, by_keys in by_head.items()
                if isinstance(by_keys, dict)  # an older cache's [one, all] at one length: the rate over all
            )
            self.per_tensor = m.get("per_tensor_s", {})  # [Note: a cost per tensor] in calibrate.py
            measured = list(self.per_tensor.values())
            self.per_tensor_otherwise = sum(measured) / len(measured) if measured else 0.0  # an op not measured
        else:
            self.matmul = {dtype: rate * MATMUL_EFFICIENCY for dtype, rate in device.matmul_flops.items()}
            self.bandwidth = device.memory_bandwidth * MEMORY_EFFICIENCY
            if autocast:  # [Note: autocast on fake GPUs]
                self.matmul["fp32"] = self.matmul["bf16"]
            self.host_flops = device.host_flops_per_thread * threads
            self.host_bandwidth = min(device.host_bandwidth_per_thread * threads, device.host_bandwidth)
            self.own_flops, self.own_bandwidth, self.attention_by_head, self.per_tensor = {}, {}, [], {}
            self.per_tensor_otherwise = 0.0

    @property
    def dispatch(self) -> float:
        """The host's cost of issuing one op."""
        return self.target.device.dispatch_s

    def kernel(self, work: OpWork) -> float:
        """A kernel on the device (on ``cpu``: the op on the host)."""
        if not work.launches:
            return 0.0
        flops_rate = self.own_flops.get(work.name)
        if flops_rate is not None and work.head_size and self.attention_by_head:
            flops_rate = _by_head_size(self.attention_by_head, work.head_size, work.tokens)
        if flops_rate is not None:
            return work.flops / flops_rate + self.target.device.launch_s
        compute = work.flops / self.matmul.get(work.matmul_dtype, self.matmul["fp32"])
        bandwidth = self.own_bandwidth.get(work.name, self.bandwidth)
        return max(compute, work.nbytes / bandwidth) + self._per_tensors(work) + self.target.device.launch_s

    def _per_tensors(self, work: OpWork) -> float:
        """A multi-tensor op's cost for its tensors on a CPU ([Note: a cost per tensor])."""
        return work.tensors * self.per_tensor.get(work.name, self.per_tensor_otherwise)

    def host(self, work: OpWork) -> float:
        """An op on host tensors, at the host's rates for its threads."""
        if not work.launches:
            return 0.0
        if self.target.device.is_host:  # the device is the host: its measured rates per dtype
            return self.kernel(work)
        return max(work.flops / self.host_flops, work.nbytes / self.host_bandwidth)

    def copy(self, nbytes: int) -> float:
        """A copy of ``nbytes`` between host and device memory."""
        return nbytes / self.target.device.pcie + self.target.device.launch_s

    def collective(self, op: str, nbytes: int, group_size: int) -> float:
        """A collective ``op`` on a tensor of ``nbytes`` (the larger of input and output) over ``group_size`` ranks."""
        if group_size <= 1:
            return self.target.device.launch_s
        share = ALGORITHM_BYTES.get(op, ALGORITHM_BYTES["all_reduce"])(group_size)
        return self.target.device.latency_s + share * nbytes / self.target.bus_bandwidth(group_size)


def _per_op(measured: dict, figure: str, ops: frozenset, threads: int) -> dict[str, float]:
    """``figure``'s rate at ``threads`` for each of ``ops``; none when the calibration lacks it."""
    if figure not in measured:
        return {}
    rate = _at_threads(measured[figure], threads)
    return dict.fromkeys(ops, rate)


def _per_key(measured: list[tuple[int, float]]) -> tuple[float, float]:
    """An attention's seconds per FLOP ``(a, b)`` at ``keys`` keys per sequence, ``a + b / keys``,
    through the rates measured at two lengths (``[(keys, rate), ...]``): a cost per score and one per
    row of queries ([Note: rates in a step]). One length, or a longer one measured slower (noise): its
    rate at every length (their mean)."""
    (short, short_rate), (long, long_rate) = measured[0], measured[-1]
    if long <= short or long_rate <= short_rate:
        rate = sum(r for _, r in measured) / len(measured)
        return 1.0 / rate, 0.0
    b = (1.0 / short_rate - 1.0 / long_rate) / (1.0 / short - 1.0 / long)
    a = 1.0 / long_rate - b / long
    if a <= 0:  # a rate growing as fast as the keys: no law of this kind, noise
        return 2.0 / (short_rate + long_rate), 0.0
    return a, b


def _by_head_size(measured: list[tuple[int, tuple[float, float]]], head_size: int, keys: int) -> float:
    """The attention rate for ``head_size`` over ``keys`` keys (``_per_key``'s law at each head size
    measured; no keys known: the law's limit): between two measured sizes, along a line in their
    logarithms; beyond them, the nearest's."""

    def rate(law: tuple[float, float]) -> float:
        a, b = law
        return 1.0 / (a + (b / keys if keys else 0.0))

    if head_size <= measured[0][0]:
        return rate(measured[0][1])
    for (low, low_law), (high, high_law) in zip(measured, measured[1:]):
        if head_size <= high:
            share = math.log(head_size / low) / math.log(high / low)
            return rate(low_law) + share * (rate(high_law) - rate(low_law))
    return rate(measured[-1][1])


def _at_threads(measured: list[float], threads: int) -> float:
    """A rate measured at one thread and at all (``[one, all]``) for ``threads`` threads."""
    one, everyone = measured
    return one if threads <= 1 else max(one, min(threads * one, everyone))
