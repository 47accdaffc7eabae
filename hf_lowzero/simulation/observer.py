"""What a simulated GPU step tells an observer about its ordering: the ``StepObserver`` protocol.

``FakeCudaOps`` (``streams.py``) and the NCCL stand-in (``nccl.py``) call their ``observer``, when
one is set, at every event recorded, every wait and every collective, in the order the host issues
them. The time model (``hf_lowzero.timing``) is one: it gives each piece of work a cost and
schedules the streams from these calls. The observer sees the step's own sequence; it changes
nothing in it.

Example::

    ops = FakeCudaOps(checker, device)
    ops.observer = recorder          # any object with StepObserver's methods
"""

from __future__ import annotations

from typing import Protocol


class StepObserver(Protocol):
    """Streams are ``FakeStream`` objects, events ``FakeEvent`` objects (both from ``streams.py``);
    a collective is known by the handle ``collective`` returns."""

    def event_recorded(self, stream, event) -> None:
        """``event`` marks the work queued on ``stream`` so far."""

    def stream_waits(self, stream, event) -> None:
        """``stream`` runs nothing queued after this until ``event``'s work is done."""

    def stream_waits_stream(self, stream, other) -> None:
        """``stream`` waits for everything queued on ``other`` so far."""

    def host_waits(self, event) -> None:
        """The host waits for ``event``'s work (``cudaEventSynchronize``)."""

    def collective(self, stream, after, op: str, nbytes: int, group_size: int) -> object:
        """A collective ``op`` of ``nbytes`` (the larger of its input and output) over ``group_size``
        ranks, queued on NCCL's ``stream`` after the work queued on ``after`` (the current stream);
        returns a handle for ``collective_waited``."""

    def collective_waited(self, stream, handle) -> None:
        """``stream`` waits for the collective of ``handle`` (its work handle's ``wait()``)."""
