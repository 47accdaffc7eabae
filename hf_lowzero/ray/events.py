"""Designed events on the console: one ``[hf_lowzero]`` line each, and no Python traceback.

A rollback, an injected failure, a restart and a resize are things a run is built to do. Each says
once what happened and what comes next; Ray's tracebacks stay for what nobody designed.

Example::

    raise designed(IntegrityError(...))          # a worker: the error ends the attempt, quietly
    expect_lost_peer()                           # a worker whose peer is about to be killed on purpose
    quiet_designed_errors()                      # a worker (prepare_trainer calls it)
    RunConfig(callbacks=[ConsoleEvents()])       # the driver: the controller's side (the Ray job adds it)

# [Note: designed events]
# What Ray Train 2.60 prints for each event, and what is left:
# - "Error in training function:" and the traceback, from every rank whose training function raised:
#   ``construct_user_exception_with_traceback`` (ray/train/v2/_internal/util.py) logs it at ERROR on
#   its module's logger, in the training thread, inside the ``except`` that caught the error
#   (``ThreadRunner._run_target``), so ``sys.exc_info()`` is that error. ``quiet_designed_errors``
#   puts a filter on that logger that drops the record when the error was marked ``designed`` (a
#   rollback's ``IntegrityError``), or is a ``RuntimeError`` (torch.distributed's errors, a snapshot's)
#   after ``expect_lost_peer`` (a peer is being killed on purpose). Every other error keeps its
#   traceback. The record leaves Ray's log files too; the controller's own log keeps the error
#   (its failure policy logs it at INFO, with the traceback, to /tmp/ray/session_latest/logs/train/).
# - The controller's "Graceful shutdown of backend failed. This is expected if one of the workers
#   has crashed." and an ``ActorDiedError`` traceback (ray/train/v2/_internal/callbacks/backend_setup.py,
#   WARNING), after any dead worker: Ray's own shutdown call reaching the dead actor. ``ConsoleEvents``
#   filters it out on the controller; the dead worker is reported by the raylet (next item).
# - "(raylet) A worker died or was killed while executing a task by an unexpected system error ...":
#   the raylet publishes it to the driver for every worker process that exits without telling Ray, a
#   killed one included, and the driver prints it from Ray's own thread. Nothing outside Ray's private
#   functions can hold it back, so the injected failure's line says that it comes.
# - The controller's "Failed to send resource request for ... it's safe to ignore this error" and a
#   ``GetTimeoutError`` traceback (ray/train/v2/_internal/execution/scaling_policy/
#   autoscaling_coordinator_client.py, WARNING): its request to Ray's autoscaling coordinator waits
#   5 s, and on a machine whose cores are all busy (three Ray jobs on 2 cores, in CI) it times out.
#   Ray's message says itself that a transient one is harmless. ``ConsoleEvents`` keeps its one line
#   and drops the traceback: a run that cannot reach the coordinator still says so at every request.
#   The first request comes before any other callback's ``after_controller_start`` (the scaling
#   policy's own), so the filter goes on as the controller unpickles the callback.
# - A restart: Ray Train says nothing on the console (its decision is logged at INFO); the first
#   rank's attempt line (``ConsoleProgress``) is the event's line, with where it resumes.
# - A resize (the cluster has room for more workers): Ray Train stops the group and starts a larger
#   one without a word on the console; ``ConsoleEvents`` says so on the controller.
# - A run that fails for good (every restart ``max_failures`` allows spent): the driver raises
#   ``TrainingFailedError`` with every rank's traceback, designed or not: the run is over.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ray.train.v2._internal.execution.callback import ControllerCallback  # Ray Train V2's; no public name
from ray.train.v2._internal.execution.controller.state import ResizingState

# The loggers of Ray Train 2.60 that print what [Note: designed events] says.
RAY_TRAINING_ERROR_LOGGER = "ray.train.v2._internal.util"
RAY_BACKEND_SHUTDOWN_LOGGER = "ray.train.v2._internal.callbacks.backend_setup"
RAY_RESOURCE_REQUEST_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
_DESIGNED = "_hf_lowzero_designed"

logger = logging.getLogger(__name__)
_lost_peer_expected = False


def designed(error: BaseException) -> BaseException:
    """Mark ``error`` as the end of an attempt by design, announced by its own ``[hf_lowzero]`` line:
    Ray does not print its traceback ([Note: designed events]). Returns ``error``.

    Example::

        logger.error("[hf_lowzero] %s; rolling back: ...", error)
        raise designed(error)
    """
    setattr(error, _DESIGNED, True)
    return error


def expect_lost_peer() -> None:
    """Say that a peer of this worker is being killed on purpose (``InjectWorkerFailure``): the error
    that this costs the attempt here (a ``RuntimeError`` of a collective) prints no traceback.

    Example::

        if dist.get_rank() != victim:
            expect_lost_peer()
    """
    global _lost_peer_expected
    _lost_peer_expected = True


def is_designed(error: BaseException | None) -> bool:
    """Whether ``error`` ends an attempt by design ([Note: designed events]).

    Example::

        >>> is_designed(designed(RuntimeError("rollback"))), is_designed(ValueError("a bug"))
        (True, False)
    """
    if error is None:
        return False
    return getattr(error, _DESIGNED, False) or (_lost_peer_expected and isinstance(error, RuntimeError))


def quiet_designed_errors() -> None:
    """On a Ray Train worker: Ray prints no traceback for an error that ends the attempt by design
    ([Note: designed events]); any other error keeps it. Call it once per attempt, on every rank
    (``prepare_trainer`` does); calling it again changes nothing.

    Example::

        def train_func(config):
            quiet_designed_errors()
    """
    global _lost_peer_expected
    _lost_peer_expected = False  # a new attempt: nothing is expected yet
    training_errors = logging.getLogger(RAY_TRAINING_ERROR_LOGGER)
    if _not_a_designed_error not in training_errors.filters:
        training_errors.addFilter(_not_a_designed_error)


def _not_a_designed_error(record: logging.LogRecord) -> bool:
    # Ray logs it from inside the except that caught the error: sys.exc_info() is that error.
    return not (record.getMessage().startswith("Error in training function") and is_designed(sys.exc_info()[1]))


class ConsoleEvents(ControllerCallback):
    """A Ray Train controller callback for the controller's side of [Note: designed events]: one line
    when the worker group is resized, none of Ray's traceback for the shutdown of a group with a
    dead worker, and one line without traceback for a resource request that timed out. The Ray job
    adds it; add it to your own ``RunConfig(callbacks=[...])``.

    Example::

        TorchTrainer(train_func, run_config=RunConfig(callbacks=[ConsoleEvents()]), ...).fit()
        # (TrainController pid=7) [hf_lowzero] resizing the worker group from 1 to 2 workers: ...
    """

    def __init__(self) -> None:
        self.workers: int | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled on the controller as Ray starts it, before any controller hook runs: Ray's scaling
        # policy, always the first controller callback, sends its first resource request in its own
        # ``after_controller_start``, before this one's. On a busy machine that request times out
        # (seen in CI: the traceback on the console), so the filters are on from here.
        self.__dict__.update(state)
        _quiet_controller()

    def after_controller_start(self, train_run_context: Any) -> None:
        """On the controller: its console for ``hf_lowzero`` lines, and the filters of Ray's warnings
        (already on where Ray handed this callback over: see ``__setstate__``).
        """
        _quiet_controller()

    def on_controller_start_worker_group(self, *, scaling_config: Any, num_workers: int) -> None:
        """Remember the size of the group being started."""
        self.workers = num_workers
        return None  # no label selector: Ray places the workers as it would

    def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
        """Say when Ray resizes a running group."""
        if isinstance(current_state, ResizingState):
            logger.info(resize_line(self.workers, current_state.scaling_decision.num_workers))


def resize_line(workers: int | None, new_workers: int) -> str:
    """The console line of a resize of the worker group.

    Example::

        >>> resize_line(1, 2)[:62]
        '[hf_lowzero] resizing the worker group from 1 to 2 workers: th'
    """
    was = f"from {workers} " if workers else ""
    return (
        f"[hf_lowzero] resizing the worker group {was}to {new_workers} workers: the cluster has room for them; this "
        "attempt stops, and the next resumes the newest memory snapshot or checkpoint, resharded"
    )


def _quiet_controller() -> None:
    """The controller's console for ``hf_lowzero`` lines, and the filters of Ray's warnings ([Note:
    designed events]); once per process.
    """
    _controller_console()
    shutdown = logging.getLogger(RAY_BACKEND_SHUTDOWN_LOGGER)
    if _not_the_expected_shutdown_failure not in shutdown.filters:
        shutdown.addFilter(_not_the_expected_shutdown_failure)
    requests = logging.getLogger(RAY_RESOURCE_REQUEST_LOGGER)
    if _one_line_request_timeout not in requests.filters:
        requests.addFilter(_one_line_request_timeout)


def _controller_console() -> None:
    """``hf_lowzero`` INFO lines on the controller's stderr (Ray Train configures only ``ray.train`` there)."""
    ours = logging.getLogger("hf_lowzero")
    ours.setLevel(logging.INFO)
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        ours.addHandler(handler)
        ours.propagate = False


def _not_the_expected_shutdown_failure(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Graceful shutdown of backend failed")


def _one_line_request_timeout(record: logging.LogRecord) -> bool:
    if record.getMessage().startswith("Failed to send resource request"):
        record.exc_info, record.exc_text = None, None  # the line stays, its traceback goes
    return True
