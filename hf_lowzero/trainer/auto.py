"""``zero_stage="auto"``: the Trainer takes the setup a memory plan of this very run recommends.

At construction, before anything is built on the device, ``resolve_auto_stage`` plans the model
with these arguments on this world size and this much device memory (``zero_device_memory``, or
what is free now on the device the Trainer trains on: ``torch.cuda.mem_get_info`` of that GPU, or
with ``use_cpu`` or no GPU the node's available RAM shared by its ranks), checks offload against
this rank's share of the node's available RAM, sets ``zero_stage`` and ``zero_offload_optimizer``
to the recommended row and logs one line. It calls ``plan_memory`` with what it measured and
nothing more, so ``plan_memory(model, args, ...)`` with those inputs gives its plan ([Note: one
plan for the Trainer and the user] in ``plan/request.py``). With ``auto_find_batch_size`` the
recommended row's largest batch is where the search for a batch that runs starts. When nothing
fits it refuses, naming the largest batch that would.

Example::

    args = LowZeroTrainingArguments(output_dir="out", zero_stage="auto", bf16=True)
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=ds)   # logs the choice
    trainer.args.zero_stage                                              # 1 or 2 (0: plain DDP)
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.planner import MemoryPlan, format_bytes, parse_bytes, plan_memory

logger = logging.getLogger(__name__)
SAMPLES_FOR_SEQ_LEN = 64  # dataset items looked at for the sequence length to plan for


def resolve_auto_stage(args, model, train_dataset=None) -> MemoryPlan:
    """Plan this run and write the recommended setup into ``args`` (see the module docstring)."""
    if model is None:
        raise ValueError(
            "zero_stage='auto' plans for the model the Trainer is given: pass model=... (model_init builds it "
            "later, too late to choose a stage), or set zero_stage to 0, 1 or 2"
        )
    spec = ModelSpec.from_source(model)
    memory = parse_bytes(args.zero_device_memory, "zero_device_memory") if args.zero_device_memory else None
    # What only this job knows; plan_memory derives the rest from args, the backend included, as
    # for a user's call ([Note: one plan for the Trainer and the user] in plan/request.py).
    measured = dict(
        world_size=args.world_size,
        device_memory=memory or free_device_memory(args.device),  # the device the Trainer trains on
        host_memory=node_available_memory(),
        ranks_per_node=max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        seq_len=_seq_len(train_dataset, spec),
    )
    plan = _plan_once(spec, args, measured)
    best = plan.recommended
    if best is None:
        raise ValueError(f"zero_stage='auto': nothing fits on this device.\n{plan.to_text()}")
    args.zero_stage = best.stage
    if best.stage > 0:
        args.zero_offload_optimizer = best.offload
    if args.auto_find_batch_size and best.max_batch_size > 0:
        args.per_device_train_batch_size = best.max_batch_size
    if dist.is_initialized() and dist.get_rank() != 0:
        return plan  # one line per run, not per rank
    logger.warning(
        "zero_stage=auto: %s, peak %s of %s usable per device, sends %s per step%s (%s)",
        best.label,
        format_bytes(best.peak_bytes),
        format_bytes(plan.usable_memory),
        format_bytes(best.sent_bytes_per_step),
        f"; auto_find_batch_size starts at {best.max_batch_size}" if args.auto_find_batch_size else "",
        plan.reason,
    )
    return plan


def free_device_memory(device: torch.device) -> int:
    """Bytes this rank may use on ``device`` (the Trainer's ``args.device``): that GPU's free memory
    (no other GPU is touched), or on CPU its share of the node's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_share()


def host_share() -> int:
    """This rank's share of the node's available RAM (over the node's ranks, ``LOCAL_WORLD_SIZE``)."""
    return node_available_memory() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def node_available_memory() -> int:
    """The node's available RAM (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _seq_len(train_dataset, spec: ModelSpec) -> int | None:
    """The longest of the first samples' ``input_ids``; None (the model's maximum) when unknown."""
    try:
        lengths = [len(train_dataset[i]["input_ids"]) for i in range(min(SAMPLES_FOR_SEQ_LEN, len(train_dataset)))]
    except (TypeError, KeyError, IndexError):
        return None
    return max(lengths) if lengths else None


def _plan_once(spec: ModelSpec, args, measured: dict) -> MemoryPlan:
    """The plan, made once: by rank 0 and sent to every rank when a process group exists, so that
    all ranks take the same setup (``plan_memory`` then plans in a fresh process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan_memory(spec, args, **measured)
    box = [plan_memory(spec, args, **measured) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
