"""Ray settings of the test runs only: what a user's run keeps and our tests need not pay for.

``tests/conftest.py`` sets them for every test and the jobs and clusters it starts. The tests that
compare a job's console with what a user sees (``tests/test_docs.py``'s jobs, ``tests/test_ray.py``'s
killed job) run with Ray's defaults instead (``as_a_user_runs``)."""

from __future__ import annotations

import os

TEST_ONLY = {
    # Ray Train starts a preemption watcher with every attempt's worker group: an actor (a process,
    # about 2 CPU-seconds to start) that polls for spot-instance notices, which never come here.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


def apply() -> None:
    for name, value in TEST_ONLY.items():
        os.environ.setdefault(name, value)


def as_a_user_runs(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the test-only settings: Ray's defaults, as a user's job gets them."""
    return {k: v for k, v in env.items() if k not in TEST_ONLY}
