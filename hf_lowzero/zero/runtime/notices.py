"""Warnings about the setup that a process gives once, however many optimizers it builds (a Trainer's
``model_init``, a hyperparameter search), in the ``[hf_lowzero]`` form of the library's log.

Example::

    warn_once(logger, determinism_warning(device))   # the first time in this process; None: nothing
"""

from __future__ import annotations

import logging

_GIVEN: set[str] = set()  # the texts this process warned about


def warn_once(logger: logging.Logger, text: str | None) -> bool:
    """Log ``text`` as a warning unless this process already did (or ``text`` is None); returns
    whether it was logged now."""
    if text is None or text in _GIVEN:
        return False
    _GIVEN.add(text)
    logger.warning("[hf_lowzero] %s", text)
    return True
