"""One calm line per designed event ([Note: designed events] in ``hf_lowzero/ray/events.py``), checked
against Ray Train's own code without a Ray run: the function with which a worker logs an error that
ended its training function, the controller's states, and the attempt's line. The whole console of
the rollback demo is compared with the docs in ``tests/test_docs.py``."""

from __future__ import annotations

import logging
import pickle
import types

import pytest

pytest.importorskip("ray")

from ray.train.v2._internal.execution.controller.state import ResizingState, RestartingState  # noqa: E402
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ResizeDecision  # noqa: E402
from ray.train.v2._internal.util import construct_user_exception_with_traceback  # noqa: E402

from hf_lowzero.ray import events, restore  # noqa: E402
from hf_lowzero.ray.console import ConsoleProgress  # noqa: E402
from hf_lowzero.ray.events import (  # noqa: E402
    RAY_BACKEND_SHUTDOWN_LOGGER,
    RAY_RESOURCE_REQUEST_LOGGER,
    RAY_TRAINING_ERROR_LOGGER,
    ConsoleEvents,
    designed,
    expect_lost_peer,
    quiet_designed_errors,
)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def caught(monkeypatch):
    """What the named loggers print: ``caught(name)`` -> the lines so far. Each logger's handlers,
    filters, level and propagation are restored afterwards."""
    handlers: dict[str, Lines] = {}
    saved: list[tuple[logging.Logger, dict]] = []

    def lines(name: str) -> list[str]:
        if name not in handlers:
            log = logging.getLogger(name)
            saved.append((log, {k: getattr(log, k) for k in ("handlers", "filters", "propagate", "disabled")}))
            saved[-1][1]["level"] = log.level
            handlers[name] = Lines()
            log.handlers, log.filters, log.propagate, log.disabled = [handlers[name]], list(log.filters), False, False
            log.setLevel(logging.DEBUG)
        return handlers[name].lines

    monkeypatch.setattr(events, "_lost_peer_expected", False)
    yield lines
    for log, state in saved:
        log.setLevel(state.pop("level"))
        for key, value in state.items():
            setattr(log, key, value)


def end_training_function(error: BaseException) -> None:
    """What Ray Train's training thread does with the error its training function raised."""
    try:
        raise error
    except BaseException as e:
        construct_user_exception_with_traceback(e)


def test_ray_prints_no_traceback_for_a_designed_error_and_the_whole_one_for_any_other(caught):
    printed = caught(RAY_TRAINING_ERROR_LOGGER)
    quiet_designed_errors()
    quiet_designed_errors()  # once per attempt; again changes nothing
    assert logging.getLogger(RAY_TRAINING_ERROR_LOGGER).filters.count(events._not_a_designed_error) == 1

    end_training_function(designed(RuntimeError("integrity check failed at step 15")))
    assert printed == []
    end_training_function(RuntimeError("a bug"))
    (line,) = printed
    assert line.startswith("Error in training function:\nTraceback (most recent call last):")
    assert line.rstrip().endswith("RuntimeError: a bug")


def test_a_peer_killed_on_purpose_quiets_the_collective_error_it_causes_until_the_next_attempt(caught):
    printed = caught(RAY_TRAINING_ERROR_LOGGER)
    quiet_designed_errors()
    end_training_function(RuntimeError("Connection closed by peer"))  # no peer killed on purpose yet
    assert len(printed) == 1
    expect_lost_peer()
    end_training_function(RuntimeError("Connection closed by peer"))
    assert len(printed) == 1
    end_training_function(ValueError("not what a lost peer raises"))
    assert len(printed) == 2 and printed[-1].rstrip().endswith("ValueError: not what a lost peer raises")
    quiet_designed_errors()  # the next attempt expects nothing
    end_training_function(RuntimeError("Connection closed by peer"))
    assert len(printed) == 3


