"""What a memory plan is asked: ``plan_memory``'s inputs, checked, with every default derived here.

``plan_memory`` turns its arguments into a ``PlanRequest``; the Trainer's ``zero_stage="auto"``
calls ``plan_memory`` with what it measured and nothing more, so both take one path ([Note: one
plan for the Trainer and the user]).

Example::

    request = PlanRequest.of(args, world_size=8, device_memory="80GiB", seq_len=2048)
    request.device_memory, request.backend        # 85899345920, "nccl" (args without use_cpu)

# [Note: one plan for the Trainer and the user]
# The Trainer passes what only the running job knows: its world size, the device memory
# (``zero_device_memory``, or what is free on the device it trains on), the node's available RAM and
# its ranks on the node (``LOCAL_WORLD_SIZE``), and the data's sequence length. Everything else is
# derived here from the arguments, as for a user's call: the batch, the precision, the optimizer,
# and the backend, ``planned_backend(args)``. The backend was once derived twice: the Trainer took
# gloo for a CPU device while ``plan_memory`` defaulted to NCCL, and the two simulate different
# code (gloo's CPU scratch pool keeps the collectives' buffers, which CUDA's caching allocator
# recycles): a 2-rank CPU Trainer of a small GPT-2 at 120 MiB took stage 1 + offload while
# ``plan_memory`` on the same arguments recommended stage 1. The one run this rule plans for a
# device it does not train on: a single process without a GPU and without ``use_cpu`` trains on
# the CPU (transformers' fallback) and plans GPUs, as ``plan_memory`` does for those arguments; at
# one rank the two plans differ only by the attention kernel (40 KiB of 93 MiB for that GPT-2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

RESERVE = 0.10  # of device memory, kept for what is not a tensor: CUDA context, allocator fragmentation
BACKENDS = ("nccl", "gloo")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12}
_UNITS |= {"tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class PlanRequest:
    """``plan_memory``'s inputs, checked and resolved: sizes in bytes, no default left open but
    ``seq_len`` (None: the model's maximum positions, capped at 2048, known once the model is)."""

    world_size: int
    device_memory: int
    seq_len: int | None
    host_memory: int | None
    ranks_per_node: int
    ref_model: bool
    reserve: float
    backend: str
    # what the steps are timed for: ``Target.of``'s keywords (hf_lowzero.timing), the device named
    target: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        args: Any,
        *,
        world_size: int = 1,
        device_memory: int | str,
        seq_len: int | None = None,
        host_memory: int | str | None = None,
        ranks_per_node: int | None = None,
        ref_model: bool = False,
        reserve: float = RESERVE,
        backend: str | None = None,
        target: str | dict[str, Any] | None = None,
    ) -> PlanRequest:
        """The request for ``args`` (``TrainingArguments`` or None) and ``plan_memory``'s keyword
        arguments, each as documented there; raises ``ValueError`` naming an invalid one."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid; expected the number of data-parallel ranks (>= 1)")
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve={reserve!r} is invalid; expected a fraction of device memory in [0, 1)")
        ranks_per_node = ranks_per_node or min(world_size, 8)
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(
                f"ranks_per_node={ranks_per_node!r} is invalid; expected the ranks sharing a node's RAM (>= 1)"
            )
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"seq_len={seq_len!r} is invalid; expected tokens per sample (>= 1)")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(
                f"backend={backend!r} is invalid; expected 'nccl' (GPUs), 'gloo' (CPU) or None (from the arguments)"
            )
        backend = backend or planned_backend(args)
        return cls(
            world_size=world_size,
            device_memory=parse_bytes(device_memory, "device_memory"),
            seq_len=seq_len,
            host_memory=parse_bytes(host_memory, "host_memory") if host_memory is not None else None,
            ranks_per_node=ranks_per_node,
            ref_model=bool(ref_model),
            reserve=reserve,
            backend=backend,
            target=timing_target(target, backend),
        )


def timing_target(target: str | dict[str, Any] | None, backend: str) -> dict[str, Any]:
    """``Target.of``'s keywords for ``target`` (a device's name, or the keywords), checked; None: this
    machine's GPU when the table knows it, else an H100, for GPUs; ``"cpu"`` (this machine) for gloo."""
    from hf_lowzero.timing.devices import Target, default_device

    if target is None:
        target = {"device": default_device(backend)}
    elif isinstance(target, str):
        target = {"device": target}
    elif not isinstance(target, dict) or "device" not in target:
        raise ValueError(
            f"target={target!r} is invalid; expected a device's name (such as 'H100' or 'cpu') or a dict of "
            "Target.of's keywords with 'device'"
        )
    Target.of(**{k: v for k, v in target.items() if k != "device"}, device=target["device"])  # checks it now
    return dict(target)


def planned_backend(args: Any) -> str:
    """The backend a run of ``args`` uses: ``"gloo"`` when it trains on CPU (``use_cpu``), else
    ``"nccl"``; None (no arguments) plans GPUs. Read from the arguments alone, not from this
    machine, so a laptop plans the GPU run its arguments describe."""
    return "gloo" if args is not None and getattr(args, "use_cpu", False) else "nccl"


def parse_bytes(value: int | float | str, name: str = "memory") -> int:
    """``"80GiB"``, ``"40 GB"``, ``"512MiB"`` or a number of bytes -> bytes.

    Example::

        >>> parse_bytes("80GiB")
        85899345920

    Args:
        value: A positive number of bytes, or a size with an optional unit: B, kB/MB/GB/TB (powers of
            1000; k/m/g/t alike), KiB/MiB/GiB/TiB (powers of 1024); case does not matter.
        name: The setting's name, for the error message.

    Returns:
        The size in bytes.

    Raises:
        ValueError: ``value`` is a bool, not positive, or not a size in a known unit.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid; expected a size such as 80GiB, 40GB or a number of bytes")
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"{name}={value!r} is invalid; expected a positive size such as 80GiB, 40GB, 512MiB or a number of bytes"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
