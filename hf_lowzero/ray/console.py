"""What a person running a Ray job sees from its workers: one progress line per logging step from
the first rank, and none of Ray's and transformers' known-harmless noise.

Example::

    quiet_worker_console()                           # worker, at the start of the training function
    trainer.add_callback(ConsoleProgress(attempt))   # worker: after trainer.remove_callback(PrinterCallback)
    # step 12/40 [######..............]  30% | loss 3.2140 | lr 2.10e-03 | grad_norm 1.234 | world 2

# [Note: console noise]
# What ``python ray_jobs/finetune.py`` printed under Ray 2.60 and transformers 5.23, and why it is gone:
# - Every Trainer metrics line twice. Ray Train patches ``print`` on its workers to log through the root
#   logger, and because Ray wraps ``sys.stdout`` (``Unbuffered``, not ``sys.__stdout__``) the patch also
#   tees to the real print (ray/train/v2/_internal/logging/patch_print.py). The Ray job drops the
#   Trainer's ``PrinterCallback`` and logs ``ConsoleProgress``'s line once, through that root logger;
#   ``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` (Train propagates it to every worker) makes any other print once.
# - "Failed to query Ray Train Controller actor state", every second. Train's ``PlacementGroupCleaner``
#   polls the state API, which is served by the dashboard; ``include_dashboard=False`` left it out. The
#   local instance starts its dashboard, and ``RAY_API_SERVER_ADDRESS`` tells every process where it is:
#   without it the cleaner guesses the cluster, and on a machine running several it takes the newest,
#   whose state API does not know our controller (``get_actor`` returns None, which reads as dead).
#   The dashboard is Ray's default for a local instance; it costs about 1 GB of resident memory.
# - core_worker.cc "Actor with class name: 'PreemptionWatcher' ... max_restarts > 0": the watcher
#   follows node preemptions, which a single machine has none of: ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``
#   for the local instance only.
# - Ray Train's INFO lines (resources, worker group, checkpoints): ``RunConfig(logging_config=
#   LoggingConfig(log_level="WARNING"))``; they stay in /tmp/ray/session_latest/logs/train/. Except
#   "Reporting training result N: TrainingReport(...)" from every rank: its logger is named after its
#   file path (``getLogger(__file__)``), outside ``ray.train``, so only the workers' root logger level
#   (WARNING, ``quiet_worker_console``) holds it back; the ``hf_lowzero`` logger stays at INFO.
# - "Writing model shards 0%|..." on every save: transformers' progress bars, off on the workers.
# - transformers' "mtime may not be reliable on this filesystem": the Trainer sorts its local
#   checkpoints by mtime, finds two saved within a second (a tiny model) and rightly falls back to
#   step numbers. That one notice is filtered out on the workers.
# - Tracebacks of errors that end an attempt by design (a rollback, a peer killed on purpose), and the
#   controller's after a dead worker: [Note: designed events] in ``hf_lowzero/ray/events.py``.
# Left as is: the driver's one-line "Token authentication is enabled for this Ray cluster" notice.
# ``RAY_AUTH_MODE=token`` would silence it, but Ray caches the mode when it is imported, so setting it
# in the driver (after ``import ray``) leaves it without a token for a GCS that demands one.
# The workers' side is here; the driver's (the print patch, the local instance's dashboard and
# watcher) is the Ray job's ``quiet_ray_train`` and ``start_local_ray`` (``hf_lowzero/recipes/clm_ray/local_ray.py``).
"""

from __future__ import annotations

import logging

import torch
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging

from hf_lowzero.ray.restore import last_resume

BAR_WIDTH = 20

logger = logging.getLogger(__name__)


