"""The pure decisions behind memory snapshots: which node keeps each rank's second copy, and how
often to take a snapshot so that it costs at most a set share of training time.

Example::

    >>> buddy_nodes(["a", "a", "b", "b"])      # each rank's copy goes to the next node
    ['b', 'b', 'a', 'a']
    >>> buddy_nodes(["a", "a"])                 # one node: no buddy, process loss only
    [None, None]
    >>> schedule = SnapshotSchedule("auto")
    >>> [schedule.due(step) for step in range(1, 7)]   # warm-up steps measure the step time
    [False, False, False, False, False, True]

# [Note: auto interval]
# ``snapshot_every="auto"`` measures what a snapshot costs on this run and picks the interval that
# keeps it within ``AUTO_OVERHEAD`` (2%) of training time, and starts early, so that a short run is
# protected too. The first WARMUP steps take none and give the step time without snapshots (their
# median, so the first step's compilation and allocation do not count). The next step takes a
# warm-up snapshot, whose cost (the holders' first calls, the piece's layout) is not counted, and
# PROBE_GAP steps later a probe, whose cost is; the step after the probe waits for it to land and
# decides the interval, counted from the probe. A cost is measured as training feels it: the time
# the step loop was stopped for the copy, plus how much longer than that median the steps ran
# while the snapshot was written and sent in the background (on a machine whose cores all train,
# the background work slows them; on a GPU node it mostly does not), but no more than the time the
# background work ran (the holders, the copy to the buddy node, and on a GPU node the writer
# thread: one chain, each part waiting for the one before): on a noisy machine a slow step during a snapshot is not all
# the snapshot's doing. The interval is the shared scheduler's ([Note: the auto interval's budget] in
# zero/auto_interval.py, with the SNAPSHOTS budget): ceil(cost / (2% of a step)), at least 1,
# re-decided at every later snapshot from the median cost of the last 20 (one slow snapshot does not
# stretch the interval); ranks take the largest rank's choice, so that every rank snapshots the
# same steps. One more bound: a snapshot older than the
# newest storage checkpoint is never used, so auto takes one at least every half of the Trainer's
# ``save_steps`` (a failure loses at most half the steps between two storage checkpoints), even
# when that costs more than 2%: on a tiny model whose steps take a few ms, as in the main job
# (storage every 10 steps, snapshots at steps 6 and 8 and then every 5 or fewer). Five warm-up
# steps, not fewer: the median of three early steps, slowed by a cluster still starting, made a
# 30 MiB snapshot look cheap and auto take one every 2 steps.
"""

from __future__ import annotations

from hf_lowzero.zero.auto_interval import AutoInterval, Budget, Median

AUTO_OVERHEAD = 0.02
WARMUP = 5
PROBE_GAP = 2
MAX_INTERVAL = 10_000
SNAPSHOTS = Budget(
    setting="snapshot_every",
    work="snapshots",
    overhead=AUTO_OVERHEAD,
    max_interval=MAX_INTERVAL,
    off=(None, "off", "none"),
    off_text="None (no memory snapshots)",
    step_time=lambda: Median(50),  # steps with no snapshot work in flight
    cost=lambda: Median(20),
)


def buddy_nodes(node_of_rank: list[str]) -> list[str | None]:
    """For each rank, the node that keeps the second copy of its piece: the next node in order of
    first appearance (cyclic), so each node keeps its own ranks' pieces and one other node's; None
    for every rank when all share one node."""
    nodes = list(dict.fromkeys(node_of_rank))
    if len(nodes) < 2:
        return [None] * len(node_of_rank)
    following = {node: nodes[(i + 1) % len(nodes)] for i, node in enumerate(nodes)}
    return [following[node] for node in node_of_rank]


def check_every(every: int | str | None) -> int | str | None:
    """``snapshot_every`` validated: None (or ``"off"``: no snapshots), a positive int (or its digits),
    or ``"auto"``."""
    return SNAPSHOTS.check(every)


class SnapshotSchedule(AutoInterval):
    """When to take snapshots: every ``every`` steps, or on the [Note: auto interval] policy (the
    shared scheduler's [Note: the auto interval's budget] with ``SNAPSHOTS``, after a warm-up and a probe)."""

    def __init__(self, every: int | str) -> None:
        super().__init__(every, SNAPSHOTS)
        if self.every is None:
            raise ValueError("SnapshotSchedule needs an interval; None means no snapshots")
        self.interval = PROBE_GAP if self.auto else self.every
        self.next_step = WARMUP + 1 if self.auto else self.every
        self.probe_step = WARMUP + 1 + PROBE_GAP  # auto: the first snapshot whose cost counts
        self._decided = not self.auto
        self._uncounted = 1 if self.auto else 0  # the warm-up snapshot's cost

    def due(self, step: int) -> bool:
        if self.auto:
            return super().due(step)
        return step % self.every == 0

    def start(self, origin: int, storage_every: int | None = None) -> None:
        """The run (or this attempt of it) starts after step ``origin``: auto's warm-up, snapshots
        and decision count from there (a resumed run measures its own steps again). With
        ``storage_every`` (the Trainer's ``save_steps``), auto takes a snapshot at least every half
        of it ([Note: auto interval])."""
        if storage_every is not None and storage_every >= 2:
            self.cap = storage_every // 2  # the Budget's MAX_INTERVAL until then
        if self.auto:
            self.next_step, self.probe_step = origin + WARMUP + 1, origin + WARMUP + 1 + PROBE_GAP

    @property
    def settled(self) -> bool:
        """The interval was decided (fixed intervals always are)."""
        return self._decided

    def decides(self, step: int) -> bool:
        """Auto: this step waits for the probe and agrees on the interval ([Note: auto interval])."""
        return not self._decided and step == self.probe_step + 1

    def decided(self, interval: int) -> None:
        """Every rank agreed on ``interval``, counted from the probe."""
        self._decided = True
        self.interval = interval
        self.next_step = max(self.probe_step + interval, self.probe_step + 2)

    def observe_step(self, seconds: float, busy: bool) -> None:
        """One step's wall time (the copy excluded); ``busy``: a snapshot was encoded or sent meanwhile."""
        if not busy:
            self.add_step(seconds)

    def observe_snapshot(self, stopped_s: float, busy_step_s: list[float], background_s: float | None = None):
        """A finished snapshot: seconds the loop stopped for it, the times of the steps that ran
        while it was in the background, and how long its background work ran (the holders, the
        copy to the buddy node, a GPU node's writer thread): the steps' excess counts up to that, no more (a noisy
        step is not a cost)."""
        if self._uncounted:
            self._uncounted -= 1
            return
        base = self.step_s or 0.0
        # Signed: clipping each step's excess at zero would count step-time noise as cost.
        excess = max(0.0, sum(s - base for s in busy_step_s))
        if background_s is not None:
            excess = min(excess, background_s)
        self.add_cost(stopped_s + excess)

    def proposed_interval(self) -> int:
        """This rank's interval ([Note: auto interval]): the fixed one, or the one its measurements give."""
        if self.auto and not self._decided and self.cost_s is None:
            return PROBE_GAP  # the warm-up snapshot's next is the probe; the probe's waits for the decision
        return super().proposed_interval()

    def taken(self, step: int, interval: int) -> None:
        """A snapshot was taken at ``step``; every rank agreed on ``interval`` for the next."""
        super().taken(step, interval)
        if not self._decided and step >= self.probe_step:
            self.next_step = self.probe_step + 2  # the decision comes first
