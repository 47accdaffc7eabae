"""A simulated step as records: what it runs (``Setup``, ``TrainingSpec``, ``SimulatedStep``) and
what it holds (``StepMemory``, split into ``PARTS``). ``simulate.py`` runs it.

Example::

    training = TrainingSpec.from_args(args)                  # LowZeroTrainingArguments or TrainingArguments
    step = SimulatedStep(spec=spec, training=training, setup=Setup(stage=2), world_size=8, batch_size=4, seq_len=1024)
    training.zero_config(Setup(stage=1, offload=True)).offload_optimizer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.timing.record import Program
from hf_lowzero.zero.inner.policy import choose_partition
from hf_lowzero.zero.zero_config import ZeroConfig

PARTS = ("params", "gradients", "master", "optimizer_state", "frozen", "activations", "buffers")


@dataclass(frozen=True)
class Setup:
    """A way to run data-parallel training: ZeRO stage 0 (plain DDP), 1 or 2, with or without
    optimizer offload (stages 1 and 2 only)."""

    stage: int
    offload: bool = False

    def __post_init__(self) -> None:
        if self.stage == 0 and self.offload:
            raise ValueError("optimizer offload needs ZeRO stage 1 or 2 (plain DDP keeps its optimizer on the device)")

    @property
    def label(self) -> str:
        name = "stage 0 (DDP)" if self.stage == 0 else f"stage {self.stage}"
        return name + (" + offload" if self.offload else "")


@dataclass
class TrainingSpec:
    """What of the Trainer's arguments decides memory: precision, optimizer, micro-batches, gradient
    checkpointing and the ZeRO knobs."""

    dtype: torch.dtype  # the training precision: params' dtype under ZeRO, autocast's under stage 0
    optimizer_cls: type
    optimizer_kwargs: dict[str, Any]
    optim_name: str = "adamw_torch"
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    checkpointing_kwargs: dict | None = None
    zero: dict[str, Any] = field(default_factory=dict)  # ZeroConfig fields other than stage and offload

    @classmethod
    def from_args(cls, args, zero_config: ZeroConfig | None = None) -> TrainingSpec:
        """From ``TrainingArguments`` (any subclass; the ``zero_*`` fields when it has them), or with
        ``zero_config``'s ZeRO fields for plain ``TrainingArguments``."""
        from transformers import Trainer

        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
        zero: dict[str, Any] = {"clip_grad_norm": float(args.max_grad_norm or 0.0)}
        config = zero_config or (args.to_zero_config(stage=2) if hasattr(args, "to_zero_config") else None)
        if config is not None:
            zero = {
                name: getattr(config, name)
                for name in ZeroConfig.__dataclass_fields__
                if name not in ("stage", "offload_optimizer", "process_group")
            }
        return cls(
            dtype=dtype,
            optimizer_cls=optimizer_cls,
            optimizer_kwargs=kwargs,
            optim_name=str(getattr(args.optim, "value", args.optim)),
            batch_size=int(args.per_device_train_batch_size),
            gradient_accumulation_steps=int(args.gradient_accumulation_steps),
            gradient_checkpointing=bool(args.gradient_checkpointing),
            checkpointing_kwargs=args.gradient_checkpointing_kwargs,
            zero=zero,
        )

    def zero_config(self, setup: Setup, process_group=None) -> ZeroConfig:
        partition = choose_partition(
            self.optimizer_cls, self.zero.get("partition", "auto"), self.zero.get("allow_untested_optimizer", False)
        )
        # A step without integrity checks: their scratch is bounded and small ([Note: what the
        # simulation leaves out]), and a plan's steps are not checked against anything.
        fields = self.zero | {"partition": partition, "verify_every": "off"}
        return ZeroConfig(**fields, stage=setup.stage, offload_optimizer=setup.offload, process_group=process_group)


@dataclass(frozen=True, kw_only=True)
class SimulatedStep:
    """One step to simulate, described once: ``simulate_step`` builds it; the world it runs in
    (``fake_world.py``) and the run (``simulate._run``) read it.
    """

    spec: ModelSpec  # the model (on fake CPU tensors for GPUs: as on a GPU, [Note: attention on the GPU])
    training: TrainingSpec
    setup: Setup
    world_size: int
    batch_size: int  # per device
    seq_len: int  # tokens per sample
    rank: int = 0  # the rank it runs as
    fake: bool = True  # under FakeTensorMode on a fake process group; False: real tensors, the caller's group
    ref_model: bool = False  # a frozen reference copy of the model runs too (DPO, GRPO)
    device: torch.device | None = None  # the GPU it runs on (a fake one on fake tensors); None: the CPU
    backend: str = "nccl"  # what a fake process group stands for: "nccl" (GPUs) or "gloo" (CPU)


@dataclass
class StepMemory:
    """What one rank holds over one training step.

    ``peak`` is the device's peak (host-resident parts excluded); ``breakdown`` splits it into
    ``PARTS`` (``gradients`` as held at the peak, ``activations`` what the forward and backward
    held besides: activations, temporaries, gradients in flight). ``model_states`` is the ZeRO
    paper's model states (params, gradients, master, optimizer state; frozen params included)
    wherever they live; ``host`` what sits in host memory (offload).
    """

    peak: int
    host: int
    breakdown: dict[str, int]
    model_states: int
    sent_bytes: int
    partition: str
    rank: int
    owned_numel: list[int] = field(default_factory=list)  # per rank, with whole-param ownership
    # a real step on a GPU: torch.cuda.max_memory_allocated over it, less what the device held before
    # the run began ([Note: the run's own memory])
    allocator_peak: int | None = None
    device: str = "cpu"  # where the step ran: "cuda" (a fake GPU on fake tensors) or "cpu"
    # the step's own sequence, recorded to be timed (hf_lowzero.timing): fake steps only
    program: Program | None = None