class ConsoleProgress(TrainerCallback):
    """One line per logging step on the first rank, with a progress bar; other ranks print nothing.

    Lines go through the ``logging`` root logger that Ray Train sets up on its workers, so each
    reaches the driver's console once (see [Note: console noise]). ``attempt`` is the run's attempt
    number (the Ray job's ``hf_lowzero/recipes/clm_ray/attempts.py`` counts them), shown when training
    starts or resumes.

    Example::

        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(ConsoleProgress(attempt=1))
        # [hf_lowzero] attempt 1: training 40 steps on 2 workers, ZeRO stage 2
        # step  1/40 [....................]   2% | loss 5.4810 | lr 3.00e-03 | grad_norm 2.861 | world 2

    Args:
        attempt: The run's attempt number, or None to leave it out of the first line.
    """

    def __init__(self, attempt: int | None = None) -> None:
        self.attempt = attempt

    def on_train_begin(self, args, state, control, **kwargs):
        """Log on the first rank what this attempt does: train from the start, or resume at which step
        (from memory or storage, when ``resume_checkpoint()`` chose), on how many workers and at which
        ZeRO stage; with optimizer offload also the host threads per worker. A restart's one line
        ([Note: designed events] in ``events.py``).
        """
        if not state.is_world_process_zero:
            return
        if state.global_step:
            what = f"resuming at step {state.global_step}/{state.max_steps}{_resumed_from(state.global_step)}"
        elif self.attempt and self.attempt > 1:
            what = f"no checkpoint to resume, training {state.max_steps} steps from the start"
        else:
            what = f"training {state.max_steps} steps"
        attempt = f"attempt {self.attempt}: " if self.attempt else ""
        logger.info(f"[hf_lowzero] {attempt}{what} on {args.world_size} workers, ZeRO stage {args.zero_stage}")
        if getattr(args, "zero_offload_optimizer", False) and args.zero_stage:
            logger.info(
                f"[hf_lowzero] offloaded optimizer steps run on the host with {torch.get_num_threads()} threads per "
                "worker (the CPUs Ray gives each worker: --cpus-per-worker)"
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Log on the first rank the progress line of each logging step that has a loss."""
        if state.is_world_process_zero and logs and "loss" in logs:
            logger.info(progress_line(state.global_step, state.max_steps, logs, args.world_size))


def _resumed_from(step: int) -> str:
    """Where ``resume_checkpoint()`` found ``step`` in this process, for the attempt's line ("" if unknown)."""
    source = last_resume()
    if source is None or source.step != step:
        return ""
    if source.kind == "memory":
        storage = f"newest storage checkpoint {source.storage_step}" if source.storage_step else "none in storage yet"
        return f" from its memory snapshot ({storage})"
    return " from its storage checkpoint" if source.kind == "storage" else ""


def progress_line(step: int, max_steps: int, logs: dict[str, float], world_size: int) -> str:
    """The console line for one logging step.

    Example::

        >>> progress_line(12, 40, {"loss": 3.214, "learning_rate": 2.1e-3, "grad_norm": 1.234}, 2)
        'step 12/40 [######..............]  30% | loss 3.2140 | lr 2.10e-03 | grad_norm 1.234 | world 2'

    Args:
        step: The optimizer step just taken.
        max_steps: The steps in total.
        logs: The step's logged values: ``loss``, and if present ``learning_rate``, ``grad_norm``,
            ``skipped_steps``.
        world_size: The number of workers.

    Returns:
        The line, without a newline.
    """
    done = BAR_WIDTH * step // max_steps  # full only at the last step
    width = len(str(max_steps))
    parts = [
        f"step {step:>{width}}/{max_steps} [{'#' * done}{'.' * (BAR_WIDTH - done)}] {100 * step / max_steps:3.0f}%",
        f"loss {logs['loss']:.4f}",
    ]
    if "learning_rate" in logs:
        parts.append(f"lr {logs['learning_rate']:.2e}")
    if "grad_norm" in logs:
        parts.append(f"grad_norm {logs['grad_norm']:.3f}")
    if logs.get("skipped_steps"):
        parts.append(f"skipped {logs['skipped_steps']}")
    parts.append(f"world {world_size}")
    return " | ".join(parts)


def quiet_worker_console() -> None:
    """On a Ray Train worker: warnings and errors only, plus the ``hf_lowzero`` lines (see [Note:
    console noise]). Call it at the start of the training function.

    Example::

        def train_func(config):
            quiet_worker_console()
            trainer = prepare_trainer(clm_trainer(model_args, args, printer=ConsoleProgress(attempt=1)))
    """
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("hf_lowzero").setLevel(logging.INFO)
    hf_logging.disable_progress_bar()  # tqdm's carriage returns garble Ray's line-based log forwarding
    logging.getLogger("transformers.trainer_utils").addFilter(_not_the_mtime_notice)


def _not_the_mtime_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("mtime may not be reliable on this filesystem")
