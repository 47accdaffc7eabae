"""LowZeroTrainingArguments: TrainingArguments plus the ZeRO switch and knobs, as CLI flags.

``ZeroArguments`` holds the behaviour every ZeRO arguments class shares (validation, the
``ZeroConfig`` the flags describe); ``LowZeroTrainingArguments`` adds the ``zero_*`` fields to
``TrainingArguments``, and ``hf_lowzero.with_zero`` adds the same fields to any other
``TrainingArguments`` subclass (TRL's configs, ``Seq2SeqTrainingArguments``).

Example::

    parser = HfArgumentParser(LowZeroTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", "out", "--zero_stage", "2", "--bf16"])
    args.to_zero_config()   # ZeroConfig(stage=2, clip_grad_norm=1.0, ...)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments

from hf_lowzero.trainer.exact import check_exact_arguments
from hf_lowzero.zero.zero_config import ZeroConfig, check_stage


class ZeroArguments:
    """What every ZeRO arguments class does with its ``zero_*`` fields; mixed in before a
    ``TrainingArguments`` class (``LowZeroTrainingArguments``, or ``with_zero(SFTConfig)``).

    ``max_grad_norm`` becomes ZeRO's global-norm clipping; ``bf16``/``fp16`` become 16-bit params
    with fp32 master rows (no autocast, no GradScaler: the optimizer scales fp16 losses itself).
    Knobs without a flag of their own go in ``zero_config``: a JSON object or the path of a JSON
    file with any ``ZeroConfig`` fields, e.g. ``'{"initial_scale": 1024, "hysteresis": 1}'``.
    """

    zero_stage: int | str
    zero_device_memory: str | None
    zero_reduce_bucket_mb: float | None
    zero_overlap_communication: bool | None
    zero_overlap_allgather: bool | None
    zero_communication_dtype: str | None
    zero_offload_optimizer: bool | None
    zero_partition: str | None
    zero_master_dtype: str | None
    zero_verify_every: str | None
    zero_on_mismatch: str | None
    zero_reduction: str | None
    zero_config: str | None

    def __post_init__(self) -> None:
        if not self.use_cpu and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # accelerate treats a multi-process CPU job as a single process unless use_cpu is set:
            # every rank would then see all the data and log as process 0.
            self.use_cpu = True
        super().__post_init__()
        self.zero_stage = parse_stage(self.zero_stage)
        if self.zero_device_memory is not None:
            from hf_lowzero.plan.planner import parse_bytes

            parse_bytes(self.zero_device_memory, "zero_device_memory")
        self.to_zero_config(stage=2)  # validate every knob now (also with zero_stage=0), not at the first step
        if self.zero_reduction == "exact":
            check_exact_arguments(self)  # [Note: an exact Trainer step]

    @property
    def zero_auto(self) -> bool:
        """``zero_stage="auto"``, not yet resolved by the Trainer (see ``hf_lowzero.trainer.auto``)."""
        return self.zero_stage == "auto"

    @property
    def zero_dtype(self) -> str | None:
        """The 16-bit dtype the params are cast to under ZeRO, or None for fp32."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else None

    def to_zero_config(self, **overrides) -> ZeroConfig:
        """The ZeroConfig these arguments describe (``zero_config`` JSON, then the ``zero_*`` flags).

        Args:
            **overrides (Any): ``ZeroConfig`` fields that take precedence over both.

        Returns:
            The validated configuration; with ``zero_stage`` 0 or ``"auto"`` (not resolved yet) its stage is 2.

        Raises:
            ValueError: ``zero_config`` is neither an existing file nor valid JSON, or is not a JSON object,
                or names an unknown field, or sets ``stage``/``clip_grad_norm`` to another value than
                ``zero_stage``/``max_grad_norm``, or a knob has an invalid value.
            OSError: ``zero_config`` names a file that cannot be read.
        """
        base = _load_json_config(self.zero_config)
        _check_flag_owned(base, "stage", self.zero_stage, "zero_stage")
        _check_flag_owned(base, "clip_grad_norm", float(self.max_grad_norm or 0.0), "max_grad_norm")
        flags = {
            "reduce_bucket_mb": self.zero_reduce_bucket_mb,
            "overlap_communication": self.zero_overlap_communication,
            "overlap_allgather": self.zero_overlap_allgather,
            "communication_dtype": self.zero_communication_dtype,
            "offload_optimizer": self.zero_offload_optimizer,
            "partition": self.zero_partition,
            "master_dtype": self.zero_master_dtype,
            "verify_every": self.zero_verify_every,
            "on_mismatch": self.zero_on_mismatch,
            "reduction": self.zero_reduction,
        }
        base.update({k: v for k, v in flags.items() if v is not None})
        if "overlap_allgather" not in base:
            # On where every reader is known: the Trainer waits before evaluation, saving and callbacks
            # ([Note: params are current] in zero/update/allgather.py). Not with torch.compile: the forward
            # pre-hooks that wait for each bucket's gather would break the compiled graph at every module.
            base["overlap_allgather"] = not self.torch_compile
        stage = 2 if self.zero_stage in (0, "auto") else self.zero_stage
        base.update({"stage": stage, "clip_grad_norm": float(self.max_grad_norm or 0.0)} | overrides)
        try:
            return ZeroConfig(**base)
        except TypeError as e:
            raise ValueError(f"zero_config has an unknown field: {e}") from e


