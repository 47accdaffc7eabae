"""Taking memory snapshots on Ray: each rank's piece kept twice, on its node and on a buddy node.

``prepare_trainer(trainer, snapshot_every=...)`` adds ``MemorySnapshots``; nothing else changes in
the training function. At a snapshot step every rank copies its shard into a host buffer ([Note:
double buffer] in ``hf_lowzero/snapshot/stager.py``), writes the piece into a file in its node's
memory and posts one request to its node's holder, on a connection that stays open (no Ray call),
and training goes on ([Note: written at the stop]; on a GPU a background thread waits for the copy
and does the rest). The holder keeps the file, copies it to the buddy node's holder and marks the
step on every holder once both landed ([Note: one request per snapshot] in ``holder.py``, [Note:
complete snapshot] in ``hf_lowzero/snapshot/protocol.py``); its answer is read at a later stop.

Example::

    trainer = prepare_trainer(LowZeroTrainer(model=model, args=args, train_dataset=ds), snapshot_every="auto")
    trainer.train(resume_from_checkpoint=resume_checkpoint())   # memory or storage, whichever is newer
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_lowzero.ray.holder import holder_for
from hf_lowzero.ray.holder_lifetime import current_run, release_run
from hf_lowzero.ray.restore import discard, last_resume
from hf_lowzero.ray.snapshot_plan import AUTO_OVERHEAD, MAX_INTERVAL, SnapshotSchedule, buddy_nodes
from hf_lowzero.snapshot import ShardStager, Staged
from hf_lowzero.snapshot.priority import lower_this_thread
from hf_lowzero.snapshot.protocol import Landed, LandRequest
from hf_lowzero.snapshot.segments import node_folder, piece_path
from hf_lowzero.snapshot.transfer import TIMEOUT_S, Link
from hf_lowzero.trainer.snapshot_files import LogCopies, trainer_manifest

logger = logging.getLogger(__name__)
_TAKERS: weakref.WeakSet[MemorySnapshots] = weakref.WeakSet()
MIB = 1 << 20


class SnapshotError(RuntimeError):
    """A snapshot that did not land (a holder refused a piece, or was gone); training goes on."""


# [Note: written at the stop]
# On the host (the shard's tensors in host memory: CPU training) the stop writes the piece itself,
# right after its copy: the checksums and the bytes into the piece's file, through the kept mapping
# (under 1 ms for the main job's 0.7 MiB shard), and it posts the holder's request without
# waiting for the answer ([Note: posted requests] in ``transfer.py``), which a later stop reads
# (``_read_answers``). No thread of the training process works on the snapshot after the stop. A
# background thread that wrote the piece and waited for the holder's answer cost training more than
# its own CPU: it took the GIL from the training thread at moments it did not choose (after each
# checksum call that released it, and when the answer woke it in the middle of the next step):
# the main job's snapshot cost 6.9 ms of training that way and 5.1 ms written at the stop, in one
# run of ``benchmarks/recovery.py`` (docs/recovery.md).
# On a GPU the copy runs on a side stream while the next step runs, so a background thread waits
# for it, writes the piece and posts the request; the stop reads the answers all the same.


@dataclass
class _InFlight:
    step: int
    future: Future  # done once its holder answered: where its time went (``_landed``), or why it was not kept
    stopped_s: float
    check_s: float = 0.0  # the integrity check the snapshot asked for ([Note: verified snapshots])
    busy_steps: list[float] = field(default_factory=list)


@dataclass
class _Posted:
    """A snapshot whose request was posted to this node's holder ([Note: posted requests] in
    ``transfer.py``), waiting for the answer.
    """

    future: Future
    write_s: float  # the write, in seconds
    in_background: bool  # written by the background thread (a CUDA copy), not at the stop
    torn: bool  # tests: not marked, and the process dies once the piece landed


class MemorySnapshots(TrainerCallback):
    """Snapshots of the whole training state in node memory every ``every`` steps (or ``"auto"``:
    [Note: auto interval] in ``snapshot_plan.py``). Needs a ZeRO trainer (``LowZeroTrainer`` or a
    ``with_zero`` twin with ``zero_stage`` 1 or 2), which calls ``after_log_save_evaluate`` at the
    [Note: snapshot point]. ``setup()`` must run on every rank of the worker group at once
    (``prepare_trainer`` calls it).

    Args:
        every: A snapshot every this many steps, ``"auto"`` or ``"off"``.

    Raises:
        ValueError: ``every`` is not a number of steps >= 1, ``"auto"`` or ``"off"``.
    """

    def __init__(self, every: int | str = "auto") -> None:
        self.schedule = SnapshotSchedule(every)
        self.fault: tuple[int, Callable[[], None]] | None = None  # tests: (step, kill) between landing and marks
        self.background_writes = False  # tests: write every piece in the background thread, as on a GPU
        self.snapshots_taken = 0
        self.stopped_s = 0.0  # seconds the step loop stopped for snapshots (copies and agreement)
        self.timings: deque[dict] = deque(maxlen=1000)  # the last snapshots: where their time went (``_landed``)
        self._stager: ShardStager | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: list[_InFlight] = []
        self._link: Link | None = None  # to this node's holder ([Note: one request per snapshot])
        self._posted: deque[_Posted] = deque()  # requests on ``_link`` in order, answers to read
        self._post_lock = threading.Lock()  # a post or an answer, and its entry in ``_posted``
        self._log = LogCopies()  # the trainer state's log, copied once ([Note: lists encoded once])
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._announced = False
        self._resume_discarded = False
        _TAKERS.add(self)

    def setup(self) -> None:
        """Find this rank's node and buddy node and their holders (collective)."""
        self.run = current_run()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        node = ray.get_runtime_context().get_node_id()
        nodes: list[str] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(nodes, node)
        self.nodes = nodes
        self._buddy_node = buddy_nodes(nodes)[self.rank]
        self._own = holder_for(self.run, node)
        self._holders = [holder_for(self.run, n) for n in dict.fromkeys(nodes)]
        self._folder = node_folder(self.run.run_id, node)
        # Started now, not during the first snapshot: a holder's start (a process importing torch)
        # would be charged to that snapshot and to the steps it overlaps.
        ray.get([h.index.remote() for h in self._holders])

    @property
    def one_node(self) -> bool:
        """All workers share one node: snapshots protect against a lost process only."""
        return len(set(self.nodes)) < 2

    # ------------------------------------------------------------------- the step loop

    def after_log_save_evaluate(self, trainer) -> None:
        """Called by ``LowZeroTrainer`` once a step's log, evaluation and save are done."""
        step = trainer.state.global_step
        if step == self._last_step:  # the epoch's end calls it again for the same step
            return
        now = time.perf_counter()
        self._collect(now)
        self._last_step = step
        if self.schedule.decides(step):
            self._decide(step)
        if step < trainer.state.max_steps and self.schedule.due(step):
            self._take(trainer, step, now)
        integrity = trainer.zero_optimizer.integrity
        if _rollback_points(integrity) and self.schedule.due(step + 1):
            integrity.request(step + 1)  # [Note: verified snapshots]
        self._last_time = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        """Start the schedule from the step this attempt resumes at ([Note: auto interval])."""
        saves = args.save_strategy == "steps" and args.save_steps >= 1
        self.schedule.start(state.global_step, int(args.save_steps) if saves else None)

    def on_step_begin(self, args, state, control, **kwargs):
        """Before the first step after a resume from memory: remove the node's restored folder."""
        if not self._resume_discarded:
            self._resume_discarded = True
            resumed = last_resume()
            if resumed is not None and resumed.kind == "memory":
                # Each rank reads its own RNG file before its first step, with no collective: the
                # node's folder goes once every rank has (the decision is the same on every rank).
                dist.barrier()
                discard(resumed)

    def on_train_end(self, args, state, control, **kwargs):
        """Wait for snapshots on their way, then (rank 0) end the run's holders."""
        self.close()
        dist.barrier()  # no rank's snapshot is still on its way to a holder
        if self.rank == 0:
            release_run(self.run.run_id)

    def wait(self) -> None:
        """Wait until every snapshot taken so far landed or failed."""
        if self._executor is not None:
            self._executor.submit(lambda: None).result()  # the pieces it was writing are posted
        self._read_answers(wait=True)

    def close(self) -> None:
        """Wait for snapshots on their way and free the host buffers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._in_flight:
            self._read_answers(wait=True)
            self._collect(time.perf_counter())
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._link is not None:
            self._link.close()
            self._link = None

    def _collect(self, now: float) -> None:
        """Account the step that just ended, and every snapshot that finished."""
        if self._last_time is not None:
            seconds = now - self._last_time
            busy = bool(self._in_flight)  # a snapshot was on its way during (part of) this step
            for f in self._in_flight:
                f.busy_steps.append(seconds)
            self.schedule.observe_step(seconds, busy)
        self._collect_finished()

    def _collect_finished(self) -> None:
        self._read_answers(wait=False)
        for f in [f for f in self._in_flight if f.future.done()]:
            self._in_flight.remove(f)
            error = f.future.exception()
            if error is not None:
                logger.warning("[hf_lowzero] the memory snapshot of step %d was not kept: %s", f.step, error)
                continue
            times = f.future.result()
            self.timings.append({"step": f.step, "stopped_s": f.stopped_s, "check_s": f.check_s, **times})
            self.schedule.observe_snapshot(f.stopped_s + f.check_s, f.busy_steps, times["chain_s"])

    def _take(self, trainer, step: int, start: float) -> None:
        if self._stager is not None and self._stager.opt is not trainer.zero_optimizer:
            self.close()  # a new optimizer (model_init, a second train()): new buffers for it
        if self._stager is None:
            self._stager = ShardStager(trainer.zero_optimizer)
        staged = self._stager.stage(step, live=not self.background_writes)  # [Note: written from the live shard]
        fields = trainer_manifest(trainer, include_state=self.rank == 0, log=self._log)
        integrity = trainer.zero_optimizer.integrity
        verified, check_s = None, 0.0
        if _rollback_points(integrity):  # [Note: verified snapshots]
            verified = integrity.last_verified == step  # the same on every rank
            check_s = integrity.verify_seconds / max(1, integrity.checks)  # the check this snapshot asked for
        future: Future = Future()
        if staged.copied is None and not self.background_writes:  # on the host: [Note: written at the stop]
            self._write_and_post(staged, fields, verified, future)
        else:  # the copy is still running on the GPU: a thread waits for it, then writes and posts
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="hf_lowzero_snapshot", initializer=lower_this_thread
                )  # [Note: background priority] in hf_lowzero/snapshot/priority.py
            self._executor.submit(self._write_and_post, staged, fields, verified, future, True)
        interval = self._agree(self.schedule.proposed_interval())
        changed = self.schedule.settled and interval != self.schedule.interval
        if changed and self.schedule.auto and self.schedule.cost_s:
            self._say_interval(interval, step)
        self.schedule.taken(step, interval)
        stopped = time.perf_counter() - start
        self.stopped_s += stopped
        self.snapshots_taken += 1
        self._in_flight.append(_InFlight(step, future, stopped, check_s))
        if not self._announced:
            self._announce(staged)

    def _decide(self, step: int) -> None:
        """Auto: wait for the probe snapshot to land, then agree on the interval ([Note: auto interval])."""
        start = time.perf_counter()
        self.wait()
        self._collect_finished()
        interval = self._agree(self.schedule.proposed_interval())
        self.schedule.decided(interval)
        self.stopped_s += time.perf_counter() - start
        if self.schedule.cost_s is not None:
            self._say_interval(interval, self.schedule.probe_step + interval)

    def _say_interval(self, interval: int, from_step: int) -> None:
        """Rank 0's console line for auto's interval and the cost it was measured from."""
        if self.rank == 0:
            logger.info(
                "[hf_lowzero] memory snapshots every %d steps from step %d: one costs %.1f ms of %.1f ms steps",
                interval, from_step, 1e3 * self.schedule.cost_s, 1e3 * self.schedule.step_s,
            )  # fmt: skip

    def _agree(self, interval: int) -> int:
        """The largest rank's interval (fixed intervals need no agreement)."""
        if not self.schedule.auto or self.world_size == 1:
            return interval
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        value = torch.tensor([interval], dtype=torch.int64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def _write_and_post(
        self, staged: Staged, fields: dict, verified: bool | None, future: Future, in_background: bool = False
    ) -> None:
        """Write the piece into this node's memory, then post one request to this node's holder,
        which keeps it, copies it to the buddy node and marks it ([Note: one request per snapshot]
        in ``holder.py``); ``verified``: the step passed its integrity checks (None: the run does not
        check). Its answer completes ``future`` (``_read_answers``); a failure here completes it
        now: the snapshot is lost, not the run.
        """
        start = time.perf_counter()
        step = staged.step
        path = piece_path(self._folder, step, self.rank)
        try:
            manifest = staged.write(path, spares=self._folder, **fields)  # [Note: spare files] in segments.py
        except Exception as e:
            future.set_exception(e)
            return
        write_s = time.perf_counter() - start
        torn = self.fault is not None and self.fault[0] == step  # tests: landed on both nodes, never marked
        request = LandRequest(manifest.frame, str(path), self._buddy_node, tuple(self.nodes), verified, mark=not torn)
        with self._post_lock:
            try:
                self._own_link().post(request.wire())
            except (OSError, ray.exceptions.RayError) as e:
                error = SnapshotError(f"this node's snapshot holder cannot be reached ({e})")
                self._lost_link(error)
                future.set_exception(error)
                return
            self._posted.append(_Posted(future, write_s, in_background, torn))
        if torn:
            self._read_answers(wait=True)  # dies as soon as the piece landed

    def _read_answers(self, wait: bool) -> None:
        """Complete the posted snapshots whose answers came (``wait``: all of them, waiting)."""
        while True:
            with self._post_lock:
                if not self._posted:
                    return
                try:
                    answer = self._link.answer(wait=wait)
                except OSError as e:
                    self._lost_link(SnapshotError(f"this node's snapshot holder cannot be reached ({e})"))
                    return
                if answer is None:
                    return
                posted = self._posted.popleft()
            self._landed(posted, Landed.from_wire(answer))

    def _landed(self, posted: _Posted, landed: Landed) -> None:
        """Complete a posted snapshot with its holder's answer: where its time went, in seconds:
        ``write_s`` (checksums and the file), ``send_s`` (the holder's copy to the buddy node),
        ``mark_s`` (the marks), and ``chain_s``, the work that ran beside training (the holder's,
        and the write when the background thread did it).
        """
        if landed.error is not None:
            posted.future.set_exception(SnapshotError(f"the piece of rank {self.rank} did not land: {landed.error}"))
            return
        if posted.torn:
            self.fault[1]()
        background = landed.send_s + landed.mark_s + (posted.write_s if posted.in_background else 0.0)
        posted.future.set_result(
            {"write_s": posted.write_s, "send_s": landed.send_s, "mark_s": landed.mark_s, "chain_s": background}
        )

    def _lost_link(self, error: SnapshotError) -> None:
        """The connection to this node's holder broke: every posted snapshot fails with ``error``,
        and the next one asks the holder where it listens again (``_post_lock`` held).
        """
        while self._posted:
            self._posted.popleft().future.set_exception(error)
        if self._link is not None:
            self._link.close()
        self._link = None

    def _own_link(self) -> Link:
        """The standing connection to this node's holder (``_post_lock`` held)."""
        if self._link is None or self._link.broken:
            address = tuple(ray.get(self._own.address.remote(), timeout=60))
            self._link = Link(address, timeout_s=3 * TIMEOUT_S)  # the holder's own waits come first
        return self._link

    def _announce(self, staged: Staged) -> None:
        """Rank 0's console line: the interval and what snapshots cost in memory per node."""
        self._announced = True
        if self.rank != 0:
            return
        shard = sum(t.numel() * t.element_size() for t in staged.shard.values())
        per_node = max(self.nodes.count(n) for n in set(self.nodes))
        kept = 2 if self.one_node else 4  # (own [+ buddy's]) x (newest complete + one in progress)
        every = f"every {self.schedule.every} steps"
        if self.schedule.auto:
            at_least = f", at least every {self.schedule.cap} steps" if self.schedule.cap < MAX_INTERVAL else ""
            every = f"auto (within {AUTO_OVERHEAD:.0%}{at_least})"
        staging = (  # [Note: written from the live shard] in hf_lowzero/snapshot/stager.py
            ", and no staging buffer (each worker writes its piece from the live shard)" if staged.live is not None
            else f" and each worker {2 * shard / MIB:.1f} MiB of staging buffers"
        )  # fmt: skip
        logger.info(
            "[hf_lowzero] memory snapshots %s: %.1f MiB per rank's shard; a node holds up to %.1f MiB "
            "(%d x %d ranks' shards)%s",
            every, shard / MIB, kept * per_node * shard / MIB, kept, per_node, staging,
        )  # fmt: skip
        if self.one_node:
            logger.info(
                "[hf_lowzero] all %d workers share one node: memory snapshots protect against a lost worker "
                "process only; a lost node resumes from storage",
                self.world_size,
            )


# [Note: verified snapshots]
# With ``on_mismatch="rollback"`` only snapshots of steps whose integrity checks passed are restored
# after a failed check ([Note: rollback] in ``integrity.py``), so each snapshot asks for a check of
# its step, and auto counts that check in the snapshot's cost. With ``"raise"`` (the default) a
# failed check stops the run and nothing rolls back: snapshots ask for no check, so that their cost
# is the copy's alone (a check of every step would double a CPU step), and the holders keep only
# the newest complete one.


def _rollback_points(integrity) -> bool:
    """Snapshots must be verified steps ([Note: verified snapshots])."""
    return integrity.enabled and integrity.on_mismatch == "rollback"


def snapshot_takers() -> list[MemorySnapshots]:
    """This process's ``MemorySnapshots`` callbacks (fault injection finds them here)."""
    return list(_TAKERS)