def test_the_controller_says_when_it_resizes_the_group_and_hides_the_dead_workers_shutdown_warning(caught):
    caught("hf_lowzero")  # the controller's console for our lines, set up here in the test's process
    printed = caught("hf_lowzero.ray.events")
    shutdown = caught(RAY_BACKEND_SHUTDOWN_LOGGER)
    callback = ConsoleEvents()
    callback.after_controller_start(train_run_context=None)
    assert callback.on_controller_start_worker_group(scaling_config=None, num_workers=1) is None

    logging.getLogger(RAY_BACKEND_SHUTDOWN_LOGGER).warning(
        "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.", exc_info=True
    )
    logging.getLogger(RAY_BACKEND_SHUTDOWN_LOGGER).warning("something else")
    assert shutdown == ["something else"]

    running = types.SimpleNamespace()
    callback.after_controller_state_update(running, RestartingState(training_failed_error=RuntimeError("x")))
    assert printed == []  # a restart's line is the first rank's attempt line
    resize = ResizingState(ResizeDecision(num_workers=2, resources_per_worker={}))
    callback.after_controller_state_update(running, resize)
    assert printed == [events.resize_line(1, 2)]
    assert printed[0].startswith("[hf_lowzero] resizing the worker group from 1 to 2 workers: ")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            restore.ResumeSource("memory", 13, 10, "/m/checkpoint-13"),
            " from its memory snapshot (newest storage checkpoint 10)",
        ),
        (restore.ResumeSource("memory", 13, 0, "/m/checkpoint-13"), " from its memory snapshot (none in storage yet)"),
        (restore.ResumeSource("storage", 13, 13, "/s/checkpoint-13"), " from its storage checkpoint"),
        (restore.ResumeSource("storage", 10, 10, "/s/checkpoint-10"), ""),  # not this resume: left out
        (None, ""),  # resume_checkpoint() not called
    ],
)
def test_a_restarts_line_says_where_it_resumed(caught, monkeypatch, source, expected):
    printed = caught("hf_lowzero.ray.console")
    monkeypatch.setattr(restore, "_last", source)
    state = types.SimpleNamespace(is_world_process_zero=True, global_step=13, max_steps=40)
    args = types.SimpleNamespace(world_size=2, zero_stage=2)
    ConsoleProgress(attempt=2).on_train_begin(args, state, control=None)
    assert printed == [f"[hf_lowzero] attempt 2: resuming at step 13/40{expected} on 2 workers, ZeRO stage 2"]


def _handed_to_the_controller(callback: ConsoleEvents) -> ConsoleEvents:
    """As Ray hands a callback to the controller actor: pickled, then unpickled there. No hook of it
    has run yet when the scaling policy's ``after_controller_start`` sends the first request."""
    return pickle.loads(pickle.dumps(callback))


def _started(callback: ConsoleEvents) -> ConsoleEvents:
    callback.after_controller_start(train_run_context=None)
    return callback


@pytest.mark.parametrize("on_the_controller", [_handed_to_the_controller, _started], ids=["handed over", "started"])
def test_a_resource_request_that_timed_out_is_one_line_without_its_traceback(caught, monkeypatch, on_the_controller):
    """Ray's own warning, from its own client, when its 5 s wait for the autoscaling coordinator times out
    under load: the line stays, the traceback goes; any other warning of that logger keeps its traceback.
    From the moment Ray hands the callback over: the first request comes before its own hook runs."""
    import io

    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client

    assert client.logger.name == RAY_RESOURCE_REQUEST_LOGGER
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = client.logger
    saved = (list(log.filters), log.propagate)
    log.filters = [f for f in log.filters if f is not events._one_line_request_timeout]  # as a fresh controller
    log.addHandler(handler)
    log.propagate = False
    caught("hf_lowzero")  # the controller's console for our lines: restored afterwards
    try:
        on_the_controller(ConsoleEvents())

        coordinator = types.SimpleNamespace(request_resources=types.SimpleNamespace(remote=lambda **kwargs: "ref"))
        requester = client.TrainAutoscalingCoordinatorClient("run")
        requester.__dict__["_autoscaling_coordinator"] = coordinator  # its cached_property, filled
        scaling = ScalingConfig(num_workers=2)

        def timed_out(*args, **kwargs):
            raise TimeoutError("GetTimeoutError: 5 s")

        with monkeypatch.context() as patched:
            patched.setattr(client.ray, "get", timed_out)
            requester.send_resource_request(scaling, 2)
        try:
            raise ValueError("another")
        except ValueError:
            log.warning("something else", exc_info=True)
    finally:
        log.removeHandler(handler)
        log.filters, log.propagate = saved
    text = out.getvalue()
    first, rest = text.split("something else", 1)
    assert first.startswith("Failed to send resource request for run.") and "Traceback" not in first
    assert "Traceback" in rest and "ValueError: another" in rest
