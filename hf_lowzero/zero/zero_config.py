"""ZeroConfig: every knob of the sharded optimizer, its default and its validation.

The optimizer, the Trainer flags and the Ray job all read this one class.

Example::

    >>> cfg = ZeroConfig(stage=1, reduce_bucket_mb=50, clip_grad_norm=1.0)
    >>> cfg.with_overrides(overlap_communication=False).overlap_communication
    False
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from hf_lowzero.zero.auto_interval import Budget, Median, Smoothed

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype, field_name: str) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (fp32, fp16, bf16 only).

    Args:
        value: A dtype name (``"fp32"``, ``"float32"``, ``"fp16"``, ``"float16"``, ``"half"``, ``"bf16"``,
            ``"bfloat16"``; any case, ``"torch."`` prefix allowed) or one of those torch dtypes.
        field_name: The ``ZeroConfig`` field it is for, for the error message.

    Returns:
        The torch dtype.

    Raises:
        ValueError: ``value`` is not one of those.
    """
    if isinstance(value, torch.dtype):
        if value in _DTYPE_NAMES.values():
            return value
    elif isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise ValueError(
        f"ZeroConfig.{field_name}={value!r} is not a supported dtype; "
        f"use one of {sorted(set(_DTYPE_NAMES))} or the matching torch.dtype"
    )


def check_stage(value: object, field_name: str, allow_off: bool = False) -> int:
    """The one validation of a ZeRO stage: 1 or 2, or also 0 (off) where ``allow_off``.

    Used by ``ZeroConfig.stage``, the Trainer's ``zero_stage`` and the Ray job's ``--zero-stage``.

    Args:
        value: The stage.
        field_name: The setting's name, for the error message.
        allow_off: Whether 0 (no ZeRO) is allowed.

    Returns:
        The stage as an int.

    Raises:
        ValueError: ``value`` is not an allowed stage (a bool never is).
    """
    allowed = (0, 1, 2) if allow_off else (1, 2)
    if isinstance(value, bool) or value not in allowed:
        expected = "0 (off: plain DDP), 1 (shard optimizer states) or 2 (also shard gradients)"
        if not allow_off:
            expected = "1 (shard optimizer states) or 2 (also shard gradients); without ZeRO, use no ZeroConfig"
        raise ValueError(f"{field_name}={value!r} is invalid; expected {expected}")
    return int(value)


PARTITIONS = ("auto", "rows", "params")  # ZeroConfig.partition: see [Note: two ways to own a parameter]
MASTER_ROUNDINGS = ("stochastic", "nearest")  # ZeroConfig.master_rounding: see [Note: bf16 masters]
VERIFY_OFF, VERIFY_AUTO = "off", "auto"  # ZeroConfig.verify_every besides an interval
ON_MISMATCH = ("raise", "rollback")
REDUCTIONS = ("ddp", "exact")  # ZeroConfig.reduction: see [Note: exact reduction] in zero/exact/__init__.py
AUTO_OVERHEAD = 0.01  # verify_every="auto" keeps the checks within this fraction of the step time
VERIFY = Budget(  # verify_every's: [Note: the auto interval's budget] in auto_interval.py
    setting="verify_every",
    work="the checks",
    overhead=AUTO_OVERHEAD,
    max_interval=1000,
    off=(VERIFY_OFF,),
    off_text=f"{VERIFY_OFF!r}",
    step_time=lambda: Smoothed(0.2),
    cost=Median,  # each verify step's own
)


def check_verify_every(value: object) -> int | str:
    """``verify_every`` as given (an int, or a flag's string): an interval >= 1, "auto" or "off".

    Args:
        value: An int, its digits, ``"auto"`` or ``"off"`` (any case, surrounding blanks ignored).

    Returns:
        The interval as an int, or ``"auto"`` or ``"off"`` in lower case.

    Raises:
        ValueError: ``value`` is none of those.
    """
    every = VERIFY.check(value)
    return VERIFY_OFF if every is None else every