@dataclass
class LowZeroTrainingArguments(ZeroArguments, TrainingArguments):
    """``TrainingArguments`` with ``zero_stage`` (0 = plain Trainer/DDP, 1, 2) and ZeroConfig knobs
    (see ``ZeroArguments``). ``with_zero(TrainingArguments)`` is this class.

    Takes every ``TrainingArguments`` argument, plus the ``zero_*`` ones; each ``zero_*`` knob left
    None takes ``ZeroConfig``'s default (after ``zero_config``).

    Args:
        zero_stage: 0 (off: plain Trainer/DDP), 1 (shard optimizer state), 2 (also gradients) or
            ``"auto"`` (the setup a memory plan of this run recommends: stage and optimizer offload); an
            int or its digits.
        zero_device_memory: With ``zero_stage="auto"``: plan for this much memory per device (e.g.
            ``"40GiB"``), not the free memory.
        zero_reduce_bucket_mb: MiB of gradient per reduction bucket (``ZeroConfig.reduce_bucket_mb``).
        zero_overlap_communication: Overlap gradient reduction with backward
            (``ZeroConfig.overlap_communication``).
        zero_overlap_allgather: Leave the all-gather of updated params in flight after the step, the
            next forward waiting for each where it first reads it (``ZeroConfig.overlap_allgather``; on
            in the Trainer, which waits before evaluation, saving and callbacks; off with ``torch_compile``).
        zero_communication_dtype: The dtype of gradient reductions: ``"fp32"``, ``"bf16"`` or ``"fp16"``
            (default: the params' dtype).
        zero_offload_optimizer: Keep the fp32 master weights, optimizer state and gradient rows in host
            memory (``ZeroConfig.offload_optimizer``).
        zero_partition: How ranks own optimizer state: ``"rows"``, ``"params"`` or ``"auto"``
            (``ZeroConfig.partition``).
        zero_master_dtype: The dtype of the master rows between steps: ``"fp32"`` or ``"bf16"``
            (``ZeroConfig.master_dtype``).
        zero_verify_every: Integrity checks every this many steps, ``"auto"`` or ``"off"``
            (``ZeroConfig.verify_every``).
        zero_on_mismatch: A failed integrity check: ``"raise"`` or ``"rollback"`` (``ZeroConfig.on_mismatch``).
        zero_reduction: ``"ddp"`` (float sums) or ``"exact"`` (integer sums, and every other part of a step
            made independent of the world size: the same bits at any world size; ``ZeroConfig.reduction``).
        zero_config: Other ``ZeroConfig`` fields: a JSON object, or the path of a JSON file holding one.

    Raises:
        ValueError: ``zero_stage`` or ``zero_device_memory`` is invalid, or a knob or ``zero_config`` is
            (also with ``zero_stage=0``): every one is validated at construction, not at the first step.
            ``TrainingArguments``' own checks raise as they do there.
        OSError: ``zero_config`` names a file that cannot be read.
    """

    zero_stage: str = field(
        default=0,
        metadata={
            "help": "ZeRO stage: 0 = off (plain Trainer/DDP), 1 = shard optimizer state, 2 = also gradients, "
            "auto = the setup a memory plan of this run recommends (stage and optimizer offload)"
        },
    )
    zero_device_memory: str | None = field(
        default=None,
        metadata={"help": "With --zero_stage auto: plan for this much memory per device (e.g. 40GiB), not the free"},
    )
    zero_reduce_bucket_mb: float | None = field(
        default=None, metadata={"help": "MiB of gradient per reduction bucket (25)"}
    )
    zero_overlap_communication: bool | None = field(
        default=None, metadata={"help": "Overlap gradient reduction with backward (True)"}
    )
    zero_overlap_allgather: bool | None = field(
        default=None,
        metadata={
            "help": "Hide the all-gather of updated params behind the next forward: it waits for each param where "
            "it first reads it (True; False with --torch_compile)"
        },
    )
    zero_communication_dtype: str | None = field(
        default=None, metadata={"help": "dtype of gradient reductions: fp32, bf16, fp16 (default: the params' dtype)"}
    )
    zero_offload_optimizer: bool | None = field(
        default=None,
        metadata={"help": "Keep fp32 master weights, optimizer state and gradient rows in host memory (False)"},
    )
    zero_partition: str | None = field(
        default=None,
        metadata={
            "help": "How ranks own optimizer state: rows (slices of every tensor: element-wise optimizers), "
            "params (whole tensors: any optimizer), auto (rows for element-wise optimizers, else params; default)"
        },
    )
    zero_master_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of the master rows between steps: fp32 (default) or bf16 (2 bytes per owned param fewer; "
            "the step computes in fp32 and rounds back stochastically: see docs/mixed-precision.md)"
        },
    )
    zero_verify_every: str | None = field(
        default=None,
        metadata={
            "help": "Integrity checks (replicas hashed and compared, reductions checked by checksums): every N "
            "steps, auto (within 1% of step time; default) or off"
        },
    )
    zero_on_mismatch: str | None = field(
        default=None,
        metadata={
            "help": "A failed integrity check: raise (IntegrityError on every rank; default) or rollback (on Ray: "
            "restart from the newest verified memory snapshot)"
        },
    )
    zero_reduction: str | None = field(
        default=None,
        metadata={
            "help": "How gradients are summed: ddp (in floating point, as DDP; default) or exact (in integers, with "
            "micro-batches, loss normalization and dropout made independent of the world size: the same bits at "
            "any world size for the same global batch; see docs/exact-reduction.md)"
        },
    )
    zero_config: str | None = field(
        default=None, metadata={"help": "Other ZeroConfig fields: a JSON object or a path to a JSON file"}
    )


