"""LowZeroTrainer: ``transformers.Trainer`` with ZeRO stage 1/2, switched on by ``zero_stage``.

Example::

    args = LowZeroTrainingArguments(output_dir="out", zero_stage=2, bf16=True, gradient_accumulation_steps=4)
    LowZeroTrainer(model=model, args=args, train_dataset=ds).train()

With ``zero_stage=0`` every override below defers to ``Trainer``. With ZeRO on:
- flags that cannot work with sharded optimizer state are refused at construction (``compat.py``);
- the model is not wrapped at all (the optimizer synchronizes gradients; see [Note: no wrapper]);
  data is still sharded; ``torch_compile`` compiles it as accelerate would;
- ``bf16``/``fp16`` cast the params once; the accelerator gets no mixed precision (no autocast,
  no GradScaler); fp16 losses are scaled by the optimizer;
- the optimizer Trainer builds (or the one given in ``optimizers=``) is wrapped, and rebuilt for
  every new model (``model_init``, ``hyperparameter_search``); an OOM retry starts from a clean one;
- stage 1 uses ``no_sync()`` for non-final micro-batches, stage 2 reduces every micro-batch;
- ``zero_reduction="exact"`` makes each step's micro-batches, loss normalization and dropout independent of
  the world size ([Note: an exact Trainer step] in ``exact.py``) and sums gradients in integers;
- evaluation, prediction, saving, callbacks and TRL's weight syncs to vLLM see the last step's params
  ([Note: params are current] in ``zero/update/allgather.py``; ``callbacks.py``, ``weight_sync.py``);
- the logged ``grad_norm`` is the true global norm; ``loss_scale``, ``skipped_steps`` and (with
  more than one rank) ``integrity_checks`` are logged too; a skipped step does not advance the LR
  schedule; a failed integrity check raises ``IntegrityError`` before the update, so no checkpoint
  holds that state (``zero_verify_every``, ``zero_on_mismatch``);
- every rank's optimizer shard is saved into ``checkpoint-N/zero_optimizer`` (trainable state
  only: the Trainer saves the model) and resumed at the same or another world size; checkpoint
  names are the uncompiled model's.

``hf_lowzero.with_zero`` gives the same to any ``Trainer`` subclass (TRL's, ``Seq2SeqTrainer``).

# [Note: no wrapper]
DDP's job, synchronizing gradients, is the ZeRO optimizer's, so the model the Trainer trains is the
model itself (or its compiled form): ``accelerator.unwrap_model``, which TRL's generation, PEFT and
user code call to reach the ``PreTrainedModel``, finds it as it finds a DDP-wrapped one. What DDP
did through accelerate is routed to the optimizer on the accelerator instead: ``prepare_model``
applies only what it applies to a model for evaluation (placement, ``torch_compile``; never DDP),
``backward`` goes through ``LowLevelZeroOptimizer.backward`` and ``no_sync(model)`` is the
optimizer's under stage 1 and a no-op under stage 2 (which must reduce every micro-batch).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from hf_lowzero.checkpoint import load_checkpoint, save_checkpoint
from hf_lowzero.checkpoint.layout import TRAINER_SUBDIR, partial_dir
from hf_lowzero.trainer.arguments import LowZeroTrainingArguments, ZeroArguments
from hf_lowzero.trainer.auto import resolve_auto_stage
from hf_lowzero.trainer.callbacks import gate_callbacks
from hf_lowzero.trainer.compat import check_trainer_flags
from hf_lowzero.trainer.exact import ExactSteps
from hf_lowzero.trainer.resume import incomplete_reason, resolve_resume
from hf_lowzero.trainer.signature import given_arguments
from hf_lowzero.trainer.snapshot_files import is_memory_snapshot
from hf_lowzero.trainer.weight_sync import gate_weight_syncs
from hf_lowzero.zero.layout.params import canonical_name
from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
from hf_lowzero.zero.zero_config import parse_dtype

SCHEDULER_NAME = "scheduler.pt"
logger = logging.getLogger(__name__)


class LowZeroTrainer(Trainer):
    """A ``Trainer`` that runs ZeRO stage 1/2 when ``args.zero_stage`` > 0 (see the module docstring).

    With ``zero_stage="auto"`` the constructor first plans the run's memory for the given model and
    writes the recommended stage and offload into ``args``; the plan is kept as ``memory_plan``.

    Args:
        *args (Any): ``Trainer``'s positional arguments (``model``, ``args``, ...).
        **kwargs (Any): ``Trainer``'s keyword arguments. ``args`` must be ``LowZeroTrainingArguments``
            (or a ``with_zero`` twin of another arguments class); None gives ``Trainer``'s defaults,
            without ZeRO.

    Raises:
        TypeError: ``args`` lacks the ``zero_*`` fields (plain ``TrainingArguments`` or a TRL config);
            with ZeRO on, the optimizer given in ``optimizers=`` is not a torch optimizer, or is already a
            ``LowLevelZeroOptimizer``.
        ValueError: With ZeRO on, a Trainer setting cannot work with it (``deepspeed``, ``fsdp``, several
            GPUs in one process, a model sharded at load time, an optimizer or ``optim`` that cannot run on
            the chosen partition, an optimizer that already took steps or does not hold exactly the
            model's trainable params); with ``zero_stage="auto"``, no ``model`` was given or no setup fits
            the device.
    """

    args: LowZeroTrainingArguments

    def __init__(self, *args, **kwargs) -> None:
        given = given_arguments(type(self), args, kwargs)
        if given is not None and not isinstance(given, ZeroArguments):
            name = type(given).__name__
            raise TypeError(
                f"{type(self).__name__} needs arguments with the zero_* fields (got {name}); build them with "
                f"hf_lowzero.with_zero({name})(..., zero_stage=...) (LowZeroTrainingArguments for TrainingArguments)"
            )
        if given is not None and given.zero_auto:
            model = kwargs.get("model", args[0] if args and not isinstance(args[0], ZeroArguments) else None)
            self.memory_plan = resolve_auto_stage(given, model, kwargs.get("train_dataset"))
        super().__init__(*args, **kwargs)
        self.zero_optimizer: LowLevelZeroOptimizer | None = None
        self._exact_steps = ExactSteps(self) if getattr(self.args, "zero_reduction", None) == "exact" else None
        if self.zero_enabled:
            check_trainer_flags(self)
            gate_callbacks(self.callback_handler, self._wait_for_params)
            gate_weight_syncs(self, self._wait_for_params)  # TRL's pushes to vLLM

    @property
    def zero_enabled(self) -> bool:
        """Whether this trainer runs ZeRO: ``args.zero_stage`` is 1 or 2."""
        return getattr(self.args, "zero_stage", 0) > 0

    # ---------------------------------------------------------------------------- set-up

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        if self.zero_enabled:
            # 16-bit params with fp32 master rows replace autocast + GradScaler.
            args["mixed_precision"] = "no"
        return args

    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s accelerator; with ZeRO, its model preparation, ``backward`` and ``no_sync`` go
        through the optimizer instead of DDP ([Note: no wrapper]).
        """
        super().create_accelerator_and_postprocess()
        if self.zero_enabled:  # [Note: no wrapper]
            self.accelerator.prepare_model = functools.partial(
                self._prepare_without_ddp, self.accelerator.prepare_model
            )
            self.accelerator.backward = self._zero_backward
            self.accelerator.no_sync = self._zero_no_sync

    def _prepare_without_ddp(self, prepare_model, model, device_placement=None, evaluation_mode=False):
        # What accelerate does for evaluation (placement, torch_compile), never DDP. The trained model
        # stays where it was when the optimizer took its params (moving it would replace them).
        if model is self.model:
            device_placement = False
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """``Trainer.training_step``; with ``zero_reduction="exact"``, made independent of the world size
        ([Note: an exact Trainer step] in ``trainer/exact.py``).

        Args:
            model (torch.nn.Module): The model.
            inputs (dict[str, Any]): One micro-batch.
            num_items_in_batch (torch.Tensor | int | None): The step's token count, where the loss is normalized by it.

        Returns:
            The micro-batch's loss, detached, as ``Trainer`` logs it.
        """
        if self._exact_steps is None:
            return super().training_step(model, inputs, num_items_in_batch)
        return self._exact_steps.training_step(super().training_step, model, inputs, num_items_in_batch)

    def _zero_backward(self, loss: torch.Tensor, **kwargs) -> None:
        # Scales fp16 losses, and synchronizes even where no param got a gradient. Integrity checks
        # number steps as the Trainer does (a resumed run goes on counting from its checkpoint).
        self.zero_optimizer.step_number = self.state.global_step + 1
        self.zero_optimizer.backward(loss, **kwargs)

    def _wait_for_params(self) -> None:
        # [Note: params are current] in zero/update/allgather.py
        if self.zero_optimizer is not None:
            self.zero_optimizer.wait_for_params()

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``, once every param holds its value from the last step.

        Args:
            *args (Any): ``Trainer.evaluate``'s arguments.
            **kwargs (Any): ``Trainer.evaluate``'s keyword arguments.

        Returns:
            (dict[str, float]): The metrics.
        """
        self._wait_for_params()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        """``Trainer.predict``, once every param holds its value from the last step.

        Args:
            *args (Any): ``Trainer.predict``'s arguments.
            **kwargs (Any): ``Trainer.predict``'s keyword arguments.

        Returns:
            (transformers.trainer_utils.PredictionOutput): The predictions.
        """
        self._wait_for_params()
        return super().predict(*args, **kwargs)

    def _zero_no_sync(self, model=None):
        if self.zero_optimizer is not None and self.zero_optimizer.allows_no_sync:
            return self.zero_optimizer.no_sync()
        return contextlib.nullcontext()

    def create_optimizer(self, model=None):
        """``Trainer``'s optimizer; with ZeRO, wrapped in a ``LowLevelZeroOptimizer``, once per model.

        With ZeRO it starts a single-process group when there is none, casts the model to the 16-bit
        dtype (``bf16``/``fp16``), and wraps the optimizer ``Trainer`` builds (or the one given in
        ``optimizers=``). Called again for the same model, it returns the same optimizer with its
        gradients dropped; for a new model (``model_init``) it builds a new one.

        Args:
            model (torch.nn.Module | None): Passed on to ``Trainer.create_optimizer``.

        Returns:
            (torch.optim.Optimizer): The optimizer, also set as ``self.optimizer`` (with ZeRO, the
                ``LowLevelZeroOptimizer``, also ``self.zero_optimizer``).

        Raises:
            RuntimeError: With ZeRO, ``WORLD_SIZE`` > 1 but no process group was started, or
                ``accelerate launch`` started one process where it was asked for several.
        """
        if not self.zero_enabled:
            return super().create_optimizer(model)
        current = self.zero_optimizer
        if current is not None and current.model is self.model and self.optimizer is not None:
            # A later _inner_training_loop on the same model (a second train(), or the retry after
            # an OOM): drop whatever a failed backward left behind ([Note: failed backward]).
            current.zero_grad()
            return self.optimizer
        if current is not None:
            current.remove_hooks()  # built for a previous model (model_init, hyperparameter_search)
        _ensure_process_group(self.args.device)
        if self.args.zero_dtype is not None:
            self.model.to(parse_dtype(self.args.zero_dtype, "dtype"))
        inner = self.optimizer if self.optimizer is not None else super().create_optimizer(model)
        if isinstance(inner, LowLevelZeroOptimizer):
            self.zero_optimizer = inner
        else:
            self.zero_optimizer = LowLevelZeroOptimizer(self.model, inner, self.args.to_zero_config())
        self.zero_optimizer.register_step_post_hook(self._record_skip)
        self.optimizer = self.zero_optimizer
        return self.optimizer

    def _record_skip(self, optimizer, args, kwargs) -> None:
        # Trainer steps the LR schedule unless accelerate's optimizer wrapper (re-made on every
        # train() call, hence read here) reports an overflow, which accelerate only sets for its
        # own GradScaler: mirror the ZeRO optimizer's verdict there.
        if self.optimizer is not optimizer:
            self.optimizer._is_overflow = not optimizer.last_step_applied

    # ----------------------------------------------------------------- norms and logging

    def _clip_grad_norm(self, model):
        if not self.zero_enabled:
            return super()._clip_grad_norm(model)
        return self.zero_optimizer.grad_norm()  # clipping itself happens inside step()

    def _get_grad_norm(self, model, grad_norm=None):
        if not self.zero_enabled:
            return super()._get_grad_norm(model, grad_norm)
        return grad_norm if grad_norm is not None else self.zero_optimizer.grad_norm()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``; with ZeRO, a log entry with a loss also gets ``loss_scale``, ``skipped_steps``
        and (with integrity checks on) ``integrity_checks``.

        Args:
            logs: The values to log; extended in place.
            start_time: Passed on to ``Trainer.log``.
        """
        if self.zero_enabled and self.zero_optimizer is not None and "loss" in logs:
            logs["loss_scale"] = self.zero_optimizer.loss_scale
            logs["skipped_steps"] = self.zero_optimizer.skipped_steps
            checks = self.zero_optimizer.integrity_checks
            if checks is not None:
                logs["integrity_checks"] = checks
        super().log(logs, start_time)

    # ------------------------------------------------------------------------ checkpoints

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; with ZeRO, a checkpoint whose save was cut is never resumed
        (``trainer/resume.py``): ``True`` skips it for the last complete one, saying so in one line, and
        an explicit path to it is refused, naming the complete one.

        Args:
            resume_from_checkpoint: As for ``Trainer.train``.
            *args (Any): ``Trainer.train``'s other arguments.
            **kwargs (Any): ``Trainer.train``'s keyword arguments.

        Returns:
            (transformers.trainer_utils.TrainOutput): As ``Trainer.train``.

        Raises:
            ValueError: With ZeRO, the checkpoint to resume is incomplete, or ``True`` finds no complete one.
        """
        given = resume_from_checkpoint
        if self.zero_enabled and given and (given is True or not is_memory_snapshot(given)):
            resume_from_checkpoint = resolve_resume(given, self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.zero_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Every rank writes its shard. The Trainer saves the model (adapter only, for PEFT), so the
        # shards hold trainable state only: no second copy of a frozen base model.
        save_checkpoint(self.zero_optimizer, os.path.join(output_dir, TRAINER_SUBDIR), model_extras=False)
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's "please also save optimizer" note
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._exact_steps is not None and checkpoint is not None:
            self._exact_steps.check_resume(checkpoint)  # [Note: an exact Trainer step]
        if not self.zero_enabled or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        zero_dir = os.path.join(checkpoint, TRAINER_SUBDIR)
        if not os.path.isdir(zero_dir) and os.path.exists(partial_dir(Path(zero_dir))):
            raise ValueError(f"cannot resume from {checkpoint}: {incomplete_reason(checkpoint)}")
        if not os.path.isdir(zero_dir):
            # save_only_model=True, or a run without ZeRO: Trainer goes on with a fresh optimizer
            # and schedule; so do we, from the weights just loaded into the model.
            logger.warning(
                "%s holds no ZeRO optimizer state (saved with save_only_model=True or zero_stage=0); "
                "continuing with a fresh optimizer and LR schedule from the checkpoint's weights",
                checkpoint,
            )
            self.zero_optimizer.copy_params_to_master()
            return
        load_checkpoint(self.zero_optimizer, zero_dir)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.zero_enabled and dist.is_initialized():
            # Trainer has no barrier before on_save callbacks: make every file of checkpoint-N
            # (rank 0's trainer state included) exist before any rank reports it.
            dist.barrier()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.zero_enabled and state_dict is None and self._compiled():
            # A compiled model's state dict carries "_orig_mod." names that from_pretrained and an
            # uncompiled resume do not know: save the uncompiled names.
            state_dict = {canonical_name(k): v for k, v in self.model.state_dict().items()}
        super()._save(output_dir, state_dict)

    def _maybe_log_save_evaluate(self, *args, **kwargs) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        # [Note: snapshot point] in snapshot_files.py: the state a checkpoint of this step would hold.
        for callback in self.callback_handler.callbacks:
            after = getattr(callback, "after_log_save_evaluate", None)
            if after is not None:
                after(self)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.zero_enabled and is_memory_snapshot(resume_from_checkpoint):
            # No model weights in a memory snapshot: loading the optimizer writes its master rows
            # into the params; frozen params are the model's as built.
            # Debug: on Ray every rank would print it; the attempt's one line says where it resumed.
            logger.debug("%s is a memory snapshot: params come from its optimizer shards", resume_from_checkpoint)
            return
        if self.zero_enabled and model is None and self._compiled():
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)  # uncompiled names
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        super()._load_best_model()
        if self.zero_enabled and self.zero_optimizer is not None:
            self.zero_optimizer.copy_params_to_master()  # a later train() continues from these weights

    def _compiled(self) -> bool:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False) is not self.model


def _ensure_process_group(device: torch.device) -> None:
    """A single process (one GPU, or CPU) with no launcher: a world of size 1, so ZeRO's fp32
    master rows and loss scaling work there too; NCCL when the Trainer trains on a GPU (``device``,
    its ``args.device``: ``use_cpu=True`` on a GPU machine trains on the CPU, with gloo). Launched
    jobs already have their group.
    """
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not initialized; launch with torchrun or Ray")
    if "ACCELERATE_USE_CPU" in os.environ and "MASTER_PORT" in os.environ:
        # accelerate's single-process launcher sets ACCELERATE_USE_CPU always and MASTER_PORT only for
        # --num_processes > 1: asked for several processes, it started this one alone ([Note:
        # accelerate launch on CPU] in tests/test_accelerate_launch.py). Plain Trainer would train as
        # one rank without a word.
        raise RuntimeError(
            "accelerate launch was asked for more than one process but started this script once: it does so "
            "when it sees fewer than 2 GPUs and its config does not say MULTI_GPU. On CPU add --multi_gpu "
            "(accelerate's torchrun launcher; its ranks run gloo on CPU) or launch with torchrun "
            "--nproc-per-node N; on one GPU use --num_processes 1."
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
