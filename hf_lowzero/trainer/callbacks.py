"""The Trainer's callbacks see current params ([Note: params are current] in ``zero/update/allgather.py``).

With ``overlap_allgather`` the optimizer's step returns with the all-gathers of the updated params in
flight. A callback that reads params at ``on_step_end`` (an EMA of the weights, a norm it logs) must
see the updated values, as it would without ZeRO. ``gate_callbacks`` makes the Trainer's callback
handler wait for them before an event that some callback could read params in:

- before ``on_train_end``, ``on_evaluate``, ``on_predict`` and ``on_save``, always (they are rare);
- before any other event, when a callback overrides that event's method and is not one of
  transformers' or hf_lowzero's own (which read no params there: progress, logging, flow, reports).

So a run whose callbacks are all the Trainer's own keeps its gathers in flight into the next forward.

Example::

    gate_callbacks(trainer.callback_handler, trainer.zero_optimizer.wait_for_params)
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback

ALWAYS = frozenset({"on_train_end", "on_evaluate", "on_predict", "on_save"})
TRUSTED = ("transformers.", "hf_lowzero.")  # modules whose callbacks read no params at step events


def gate_callbacks(handler, wait: Callable[[], None]) -> None:
    """Make ``handler`` (a ``CallbackHandler``) call ``wait`` before an event a callback may read
    params in (see the module docstring).

    Args:
        handler: The Trainer's ``callback_handler``.
        wait: What makes the params current (``LowLevelZeroOptimizer.wait_for_params``).
    """
    call_event = handler.call_event

    def gated(event, args, state, control, **kwargs):
        if event in ALWAYS or any(reads_params(callback, event) for callback in handler.callbacks):
            wait()
        return call_event(event, args, state, control, **kwargs)

    handler.call_event = gated


def reads_params(callback: TrainerCallback, event: str) -> bool:
    """Whether ``callback`` may read params at ``event``: it overrides that method and is not one of
    transformers' or hf_lowzero's own."""
    kind = type(callback)
    overrides = getattr(kind, event, None) is not getattr(TrainerCallback, event, None)
    return overrides and not kind.__module__.startswith(TRUSTED)