def parse_stage(value: object) -> int | str:
    """``zero_stage`` as given (an int, or a flag's string): 0, 1, 2 or ``"auto"``.

    Args:
        value: The stage: an int, its digits, or ``"auto"`` (any case, surrounding blanks ignored).

    Returns:
        0, 1 or 2 as an int, or ``"auto"``.

    Raises:
        ValueError: ``value`` is none of those.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, str):
        raise ValueError(
            f"zero_stage={value!r} is invalid; expected 0 (off: plain DDP), 1 (shard optimizer states), "
            "2 (also shard gradients) or auto (what a memory plan of this run recommends)"
        )
    return check_stage(value, "zero_stage", allow_off=True)


def _load_json_config(value: str | None) -> dict:
    """``zero_config`` parsed: the JSON object it holds, or the one in the file it names."""
    if not value:
        return {}
    try:
        is_file = Path(value).is_file()
    except (OSError, ValueError):  # e.g. a JSON text too long for a file name
        is_file = False
    text = Path(value).read_text() if is_file else value
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        what = (
            f"the file zero_config={value!r} is not valid JSON"
            if is_file
            else f"zero_config={value!r} is neither an existing file nor valid JSON"
        )
        raise ValueError(
            f"{what} ({e}); expected a JSON object of ZeroConfig fields, e.g. '{{\"initial_scale\": 1024}}', "
            "or the path of a file holding one"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"zero_config must be a JSON object of ZeroConfig fields, got {type(data).__name__}")
    return data


def _check_flag_owned(zero_config: dict, key: str, flag_value: object, flag: str) -> None:
    """``zero_config`` may repeat a field its own flag sets, but not contradict it."""
    if key in zero_config and zero_config[key] != flag_value:
        raise ValueError(
            f"zero_config sets {key}={zero_config[key]!r} but {flag}={flag_value!r}; {flag} sets it: "
            f"give the value as {flag} and drop {key!r} from zero_config"
        )
