"""The test tiers: ``python -m pytest -m "not slow"`` (the README's command, under 10 minutes on a
2-core machine) and ``-m slow`` (``.ci/run`` runs it after): long Ray runs, launcher subprocesses,
and the larger world sizes and longer parity runs of tests whose smaller cases stay fast."""

from __future__ import annotations

import pytest


def slow(value):
    """A ``parametrize`` case for the slow tier; a tuple is one case of several arguments."""
    values = value if isinstance(value, tuple) else (value,)
    return pytest.param(*values, marks=pytest.mark.slow)