@dataclass(kw_only=True)
class ZeroConfig:
    """Configuration of :class:`hf_lowzero.LowLevelZeroOptimizer` (see docs/architecture.md).

    Every field is a keyword argument with a default; each field's own description below says more.

    Args:
        stage: 1 (shard optimizer state) or 2 (also shard gradients).
        reduce_bucket_mb: MiB of gradient per reduction bucket (> 0).
        overlap_communication: Reduce each bucket asynchronously during backward as soon as it is complete.
        overlap_allgather: Leave the all-gather of updated params in flight after ``step()``; the next
            forward waits for each bucket where it first reads it. Off here; on in the Trainer and the Ray job.
        check_param_reads: With ``overlap_allgather``: raise at any read of a param whose gather is in flight.
        clip_grad_norm: Clip the global L2 norm of the averaged gradients to this value (>= 0); 0: no clipping.
        communication_dtype: The dtype of gradient reductions (a name or torch dtype); None: each param's own.
        process_group: The data-parallel process group; None: the default group.
        offload_optimizer: Keep the master rows, optimizer state and gradient rows in host memory and step there.
        pin_memory: With offload and CUDA params: page-lock the host buffers.
        partition: ``"rows"``, ``"params"`` or ``"auto"``: how ranks own optimizer state.
        allow_untested_optimizer: Vouch that an optimizer not on the element-wise allow-list is element-wise.
        master_dtype: The master rows' dtype between steps: ``"fp32"`` or ``"bf16"`` (or the torch dtype).
        master_rounding: bf16 masters: ``"stochastic"`` or ``"nearest"`` rounding of each step's result.
        master_rounding_seed: bf16 masters with stochastic rounding: the noise's seed (>= 0).
        initial_scale: fp16: the starting loss scale, within ``[min_scale, max_scale]``.
        growth_factor: fp16: the scale's factor after ``growth_interval`` clean steps (> 1).
        backoff_factor: fp16: the scale's factor on an overflow once hysteresis is used up (in (0, 1)).
        growth_interval: fp16: consecutive clean steps before the scale grows (>= 1).
        hysteresis: fp16: overflows tolerated before the first backoff (>= 1).
        min_scale: fp16: the lowest scale (> 0); an overflow at this scale is an error.
        max_scale: fp16: the highest scale.
        max_consecutive_skips: Raise instead of skipping more than this many steps in a row (>= 1).
        verify_every: Integrity checks every this many steps, ``"auto"`` or ``"off"``.
        on_mismatch: A failed integrity check: ``"raise"`` or ``"rollback"``.
        reduction: ``"ddp"`` (float sums, DDP's bits at a given world size) or ``"exact"`` (integer
            sums: the same bits at any world size).

    Raises:
        ValueError: A field has an invalid value (the message names it and what is expected).
    """

    stage: int = 2
    """1: shard optimizer state (gradients all-reduced, kept whole until ``step``).
    2: also shard gradients (reduce-scattered; each rank keeps only its fp32 rows)."""

    reduce_bucket_mb: float = 25.0
    """MiB of gradient (in the communication dtype, padding included) per reduction bucket.
    Small buckets start communicating earlier; big ones make fewer, larger collectives."""

    overlap_communication: bool = True
    """Launch a bucket's reduction asynchronously during backward as soon as it is complete
    (in plan order). False reduces every bucket after backward, one at a time."""

    overlap_allgather: bool = False
    """After ``step()`` leave the all-gathers of the updated params in flight: the next forward
    waits for each bucket where it first reads it, so the gathers hide behind it ([Note: overlapped
    all-gather] in ``update/allgather.py``, [Note: every read waits] in ``reads/plan.py``). Off here, so
    that a param read right after ``step()`` holds the updated value; ``LowZeroTrainer`` and the Ray job
    turn it on (they know every reader). On, code that reads params between ``step()`` and the next
    forward (an EMA, a metric) calls ``wait_for_params()`` first. Not with ``torch.compile``."""

    check_param_reads: bool = False
    """With ``overlap_allgather``: watch every forward's reads and raise, naming the param and the
    module, when one is read while its all-gather is in flight. Costs a Python call per op of the
    forward: for tests and debugging. ``HF_LOWZERO_CHECK_PARAM_READS=1`` switches it on too."""

    clip_grad_norm: float = 0.0
    """Clip the global L2 norm of the averaged gradients to this value; 0 disables clipping.
    The norm is computed (and exposed as ``last_grad_norm``) either way."""

    communication_dtype: torch.dtype | str | None = None
    """dtype of gradient reductions; None uses each parameter's own dtype (as DDP does).
    ``"fp32"`` reduces low-precision gradients in fp32 at twice the traffic."""

    process_group: Any = None
    """Data-parallel ``torch.distributed`` process group; None means the default (WORLD) group."""

    offload_optimizer: bool = False
    """Keep the fp32 master rows, the inner optimizer's state and the gradient rows in host
    memory and run the optimizer step there (ZeRO-Offload). Leaves only the params and bounded
    bucket buffers on the GPU; each reduced bucket is copied to the host asynchronously."""

    pin_memory: bool = True
    """With ``offload_optimizer`` and CUDA params: page-lock the host buffers, so that copies to
    and from the GPU run asynchronously."""

    partition: str = "auto"
    """How ranks own optimizer state ([Note: two ways to own a parameter]): ``"rows"`` gives every
    rank a slice of every tensor (element-wise optimizers only: AdamW, SGD, ...); ``"params"`` gives
    each tensor whole to one rank, which runs the unmodified optimizer on it (any optimizer: exact by
    construction); ``"auto"`` picks rows for known element-wise optimizers, params otherwise."""

    allow_untested_optimizer: bool = False
    """Vouch that an inner optimizer class not on the element-wise allow-list updates each element
    from that element alone, so ``partition="auto"`` puts it on row shards (not LAMB, Adafactor,
    Shampoo, Muon). Without it such an optimizer gets whole-parameter ownership."""

    master_dtype: torch.dtype | str = "fp32"
    """dtype of the master rows each rank keeps between steps: ``"fp32"`` (4 bytes per owned
    element) or ``"bf16"`` (2 bytes; the inner optimizer still computes in fp32 on a copy that
    exists only during the step, [Note: bf16 masters] in ``update/master_precision.py``). Also
    ``"float32"``/``"bfloat16"`` or the torch dtype; fp16 masters are refused (too narrow a range)."""

    master_rounding: str = "stochastic"
    """bf16 masters only: how the fp32 result of a step is rounded into them. ``"stochastic"``
    (unbiased: updates smaller than half a bf16 ulp still move the weights on average) or
    ``"nearest"`` (deterministic, round-to-nearest-even; small updates are lost)."""

    master_rounding_seed: int = 0
    """bf16 masters with stochastic rounding: seed of the rounding noise (combined with the rank),
    so runs are reproducible. The generator is not checkpointed: a resumed run reseeds it."""

    initial_scale: float = 2.0**16
    """fp16 only: starting loss scale (bf16 and fp32 params are never scaled)."""

    growth_factor: float = 2.0
    """fp16 only: the scale is multiplied by this after ``growth_interval`` clean steps."""

    backoff_factor: float = 0.5
    """fp16 only: the scale is multiplied by this on an overflow once hysteresis is used up."""

    growth_interval: int = 1000
    """fp16 only: consecutive clean steps before the scale grows."""

    hysteresis: int = 2
    """fp16 only: overflows tolerated before the first backoff (restored when the scale grows)."""

    min_scale: float = 1.0
    """fp16 only: the scale never drops below this; an overflow at this scale is an error."""

    max_scale: float = 2.0**24
    """fp16 only: the scale never grows above this."""

    max_consecutive_skips: int = 100
    """Raise instead of skipping more than this many steps in a row (non-finite gradients)."""

    verify_every: int | str = "auto"
    """Integrity checks ([Note: integrity checks] in ``integrity/checker.py``): every N steps, ``"auto"``
    (the interval that keeps them within 1% of step time) or ``"off"``. On a verify step every
    rank's params are compared by hash and every reduction checked by random-sign checksums."""

    on_mismatch: str = "raise"
    """What a failed integrity check does: ``"raise"`` (``hf_lowzero.IntegrityError`` on every rank,
    before the update) or ``"rollback"`` (on Ray with memory snapshots: the run restarts from the
    newest snapshot taken at a verified step; elsewhere the same error)."""

    reduction: str = "ddp"
    """How gradients are summed over micro-batches and ranks. ``"ddp"``: in floating point, as DDP
    does (its bits at a given world size; another world size sums in another order). ``"exact"``:
    in int64 fixed point on a per-parameter grid, rounded once ([Note: exact reduction] in
    ``zero/exact/__init__.py``): with the same global batch, the same bits at any world size. The
    step's gradient is then the mean over every ``backward()`` of the step on every rank: pass each
    micro-batch's own loss, not divided by the number of micro-batches. No ``no_sync()``, no optimizer
    offload, no ``communication_dtype`` (int64 travels); bf16 masters need ``master_rounding="nearest"``."""

    def __post_init__(self) -> None:
        check_stage(self.stage, "ZeroConfig.stage")
        bucket = self.reduce_bucket_mb
        if (
            isinstance(bucket, bool)
            or not isinstance(bucket, (int, float))
            or not (bucket > 0 and math.isfinite(bucket))
        ):
            raise ValueError(
                f"ZeroConfig.reduce_bucket_mb={bucket!r} is invalid; expected a positive number of MiB (default 25)"
            )
        clip = self.clip_grad_norm
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (clip >= 0 and math.isfinite(clip)):
            raise ValueError(f"ZeroConfig.clip_grad_norm={clip!r} is invalid; expected a finite number >= 0 (0 = off)")
        for name in (
            "overlap_communication",
            "overlap_allgather",
            "check_param_reads",
            "offload_optimizer",
            "pin_memory",
            "allow_untested_optimizer",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ZeroConfig.{name}={getattr(self, name)!r} is invalid; expected True or False")
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"ZeroConfig.partition={self.partition!r} is invalid; expected 'auto', 'rows' (slices of every "
                "tensor: element-wise optimizers) or 'params' (whole tensors: any optimizer)"
            )
        self._check_loss_scaling()
        self._check_master_precision()
        self.verify_every = check_verify_every(self.verify_every)
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(
                f"ZeroConfig.on_mismatch={self.on_mismatch!r} is invalid; expected 'raise' (stop with "
                "IntegrityError) or 'rollback' (restart from the newest verified memory snapshot)"
            )
        if self.communication_dtype is not None:
            self.communication_dtype = parse_dtype(self.communication_dtype, "communication_dtype")
        self._check_reduction()

    def _check_reduction(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(
                f"ZeroConfig.reduction={self.reduction!r} is invalid; expected 'ddp' (float sums, as DDP) or "
                "'exact' (integer sums: the same bits at any world size)"
            )
        if self.reduction != "exact":
            return
        conflicts = {
            "offload_optimizer": (self.offload_optimizer, "keep the optimizer on the device (offload_optimizer=False)"),
            "communication_dtype": (
                self.communication_dtype is not None,
                "leave communication_dtype=None: exact reductions always send int64",
            ),
            "master_rounding": (
                self.master_dtype == torch.bfloat16 and self.master_rounding == "stochastic",
                "stochastic rounding of bf16 masters draws noise per rank; use master_rounding='nearest' "
                "or master_dtype='fp32'",
            ),
        }
        for name, (conflict, fix) in conflicts.items():
            if conflict:
                raise ValueError(
                    f"ZeroConfig.reduction='exact' does not work with {name}={getattr(self, name)!r}: {fix}"
                )

    def _check_master_precision(self) -> None:
        expected = "expected 'fp32' (default) or 'bf16' (or 'float32'/'bfloat16', torch.float32/torch.bfloat16)"
        try:
            dtype = parse_dtype(self.master_dtype, "master_dtype")
        except ValueError:
            dtype = None
        if dtype not in (torch.float32, torch.bfloat16):
            why = "; fp16 masters are refused: their range is too narrow for weights" if dtype else ""
            raise ValueError(f"ZeroConfig.master_dtype={self.master_dtype!r} is invalid; {expected}{why}")
        self.master_dtype = dtype
        if self.master_rounding not in MASTER_ROUNDINGS:
            raise ValueError(
                f"ZeroConfig.master_rounding={self.master_rounding!r} is invalid; expected 'stochastic' "
                "(default: unbiased) or 'nearest' (deterministic round-to-nearest-even)"
            )
        seed = self.master_rounding_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"ZeroConfig.master_rounding_seed={seed!r} is invalid; expected an integer >= 0")

    def _check_loss_scaling(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(f"ZeroConfig.{name}={getattr(self, name)!r} is invalid; expected {expected}")

        for name in ("growth_interval", "hysteresis", "max_consecutive_skips"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(name, "an integer >= 1")
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value > 0 and math.isfinite(value))
            ):
                raise bad(name, "a finite number > 0")
        if self.growth_factor <= 1:
            raise bad("growth_factor", "a number > 1")
        if self.backoff_factor >= 1:
            raise bad("backoff_factor", "a number in (0, 1)")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise bad("initial_scale", f"min_scale ({self.min_scale}) <= initial_scale <= max_scale ({self.max_scale})")

    @property
    def reduce_bucket_bytes(self) -> int:
        """``reduce_bucket_mb`` in bytes (at least 1)."""
        return max(1, int(self.reduce_bucket_mb * 2**20))

    def with_overrides(self, **overrides: Any) -> ZeroConfig:
        """A validated copy with some fields replaced; unknown names raise ``TypeError``.

        Args:
            **overrides: Field names and their new values.

        Returns:
            The copy (``self`` is unchanged).

        Raises:
            TypeError: A name is not a ``ZeroConfig`` field.
            ValueError: A new value is invalid.
        """
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown ZeroConfig field(s) {unknown}; valid fields are {sorted(known)}")
        return dataclasses.replace(self, **overrides)
