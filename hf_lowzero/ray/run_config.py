"""A ``RunConfig`` for any ``TorchTrainer`` that uses hf_lowzero on Ray: a caller's merged with a
job's own, plus the controller callbacks every such run wants: the release of the run's memory
snapshots when it ends, and the controller's side of the console's designed events.

Example::

    run_config = with_job_callbacks(merge_run_config(caller_run_config, RunConfig(name="job")))
    TorchTrainer(train_func, run_config=run_config, ...).fit()
"""

from __future__ import annotations

import dataclasses

from ray.train import RunConfig

from hf_lowzero.ray.events import ConsoleEvents
from hf_lowzero.ray.holder_lifetime import ReleaseSnapshots

# RunConfig.__post_init__ names a run it was given no name for "ray_train_run-<date>".
_UNNAMED_RUN_PREFIX = "ray_train_run-"


def with_job_callbacks(run_config: RunConfig) -> RunConfig:
    """``run_config`` with ``ReleaseSnapshots`` and ``ConsoleEvents`` among its callbacks (each once):
    the run's memory snapshots are freed when it ends, whatever the caller's callbacks ([Note: holder
    lifetime] in ``holder_lifetime.py``), and the controller says when it resizes the worker group
    ([Note: designed events] in ``events.py``).

    Args:
        run_config: The run's configuration.

    Returns:
        A copy with the callbacks it lacked added, or one equal to ``run_config`` when it has both.
    """
    callbacks = list(run_config.callbacks or [])
    for kind in (ReleaseSnapshots, ConsoleEvents):
        if not any(isinstance(cb, kind) for cb in callbacks):
            callbacks.append(kind())
    return dataclasses.replace(run_config, callbacks=callbacks)


def merge_run_config(caller: RunConfig | None, defaults: RunConfig) -> RunConfig:
    """``defaults`` with every field ``caller`` set: a field the caller left out (``RunConfig`` fills
    in ``FailureConfig()``, ``~/ray_results``, ``ray_train_run-<date>``, ...) keeps the default's value.

    Example::

        >>> merged = merge_run_config(RunConfig(failure_config=FailureConfig(max_failures=1)),
        ...                           RunConfig(name="job", failure_config=FailureConfig(max_failures=3)))
        >>> merged.name, merged.failure_config.max_failures
        ('job', 1)

    Args:
        caller: The caller's ``RunConfig``, or None.
        defaults: The job's own ``RunConfig``.

    Returns:
        ``defaults`` with the caller's fields put in, or ``defaults`` itself when ``caller`` is None.
    """
    if caller is None:
        return defaults
    unset = RunConfig()
    given = {}
    for f in dataclasses.fields(RunConfig):
        value = getattr(caller, f.name)
        left_out = value.startswith(_UNNAMED_RUN_PREFIX) if f.name == "name" else value == getattr(unset, f.name)
        if not left_out:
            given[f.name] = value
    return dataclasses.replace(defaults, **given)
