"""The devices a plan can time, with a source for every figure: ``DEVICES`` and ``Target``.

A ``Device`` holds a GPU's peak rates from its vendor's datasheet (dense, no sparsity) and the
default links of the machines it usually sits in. A ``Target`` is what a plan times for: a device,
how many share a node, the links between them and the host threads each rank has. ``cpu`` is this
machine, measured (``calibrate.py``) instead of looked up.

Example::

    target = Target.of("H100", gpus_per_node=8, inter_node="100Gb/s")
    target.device.matmul_flops["bf16"], target.bus_bandwidth(16)       # 989e12, 12.5e9

# [Note: device figures]
# - ``matmul_flops``: dense Tensor Core rate for bf16/fp16 and the plain fp32 rate (torch does not
#   use TF32 for matmuls unless told), from the datasheet in ``source``.
# - ``memory_bandwidth``: the HBM or GDDR bandwidth of the same datasheet.
# - ``intra_node``: bytes per second one GPU sends to its node's others: NVLink's per-direction half
#   of the datasheet's bidirectional figure on SXM boards, PCIe's per-direction rate otherwise.
# - ``inter_node``: a node's network in bytes per second, all of its NICs together: 8 x 400 Gb/s
#   InfiniBand on HGX H100/H200 (one NIC per GPU), 8 x 200 Gb/s on HGX A100, 100 Gb Ethernet for the
#   PCIe cards' usual nodes. A collective across nodes runs at the smaller of it and ``intra_node``.
# - ``pcie``: host-device copies, per direction (Gen5 x16: 64 GB/s, Gen4 x16: 32 GB/s), at 80%.
# - ``launch_s`` (a kernel's fixed cost on the device), ``dispatch_s`` (the host's cost per op:
#   Python, the dispatcher, the launch), ``latency_s`` (a collective's fixed cost) are typical
#   figures, not datasheet ones; ``cpu`` measures its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

GB = 1e9
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes per second in one Gb/s

# Host figures shared by the GPU rows (the host step with offload; its threads scale them).
HOST_FLOPS_PER_THREAD = 50e9  # fp32 FMA on AVX-512 at ~3 GHz, about a third of peak in practice
HOST_BANDWIDTH_PER_THREAD = 10 * GB
HOST_BANDWIDTH = 200 * GB  # a two-socket server's DDR5, all threads
HOST_THREADS = 4  # per rank: a node's cores shared by its 8 GPUs' ranks, less the data loaders'


@dataclass(frozen=True)
class Device:
    """One kind of device ([Note: device figures]). Rates in FLOP/s and bytes/s, costs in seconds."""

    name: str
    memory_bytes: int
    matmul_flops: dict[str, float]  # "bf16" (also fp16) and "fp32"
    memory_bandwidth: float
    intra_node: float
    inter_node: float
    pcie: float
    source: str
    launch_s: float = 2e-6
    dispatch_s: float = 8e-6
    latency_s: float = 15e-6
    host_flops_per_thread: float = HOST_FLOPS_PER_THREAD
    host_bandwidth_per_thread: float = HOST_BANDWIDTH_PER_THREAD
    host_bandwidth: float = HOST_BANDWIDTH
    is_host: bool = False  # the ranks are CPU processes: every op runs on the host
    measured: dict = field(default_factory=dict)  # cpu: what calibrate.py measured, for the record


def _gpu(name, gib, bf16, fp32, hbm, intra, inter, pcie, source) -> Device:
    return Device(
        name=name,
        memory_bytes=int(gib * 2**30),
        matmul_flops={"bf16": bf16 * TFLOPS, "fp32": fp32 * TFLOPS},
        memory_bandwidth=hbm * GB,
        intra_node=intra * GB,
        inter_node=inter,
        pcie=pcie * GB * 0.8,
        source=source,
    )


ONE_MACHINE = 1 << 16  # cpu's ranks per node by default: all of them on this machine
NODE_IB_400 = 8 * 400 * GBIT
NODE_IB_200 = 8 * 200 * GBIT
NODE_ETH_100 = 100 * GBIT

A10G_SOURCE = "NVIDIA A10 datasheet (AWS publishes no A10G figures; the A10G is clocked lower: an upper bound)"
RTX4090_SOURCE = "NVIDIA Ada Lovelace architecture whitepaper, appendix (GeForce RTX 4090; bf16, fp32 accumulate)"

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _gpu("H100", 80, 989, 67, 3350, 450, NODE_IB_400, 64, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
        _gpu("H200", 141, 989, 67, 4800, 450, NODE_IB_400, 64, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
        _gpu("A100-80GB", 80, 312, 19.5, 2039, 300, NODE_IB_200, 32, "NVIDIA A100 Tensor Core GPU datasheet (SXM)"),
        _gpu("A100-40GB", 40, 312, 19.5, 1555, 300, NODE_IB_200, 32, "NVIDIA A100 Tensor Core GPU datasheet (SXM)"),
        _gpu("A10G", 24, 125, 31.2, 600, 32, NODE_ETH_100, 32, A10G_SOURCE),
        _gpu("L4", 24, 121, 30.3, 300, 32, NODE_ETH_100, 32, "NVIDIA L4 Tensor Core GPU datasheet"),
        _gpu("L40S", 48, 362, 91.6, 864, 32, NODE_ETH_100, 32, "NVIDIA L40S datasheet"),
        _gpu("RTX4090", 24, 165.2, 82.6, 1008, 32, NODE_ETH_100, 32, RTX4090_SOURCE),
    )
}
ALIASES = {"A100": "A100-80GB", "A100-80": "A100-80GB", "A100-40": "A100-40GB", "4090": "RTX4090"}


def device_names() -> list[str]:
    """The names ``--device`` takes: the table's and ``cpu``."""
    return [*DEVICES, "cpu"]


