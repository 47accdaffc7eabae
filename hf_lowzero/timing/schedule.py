"""The recorded sequence on a timeline: ``schedule`` and what a step's time is made of (``StepTime``).

[Note: the schedule]
- The host issues the program in order. Each op costs it ``dispatch_s``; an op on host tensors then
  runs on the host itself (offload's host step, a CPU rank's every op).
- Each stream runs its work in the order it was queued, none before the host issued it.
- A recorded event is done when the work its stream had queued is; a wait (a stream's on an event
  or on another stream, the host's on an event or a blocking copy) holds its context until then.
  An event recorded before the recording began is long done.
- A step is the time between two ``boundary`` marks, each at the end of an update, when the host and
  every stream but the collectives' have finished what was issued before it. The all-gathers an
  update leaves in flight run into the next step, and the next forward waits for them where the
  code says; the first boundary's update plays the previous step, so the step between the two
  boundaries pays for exactly what it waits for.
- The step's FLOPs (for MFU) are those of the ops the program issues between the two boundaries,
  wherever the timeline runs them: on a GPU the host may issue a whole forward and backward before
  the previous update has run (stage 0, with nothing to wait for), so the times it issues them at
  can lie before the step's start.
- ``comm hidden``: of the collectives' time inside the step, the share during which the host or
  some other stream was busy with work (compute, copies, the host step).

Example::

    timeline = schedule(recorder.program, Costs(Target.of("H100")))
    step = timeline.step_time()
    step.seconds, step.comm_hidden, step.host_seconds
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_lowzero.timing.costs import Costs
from hf_lowzero.timing.record import HOST, Program


@dataclass
class Timeline:
    """Busy intervals per context (``(start, end, kind)``, seconds from the recording's start) and
    the times of the ``boundary`` marks."""

    lanes: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)
    boundaries: list[float] = field(default_factory=list)
    # the matmul-like FLOPs issued before each boundary, since the one before ([Note: the schedule])
    flops: list[float] = field(default_factory=list)

    def step_time(self) -> StepTime:
        """The last step: between the last two boundaries (or from 0 to the only one)."""
        if not self.boundaries:
            raise ValueError("the program has no boundary: mark the end of each update (StepRecorder.boundary)")
        start = self.boundaries[-2] if len(self.boundaries) > 1 else 0.0
        end = self.boundaries[-1]
        comm = [(a, b) for lane in self.lanes.values() for a, b, kind in lane if kind == "collective"]
        busy = [(a, b) for lane in self.lanes.values() for a, b, kind in lane if kind != "collective"]
        comm_in = _clip(comm, start, end)
        comm_s = sum(b - a for a, b in comm_in)
        hidden = _overlap(_union(comm_in), _union(_clip(busy, start, end)))
        host = [(a, b) for a, b, kind in self.lanes.get(HOST, []) if kind == "host"]
        copies = [(a, b) for lane in self.lanes.values() for a, b, kind in lane if kind == "copy"]
        return StepTime(
            seconds=end - start,
            comm_seconds=comm_s,
            comm_hidden=hidden / comm_s if comm_s > 0 else None,
            host_seconds=sum(b - a for a, b in _clip(host, start, end)),
            copy_seconds=sum(b - a for a, b in _clip(copies, start, end)),
            flops=self.flops[-1],
        )


@dataclass(frozen=True)
class StepTime:
    """One step's time and what it is made of (seconds). ``comm_hidden`` is None without collectives;
    ``flops`` counts the matmul-like work issued in the step (for MFU)."""

    seconds: float
    comm_seconds: float
    comm_hidden: float | None
    host_seconds: float
    copy_seconds: float
    flops: float


def schedule(program: Program, costs: Costs) -> Timeline:
    """Run ``program`` on the timeline ([Note: the schedule]) at ``costs``."""
    host = 0.0
    ready: dict[str, float] = {}
    marks: dict[int, float] = {}
    timeline = Timeline()
    lanes = timeline.lanes
    dispatch = costs.dispatch
    comm_contexts: set[str] = set()
    flops = 0.0  # issued since the last boundary
    for step in program.steps:
        what = step[0]
        if what == "run":
            _, context, kind, work = step
            if kind == "collective":
                comm_contexts.add(context)
                seconds = costs.collective(*work)
            elif kind == "copy":
                seconds = costs.copy(work)
            elif context == HOST:
                seconds = costs.host(work)
            else:
                seconds = costs.kernel(work)
            if kind in ("kernel", "host") and not work.launches:
                host += dispatch  # a view or an allocation: the host's dispatch only
                continue
            host += dispatch
            if kind in ("kernel", "host"):
                flops += work.flops
            if context == HOST:
                start, host = host, host + seconds
            else:
                start = max(ready.get(context, 0.0), host)
                ready[context] = start + seconds
            if seconds > 0:
                lanes.setdefault(context, []).append((start, start + seconds, kind))
        elif what == "record":
            _, context, mark = step
            marks[mark] = host if context == HOST else max(ready.get(context, 0.0), host)
        elif what == "wait":
            _, context, mark = step
            done = marks.get(mark, 0.0)
            if context == HOST:
                host = max(host, done)
            else:
                ready[context] = max(ready.get(context, 0.0), done)
        elif what == "boundary":
            busy = [t for c, t in ready.items() if c not in comm_contexts]
            timeline.boundaries.append(max([host, *busy]))
            timeline.flops.append(flops)
            flops = 0.0
    return timeline


def _clip(intervals, start: float, end: float) -> list[tuple[float, float]]:
    return [(max(a, start), min(b, end)) for a, b in intervals if b > start and a < end]


def _union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(left, right) -> float:
    """The length of the intersection of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(left) and j < len(right):
        a, b = max(left[i][0], right[j][0]), min(left[i][1], right[j][1])
        total += max(0.0, b - a)
        if left[i][1] < right[j][1]:
            i += 1
        else:
            j += 1
    return total
