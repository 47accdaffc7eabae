"""The causal-LM job's configuration: one dataclass, every field a flag of ``ray_jobs/finetune.py``.

It reaches the workers in one piece: ``training_arguments()`` builds the ``LowZeroTrainingArguments``
(and through them the optimizer's ``ZeroConfig``) from the fields named like theirs, and
``clm_arguments()`` the recipe's model and data arguments the same way.

Example::

    config = RayFinetuneConfig(num_workers=(1, 4), zero_stage=2, global_batch_size=16, max_steps=20)
    args = config.training_arguments("out", world_size=2)   # gradient_accumulation_steps=2 at 2 workers
    args.to_zero_config()                                    # ZeroConfig(stage=2, ...)
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from transformers.training_args import OptimizerNames

from hf_lowzero.plan.planner import parse_bytes
from hf_lowzero.ray.elastic import accumulation_for_global_batch, parse_num_workers, worker_range
from hf_lowzero.ray.reporting import UPLOAD_MODES
from hf_lowzero.ray.snapshot_plan import check_every
from hf_lowzero.recipes.clm import ClmArguments
from hf_lowzero.trainer.arguments import LowZeroTrainingArguments, parse_stage
from hf_lowzero.zero.zero_config import ON_MISMATCH, ZeroConfig, check_verify_every

# Fields whose flag name differs from the TrainingArguments field they set.
TRAINING_ARGUMENT_NAMES = {
    "offload_optimizer": "zero_offload_optimizer",
    "num_to_keep": "save_total_limit",
    "verify_every": "zero_verify_every",
    "on_mismatch": "zero_on_mismatch",
    "overlap_allgather": "zero_overlap_allgather",
    "reduction": "zero_reduction",
}
# What every worker of the job trains with, whatever the flags: a checkpoint every save_steps, a
# loss line every step (ConsoleProgress), no integrations, no tqdm (one line per step instead).
JOB_TRAINING_ARGUMENTS = {"save_strategy": "steps", "logging_steps": 1, "report_to": [], "disable_tqdm": True}


def _opt(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass(kw_only=True)
class RayFinetuneConfig:
    """Everything the Ray job needs; ``ray_jobs/finetune.py`` turns each field into a flag.

    Every field is a keyword argument; each flag's help says the same as its entry here.

    Args:
        num_workers: Ray workers, one process per rank (one GPU each with ``use_gpu``); ``(MIN, MAX)``
            (``"MIN-MAX"`` on the command line) for elastic training.
        resize_check_interval_s: With MIN-MAX workers: seconds between checks whether the group can grow.
        use_gpu: Place one worker per GPU and use NCCL (gloo on CPU otherwise).
        resources_per_worker: Ray resources per worker as a JSON object, e.g. ``'{"CPU": 8, "GPU": 1}'``;
            None: one GPU (with ``use_gpu``) and ``cpus_per_worker`` CPUs.
        cpus_per_worker: CPUs Ray gives each worker (its threads for offloaded optimizer steps and data
            loading); ``"auto"``: with ``use_gpu`` the CPUs per GPU of the cluster's GPU nodes (1 when
            none is up yet), 1 otherwise.
        collective_timeout_s: Seconds a collective may wait before the process group gives up
            ([Note: a lost rank under NCCL] in ``job.py``).
        zero_stage: 0 (plain Trainer/DDP), 1 (shard optimizer states), 2 (also gradients) or ``"auto"``
            (what a memory plan of this run recommends for the workers' free device memory).
        zero_device_memory: With ``zero_stage="auto"``: plan for this much memory per device (e.g.
            ``"40GiB"``), not the free memory.
        zero_partition: ``"rows"`` (slices of every tensor), ``"params"`` (whole tensors, any optimizer)
            or ``"auto"`` (by optimizer).
        reduction: ``"ddp"`` or ``"exact"``: the same bits at any worker count (``ZeroConfig.reduction``).
        optim: The Trainer's ``optim`` (``adamw_torch``, ``adafactor``, ``adamw_torch_8bit``, ...).
        max_steps: Optimizer steps in total.
        save_steps: Checkpoint (and report to Ray) every this many steps.
        checkpoint_upload: ``"async"`` uploads checkpoints in the background; ``"sync"``: training waits.
        learning_rate: The peak learning rate.
        per_device_train_batch_size: Sequences per worker per micro-batch.
        gradient_accumulation_steps: Micro-batches per optimizer step.
        global_batch_size: Sequences per optimizer step on all workers; sets
            ``gradient_accumulation_steps`` for each attempt's world size to keep it.
        bf16: bf16 params with fp32 master rows.
        offload_optimizer: Keep the fp32 master rows, optimizer state and gradient rows in host memory.
        overlap_allgather: Hide the all-gather of updated params behind the next forward
            (``--no-overlap-allgather``: the step waits for it).
        zero_config: Other ``ZeroConfig`` fields as a JSON object.
        model_name_or_path: A local ``save_pretrained`` directory; None: a tiny GPT-2.
        train_file: A plain-text corpus; None: the one shipped with hf_lowzero.
        storage_path: Where Ray keeps checkpoints: local, shared, or ``s3://...`` (default: ``~/ray_results``).
        name: The run's name; a rerun with the same name and storage resumes it.
        max_failures: Worker-group restarts before giving up.
        snapshot_every: ZeRO stages: keep snapshots of the training state in node memory every this many
            steps, ``"auto"`` (the interval that costs at most 2% of training time) or ``"off"``/None.
        verify_every: Integrity checks every this many steps, ``"auto"`` (within 1% of step time) or
            ``"off"``.
        on_mismatch: A failed integrity check: ``"raise"`` (stop) or ``"rollback"`` (restart from the
            newest memory snapshot taken at a verified step; needs snapshots).
        inject_failure_at_step: Kill one worker process once, at this step (demos, tests); None: never.
        inject_corruption_at_step: Flip a bit of the last rank's reduced gradients once, at this step, on
            the first attempt (demos, tests); None: never.
        num_to_keep: Checkpoints Ray keeps.
        seed: The seed for model init and data order.

    Raises:
        ValueError: A field is invalid (each message names it), or two fields conflict
            (``global_batch_size`` with ``gradient_accumulation_steps``, ``cpus_per_worker`` with
            ``resources_per_worker``), or ``global_batch_size`` is not a multiple of
            ``per_device_train_batch_size`` times every worker count the run may have.
    """

    num_workers: int | tuple[int, int] = _opt(
        2, "Ray workers, one process per rank (one GPU each with --use-gpu); MIN-MAX (e.g. 2-8) for elastic training"
    )
    resize_check_interval_s: float = _opt(
        60.0, "with MIN-MAX workers: seconds between checks whether the group can grow"
    )
    use_gpu: bool = _opt(False, "place one worker per GPU and use NCCL (gloo on CPU otherwise)")
    resources_per_worker: str | None = _opt(
        None,
        'Ray resources per worker as JSON, e.g. \'{"CPU": 8, "GPU": 1}\' (default: 1 GPU and --cpus-per-worker CPUs)',
    )
    cpus_per_worker: int | str = _opt(
        "auto",
        "CPUs Ray gives each worker: its threads for offloaded optimizer steps and data loading (Ray sets "
        "OMP_NUM_THREADS to it); auto: with --use-gpu the CPUs per GPU of the cluster's GPU nodes (1 when none "
        "is up yet), 1 otherwise",
    )
    collective_timeout_s: int = _opt(
        600,
        "seconds a collective may wait before the process group gives up (NCCL: the rank aborts with an error); "
        "a lost worker or node is noticed sooner, by Ray (see docs/ray.md)",
    )
    zero_stage: int | str = _opt(
        2,
        "0 = plain Trainer/DDP, 1 = shard optimizer states, 2 = also gradients, auto = what a memory plan of "
        "this run recommends for the workers' free device memory (stage and optimizer offload)",
    )
    zero_device_memory: str | None = _opt(
        None, "with --zero-stage auto: plan for this much memory per device (e.g. 40GiB), not the free memory"
    )
    zero_partition: str = _opt(
        "auto", "rows (slices of every tensor), params (whole tensors, any optimizer) or auto (by optimizer)"
    )
    reduction: str = _opt(
        "ddp",
        "how gradients are summed: ddp (floating point, as DDP) or exact (integers, with every part of a step made "
        "independent of the worker count: the same bits at any --num-workers; needs a ZeRO stage, and with MIN-MAX "
        "workers --global-batch-size; see docs/exact-reduction.md)",
    )
    optim: str = _opt(
        "adamw_torch", "the Trainer's --optim (adamw_torch, adafactor, adamw_torch_8bit, lion_32bit, ...)"
    )
    max_steps: int = _opt(40, "optimizer steps in total")
    save_steps: int = _opt(10, "checkpoint (and report to Ray) every N steps")
    checkpoint_upload: str = _opt("async", "async: upload checkpoints in the background; sync: training waits for it")
    learning_rate: float = _opt(3e-3, "peak learning rate")
    per_device_train_batch_size: int = _opt(4, "sequences per worker per micro-batch")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    global_batch_size: int | None = _opt(
        None, "sequences per optimizer step on all workers: sets gradient_accumulation_steps per attempt to keep it"
    )
    bf16: bool = _opt(False, "bf16 params with fp32 master rows")
    offload_optimizer: bool = _opt(False, "fp32 master rows, optimizer state and gradient rows in host memory")
    overlap_allgather: bool = _opt(
        True, "hide the all-gather of updated params behind the next forward (--no-overlap-allgather: the step waits)"
    )
    zero_config: str | None = _opt(None, "other ZeroConfig fields as JSON")
    model_name_or_path: str | None = _opt(None, "local save_pretrained directory (default: a tiny GPT-2)")
    train_file: str | None = _opt(None, "plain-text corpus (default: the one shipped with hf_lowzero)")
    storage_path: str = field(
        default_factory=lambda: str(Path.home() / "ray_results"),
        metadata={"help": "where Ray keeps checkpoints: local, shared, or s3://... (default: ~/ray_results)"},
    )
    name: str = _opt("hf_lowzero_finetune", "run name; a rerun with the same name and storage resumes it")
    max_failures: int = _opt(3, "worker-group restarts before giving up")
    snapshot_every: int | str | None = _opt(
        "auto",
        "ZeRO stages: keep snapshots of the training state in node memory (each rank's shard on its node and a "
        "buddy node) every N steps, 'auto' (the interval that costs at most 2%% of training time) or 'off'",
    )
    verify_every: int | str = _opt(
        "auto",
        "integrity checks (replicas hashed and compared, reductions checked by checksums): every N steps, 'auto' "
        "(within 1%% of step time) or 'off'",
    )
    on_mismatch: str = _opt(
        "raise",
        "a failed integrity check: 'raise' (stop) or 'rollback' (restart from the newest memory snapshot taken at "
        "a verified step; needs snapshots)",
    )
    inject_failure_at_step: int | None = _opt(None, "kill one worker process once, at this step (demos, tests)")
    inject_corruption_at_step: int | None = _opt(
        None,
        "flip a bit of the last rank's reduced gradients once, at this step, on the first attempt (demos, tests: "
        "with --verify-every 1 the check of that step catches it)",
    )
    num_to_keep: int = _opt(2, "checkpoints Ray keeps")
    seed: int = _opt(0, "seed for model init and data order")

    def __post_init__(self) -> None:
        _check_plain_name(self.name)
        self.num_workers = parse_num_workers(self.num_workers)
        if self.resize_check_interval_s < 0:
            raise ValueError(f"resize_check_interval_s={self.resize_check_interval_s} is invalid; expected >= 0")
        self.resources_per_worker_dict()  # raises on bad JSON
        self.cpus_per_worker = _check_cpus(self.cpus_per_worker, self.resources_per_worker_dict())
        if self.collective_timeout_s < 1:
            raise ValueError(f"collective_timeout_s={self.collective_timeout_s} is invalid; expected seconds (>= 1)")
        if self.checkpoint_upload not in UPLOAD_MODES:
            raise ValueError(
                f"checkpoint_upload={self.checkpoint_upload!r} is invalid; expected one of {sorted(UPLOAD_MODES)}"
            )
        if self.global_batch_size is not None:
            if self.gradient_accumulation_steps != 1:
                raise ValueError(
                    "global_batch_size and gradient_accumulation_steps both set; give one: global_batch_size "
                    "derives gradient_accumulation_steps for every worker count"
                )
            for world in worker_range(self.num_workers):
                self.gradient_accumulation_for(world)  # raises if the global batch does not divide
        self.snapshot_every = check_every(self.snapshot_every)
        self.zero_stage = parse_stage(self.zero_stage)
        if self.zero_device_memory is not None:
            parse_bytes(self.zero_device_memory, "zero_device_memory")
        ZeroConfig(partition=self.zero_partition, reduction=self.reduction)  # raises on a bad value of either
        if self.reduction == "exact":
            self._check_exact()
        if self.max_steps < 1 or self.save_steps < 1:
            raise ValueError("max_steps and save_steps must be >= 1")
        _check_at_least(self, per_device_train_batch_size=1, gradient_accumulation_steps=1, num_to_keep=1)
        _check_at_least(self, learning_rate=0.0)
        if self.optim not in {name.value for name in OptimizerNames}:
            raise ValueError(
                f"optim={self.optim!r} is invalid; expected one of the Trainer's optimizers, e.g. adamw_torch, "
                f"adafactor, sgd (all: {', '.join(name.value for name in OptimizerNames)})"
            )
        if self.max_failures < -1:
            raise ValueError(
                f"max_failures={self.max_failures} is invalid; expected >= 0, or -1 to restart without end"
            )
        for name in ("inject_failure_at_step", "inject_corruption_at_step"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= self.max_steps:
                raise ValueError(f"{name}={value} is invalid; expected a step in [1, max_steps={self.max_steps}]")
        self.verify_every = check_verify_every(self.verify_every)
        if self.on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch={self.on_mismatch!r} is invalid; expected 'raise' or 'rollback'")

    def _check_exact(self) -> None:
        if self.zero_stage == 0:
            raise ValueError("reduction='exact' needs zero_stage 1, 2 or auto (it is the ZeRO optimizer's reduction)")
        if isinstance(self.num_workers, tuple) and self.global_batch_size is None:
            raise ValueError(
                f"reduction='exact' with num_workers={self.num_workers[0]}-{self.num_workers[1]} needs "
                "global_batch_size: with a fixed gradient_accumulation_steps the global batch changes with the "
                "worker count, and with it every step"
            )

    @property
    def snapshots(self) -> int | str | None:
        """The memory snapshot interval the job runs with: none without ZeRO (no shards to keep; with
        ``zero_stage="auto"`` the workers drop it if the plan picks stage 0).
        """
        return self.snapshot_every if self.zero_stage != 0 else None

    @property
    def max_workers(self) -> int:
        """The most workers the run may have (``num_workers``, or the MAX of MIN-MAX)."""
        return worker_range(self.num_workers)[-1]

    def gradient_accumulation_for(self, world_size: int) -> int:
        """Micro-batches per optimizer step at ``world_size`` (see [Note: global batch across resizes]).

        Args:
            world_size: The number of workers.

        Returns:
            ``gradient_accumulation_steps``, or with ``global_batch_size`` the accumulation that keeps it.

        Raises:
            ValueError: ``global_batch_size`` is not a multiple of ``per_device_train_batch_size *
                world_size``.
        """
        if self.global_batch_size is None:
            return self.gradient_accumulation_steps
        return accumulation_for_global_batch(self.global_batch_size, self.per_device_train_batch_size, world_size)

    def resources_per_worker_dict(self) -> dict[str, float] | None:
        """``resources_per_worker`` parsed (None: Ray's default, 1 GPU or 1 CPU).

        Returns:
            Resource names to amounts, or None when ``resources_per_worker`` is None.

        Raises:
            ValueError: ``resources_per_worker`` is not a JSON object of names to non-negative amounts.
        """
        if self.resources_per_worker is None:
            return None
        try:
            resources = json.loads(self.resources_per_worker)
        except json.JSONDecodeError:
            resources = None
        if not isinstance(resources, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in resources.items()
        ):
            raise ValueError(
                f"resources_per_worker={self.resources_per_worker!r} is invalid; expected a JSON object of "
                'resource names to non-negative amounts, e.g. \'{"CPU": 8, "GPU": 1}\''
            )
        return resources

    def worker_resources(self, nodes: list[dict[str, float]]) -> dict[str, float]:
        """What Ray reserves per worker on a cluster whose alive nodes have ``nodes`` resources:
        ``resources_per_worker``, or one GPU (with ``use_gpu``) and ``cpus_per_worker`` CPUs.

        Example::

            >>> RayFinetuneConfig(use_gpu=True).worker_resources([{"CPU": 48.0, "GPU": 4.0}, {"CPU": 8.0}])
            {'CPU': 12, 'GPU': 1}

        Args:
            nodes: The resources of each alive node of the cluster (empty when Ray is not started yet).

        Returns:
            Resource names to amounts, as ``ScalingConfig(resources_per_worker=...)`` takes them.
        """
        given = self.resources_per_worker_dict()
        if given is not None:
            return given
        cpus = self.cpus_per_worker
        if cpus == "auto":
            per_gpu = [int(n.get("CPU", 0) // n["GPU"]) for n in nodes if n.get("GPU", 0) >= 1]
            cpus = max(1, min(per_gpu)) if self.use_gpu and per_gpu else 1
        return {"CPU": cpus, "GPU": 1} if self.use_gpu else {"CPU": cpus}

    def training_arguments(self, output_dir: str, world_size: int) -> LowZeroTrainingArguments:
        """The Trainer arguments every worker trains with at ``world_size``: each field of this config
        named like a ``LowZeroTrainingArguments`` field (or renamed in ``TRAINING_ARGUMENT_NAMES``)
        sets it, plus ``JOB_TRAINING_ARGUMENTS``, the accumulation for ``world_size`` and ``use_cpu``.

        Example (the same training without Ray, e.g. as a reference; in every rank of a process group)::

            config = RayFinetuneConfig(max_steps=3)
            trainer, metrics = finetune_clm(config.clm_arguments(), config.training_arguments("out", 2))

        Args:
            output_dir: The Trainer's ``output_dir``.
            world_size: The number of workers training together.

        Returns:
            The arguments.

        Raises:
            ValueError: ``zero_config`` is not a JSON object of ``ZeroConfig`` fields, or the arguments are
                invalid together (``LowZeroTrainingArguments``' and ``TrainingArguments``' own checks).
        """
        return LowZeroTrainingArguments(output_dir=output_dir, **self._training_argument_values(world_size))

    def _training_argument_values(self, world_size: int) -> dict:
        given = _fields_named_like(self, LowZeroTrainingArguments, TRAINING_ARGUMENT_NAMES)
        given |= JOB_TRAINING_ARGUMENTS
        given["gradient_accumulation_steps"] = self.gradient_accumulation_for(world_size)
        given["use_cpu"] = not self.use_gpu
        return given

    def check_training_arguments(self) -> None:
        """Build the job's Trainer arguments once, as every worker will, so that whatever
        ``TrainingArguments`` or ``ZeroConfig`` refuse (``--optim``, ``--zero-config``, ...) is refused
        before a cluster starts. The driver calls it (``ray_jobs/finetune.py``, ``build_trainer``).

        Built on the CPU (``use_cpu=True``): the driver may have no GPU, and constructing the arguments
        sets up this process's accelerator state, which a worker's own arguments must do.

        Example::

            RayFinetuneConfig(optim="not_an_optim").check_training_arguments()   # ValueError

        Raises:
            ValueError: The arguments are invalid (the message names the field).
            OSError: ``zero_config`` names a file that cannot be read.
        """
        given = self._training_argument_values(worker_range(self.num_workers)[0]) | {"use_cpu": True}
        LowZeroTrainingArguments(output_dir=str(Path(tempfile.gettempdir()) / "hf_lowzero_check"), **given)

    def clm_arguments(self) -> ClmArguments:
        """The recipe's model and data arguments: the fields named like ``ClmArguments`` fields that
        are set (``train_file=None`` keeps the shipped corpus).

        Example::

            RayFinetuneConfig(model_name_or_path="models/gpt2").clm_arguments().model_name_or_path

        Returns:
            The recipe's model and data arguments.
        """
        given = _fields_named_like(self, ClmArguments)
        return ClmArguments(**{k: v for k, v in given.items() if v is not None})


def _check_cpus(cpus: int | str, resources: dict[str, float] | None) -> int | str:
    if cpus != "auto":
        given = cpus
        try:
            cpus = int(cpus)
        except (TypeError, ValueError):
            cpus = 0
        if cpus < 1:
            raise ValueError(f"cpus_per_worker={given!r} is invalid; expected 'auto' or a number of CPUs (>= 1)")
        if resources is not None:
            raise ValueError(
                "cpus_per_worker and resources_per_worker both set; give one (resources_per_worker may hold 'CPU')"
            )
    return cpus


def _check_plain_name(name: str) -> None:
    """``name`` (``--name``) is one folder name: the run's folder under the storage path is
    ``<storage>/<name>``, so a ``/`` or ``..`` would put it, and the export, elsewhere.
    """
    if not isinstance(name, str) or name.strip(".") == "" or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"name={name!r} (--name) is invalid; expected a plain name, one folder under the storage path: "
            "not empty, no '/' or '\\', not only dots, e.g. --name my_run"
        )


def _check_at_least(config: RayFinetuneConfig, **lowest: float) -> None:
    for name, low in lowest.items():
        value = getattr(config, name)
        if value < low:
            raise ValueError(f"{name}={value} is invalid; expected a number >= {low:g}")


def _fields_named_like(config: RayFinetuneConfig, target: type, renamed: dict[str, str] | None = None) -> dict:
    """``config``'s values keyed by the ``target`` dataclass's field names they set."""
    renamed = renamed or {}
    accepted = {f.name for f in dataclasses.fields(target) if f.init}
    values = {renamed.get(f.name, f.name): getattr(config, f.name) for f in dataclasses.fields(config)}
    return {name: value for name, value in values.items() if name in accepted}