def find_device(name: str) -> Device:
    """The device called ``name`` (case and dashes ignored; ``cpu``: this machine, calibrated).

    Example::

        find_device("h100").memory_bandwidth          # 3.35e12

    Raises:
        ValueError: No device of that name.
    """
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    if key == "cpu":
        from hf_lowzero.timing.calibrate import cpu_device

        return cpu_device()
    table = {re.sub(r"[^a-z0-9]", "", k.lower()): v for k, v in {**DEVICES, **ALIASES}.items()}
    found = table.get(key)
    if found is None:
        raise ValueError(f"--device {name!r} is not one the plan knows; use one of {', '.join(device_names())}")
    return DEVICES[found] if isinstance(found, str) else found


def default_device(backend: str) -> str:
    """The device a plan times for when none is named: ``cpu`` for gloo ranks; for GPUs this
    machine's, when the table has it, else ``H100``."""
    if backend == "gloo":
        return "cpu"
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():  # a real GPU (fake ones: a CPU build)
        return table_name(torch.cuda.get_device_name(0)) or "H100"
    return "H100"


def table_name(gpu_name: str) -> str | None:
    """The table's name for a GPU as CUDA names it, or None when the table lacks it.

    Example::

        >>> table_name("NVIDIA H100 80GB HBM3"), table_name("NVIDIA A100-SXM4-40GB"), table_name("Tesla T4")
        ('H100', 'A100-40GB', None)
    """
    name = gpu_name.upper().replace(" ", "")
    for key in sorted(DEVICES, key=len, reverse=True):
        model, _, memory = key.partition("-")
        if model in name and (not memory or memory in name):
            return key
    return None


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second from ``"400Gb/s"`` (bits), ``"50GB/s"`` (bytes) or a plain number of GB/s.

    Example::

        >>> parse_bandwidth("100Gb/s"), parse_bandwidth("50GB/s"), parse_bandwidth(25)
        (12500000000.0, 50000000000.0, 25000000000.0)

    Raises:
        ValueError: The text is neither a number nor a number with Gb/s, GB/s, Tb/s or TB/s.
    """
    if isinstance(text, (int, float)):
        return float(text) * GB
    match = re.fullmatch(r"\s*([0-9.]+)\s*(?:([GT])([bB])(?:/s|ps)?)?\s*", str(text))
    if match is None:
        raise ValueError(
            f"bandwidth {text!r} is not understood; give it as 400Gb/s (bits), 50GB/s (bytes) or a number of GB/s"
        )
    value, prefix, unit = float(match[1]), match[2] or "G", match[3] or "B"
    return value * (1e12 if prefix == "T" else 1e9) / (8 if unit == "b" else 1)


@dataclass(frozen=True)
class Target:
    """What a plan times: ``device``, ``gpus_per_node`` of them to a node, the links between them, and
    ``host_threads`` per rank for the host's work (offload's step).

    Example::

        Target.of("A100-80GB", gpus_per_node=4, intra_node="200GB/s").bus_bandwidth(8)   # across 2 nodes
    """

    device: Device
    gpus_per_node: int
    intra_node: float
    inter_node: float
    host_threads: int

    @classmethod
    def of(
        cls,
        device: str | Device,
        gpus_per_node: int | None = None,
        intra_node: str | float | None = None,
        inter_node: str | float | None = None,
        host_threads: int | None = None,
    ) -> Target:
        """A target from a device name and optional overrides of its defaults.

        Raises:
            ValueError: An unknown device, a bandwidth not understood, or a count below 1.
        """
        found = find_device(device) if isinstance(device, str) else device
        gpus = gpus_per_node if gpus_per_node is not None else (ONE_MACHINE if found.is_host else 8)
        default_threads = found.measured.get("threads", 1) if found.is_host else HOST_THREADS
        threads = host_threads if host_threads is not None else default_threads
        for name, value in (("gpus_per_node", gpus), ("host_threads", threads)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        intra = parse_bandwidth(intra_node) if intra_node is not None else found.intra_node
        inter = parse_bandwidth(inter_node) if inter_node is not None else found.inter_node
        return cls(found, gpus, intra, inter, threads)

    def bus_bandwidth(self, group_size: int) -> float:
        """Bytes per second a collective over ``group_size`` ranks moves: the slower of the node's
        links and, when the group spans nodes, the network."""
        if group_size > self.gpus_per_node:
            return min(self.intra_node, self.inter_node)
        return self.intra_node

    def with_device(self, **changes) -> Target:
        """This target with some of its device's figures changed (tests, calibration)."""
        return replace(self, device=replace(self.device, **changes))

    def describe(self) -> dict:
        """The target as plain data, for the plan's JSON."""
        d = self.device
        return {
            "device": d.name,
            "gpus_per_node": self.gpus_per_node,
            "intra_node_bytes_per_s": self.intra_node,
            "inter_node_bytes_per_s": self.inter_node,
            "host_threads": self.host_threads,
            "matmul_flops": d.matmul_flops,
            "memory_bandwidth": d.memory_bandwidth,
            "source": d.source,
        }
