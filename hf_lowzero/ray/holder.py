"""Where memory snapshots live on Ray: one holder actor per node per run, outliving the workers.

Ray Train restarts every worker on any failure, so a snapshot must live in processes that are not
workers. Each node that runs a worker gets a ``SnapshotHolder``: a detached, named actor pinned to
that node (``NodeAffinitySchedulingStrategy``, not soft), keeping pieces as files in the node's
memory (``hf_lowzero/snapshot/segments.py``) that outlive any worker. What a killed node held is
gone with it, as on a real cluster. Holders are named after the run
(``<run_id>:<node_id>`` in the ``hf_lowzero_snapshots`` namespace), so two runs, e.g. the trials of a
Tune sweep, never see each other's pieces.

Its lifetime (names, finding a run's holders, ending them) is ``holder_lifetime.py``.

Example (inside a Ray Train worker)::

    holder = holder_for(run, node_id)                                  # get or create
    link = Link(ray.get(holder.address.remote()))                      # once
    manifest = write_piece(shard, extras, path, step=15, rank=1, ...)  # the rank writes its piece in memory
    link.request(LandRequest(manifest.frame, str(path), buddy_node, nodes).wire())   # -> Landed.wire()

# [Note: one request per snapshot]
# A snapshot costs a rank one request, on a connection to its own node's holder that stays open
# for the run ([Note: piece transfer] in ``hf_lowzero/snapshot/transfer.py``): ``land`` (a
# ``LandRequest``), with the path of the file it wrote its piece into. The holder checks the
# piece's frame and the file's length ([Note: complete snapshot] in ``hf_lowzero/snapshot/protocol.py``),
# keeps the file (a reference: no copy), sends the file to the buddy node's holder on its
# connection to it (the kernels copy it once on each node), which marks the step as the copy lands
# (both pieces are whole then: the mark rides on the copy's request), and then marks the step here
# and on every other holder of the run (none when the run has two nodes). Nothing of it
# is a Ray call: a Ray call costs milliseconds of CPU on each side, on the cores that train; Ray
# only tells a holder where the others listen (``address``), once. A holder's marks for other
# holders are batched: the ranks of a node that land together are marked with one request per
# holder, sent to all of them before any answer is read. ``land`` is answered when the marks are
# delivered, so the rank knows that its piece is complete, or what went wrong: it posts the request
# and reads the answer at a later stop ([Note: posted requests] in ``transfer.py``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hf_lowzero.checkpoint.atomic import atomic_write
from hf_lowzero.ray.holder_lifetime import NAMESPACE, RunIdentity, actor_alive, sweep_left_over_runs
from hf_lowzero.snapshot import segments
from hf_lowzero.snapshot.checks import payload_error, piece_length_error
from hf_lowzero.snapshot.frame import Frame, Manifest, read_manifest
from hf_lowzero.snapshot.held import HeldSnapshots
from hf_lowzero.snapshot.priority import lower_this_process
from hf_lowzero.snapshot.protocol import HolderIndex, Landed, LandRequest, MarkRequest
from hf_lowzero.snapshot.segments import node_folder
from hf_lowzero.snapshot.transfer import Endpoint, Link, ask_all

WATCH_INTERVAL_S = 1.0


@ray.remote(num_cpus=0, max_concurrency=8)
class SnapshotHolder:
    """A node's memory snapshots of one run (``HeldSnapshots``): pieces by step and rank, each a
    file in the node's memory ([Note: snapshot folder] in ``hf_lowzero/snapshot/segments.py``), and
    the ranks' marks.
    """

    def __init__(
        self, node_id: str, controller_id: str | None, run_id: str = "", watch_interval_s: float = WATCH_INTERVAL_S
    ) -> None:
        lower_this_process()  # [Note: background priority] in hf_lowzero/snapshot/priority.py
        self.node_id = node_id
        self.run_id = run_id or "unnamed"
        self.folder = node_folder(self.run_id, node_id)
        self._held = HeldSnapshots(node_id, self.folder)
        self._to_mark: queue.Queue[_Mark] = queue.Queue()
        self._handles: dict[str, Any] = {}  # node -> that node's holder of the run
        self._addresses: dict[str, tuple[str, int, str]] = {}  # node -> its holder's endpoint
        self._links: dict[tuple[str, str], Link] = {}  # (node, "pieces" or "marks") -> a link to its holder
        self._links_lock = threading.Lock()
        self._endpoint = Endpoint(
            ray.util.get_node_ip_address(),
            {"land": self._land_request, "mark": self._mark_request},
            self._destination,
            self._landed_copy,
            spares=self.folder,
        )
        threading.Thread(target=self._deliver_marks, daemon=True).start()
        threading.Thread(target=sweep_left_over_runs, daemon=True).start()  # [Note: snapshot folder]
        if controller_id is not None:
            threading.Thread(target=self._watch, args=(controller_id, watch_interval_s), daemon=True).start()

    def _land_request(self, wire: dict[str, Any]) -> dict[str, Any]:
        """A rank's one request per snapshot ([Note: one request per snapshot]), a ``LandRequest``
        on the wire; answers a ``Landed``.
        """
        start = time.perf_counter()
        try:
            path = segments.confined(self.folder, wire.get("path"))  # [Note: snapshot folder]
        except ValueError as e:  # refused: nothing outside this holder's folder is touched
            return Landed(str(e)).wire()
        try:
            request = replace(LandRequest.from_wire(wire), path=path)
        except ValueError as e:  # not a piece of ours (its format or version): its file is not kept
            segments.unlink(path)
            return Landed(str(e)).wire()
        error = piece_length_error(request.frame, request.path)  # [Note: complete snapshot] in protocol.py
        if error is None and self._held.keep(request.frame, request.path) and request.buddy is not None:
            then = request.marks() if request.mark else None  # the buddy marks it as the copy lands: both are whole
            error = self._send_copy(request.buddy, request.frame, request.path, then)
        sent = time.perf_counter()
        if error is not None:
            segments.unlink(request.path)
        elif request.mark:
            nodes = tuple(n for n in dict.fromkeys(request.nodes) if n != request.buddy)  # the buddy marked
            if all(n == self.node_id for n in nodes):  # no other holder to tell: no thread to wake
                self._held.mark(request.marks())
            else:
                mark = _Mark(request.marks(), nodes)
                self._to_mark.put(mark)
                mark.done.wait()
                error = mark.error
        return Landed(error, sent - start, time.perf_counter() - sent).wire()

    def _send_copy(self, node: str, frame: Frame, path: str, then: MarkRequest | None = None) -> str | None:
        """Send the piece in ``path`` to ``node``'s holder, with ``then`` (its marks, or None);
        returns what went wrong, or None.
        """
        try:
            link = self._link(node, "pieces")
        except (ValueError, OSError, ray.exceptions.RayError) as e:
            self._forget(node)
            return f"the buddy node's holder is gone or cannot be reached ({e})"
        try:
            marks = then.wire() if then is not None else None
            return link.send_piece(frame.wire(), path, marks)  # [Note: piece transfer]
        except OSError as e:
            self._forget(node)
            return (
                f"the buddy node's holder at {link.address[0]}:{link.address[1]} cannot be reached ({e}): it is "
                "gone, or the network between the nodes does not let this TCP port through (the ports Ray's "
                "workers use must be open between nodes)"
            )

    def address(self) -> tuple[str, int, str]:
        """Where another node's holder sends this holder a piece ([Note: piece transfer])."""
        return self._endpoint.address

    def put(self, frame: Frame, payload: bytes | memoryview) -> str | None:
        """Keep a piece given as its bytes after checking its structure; returns what is wrong with
        it, or None when it landed (pieces from other nodes come through ``address()`` instead).
        """
        error = payload_error(frame, payload, checksums=False)
        if error is not None:
            return error
        path = segments.piece_path(self.folder, frame.step, frame.rank, copy=True)
        atomic_write(path, lambda f: Path(f).write_bytes(memoryview(payload)))
        self._held.keep(frame, str(path))
        return None

    def _destination(self, wire: dict[str, Any], size: int) -> Path:
        """Where a piece sent by another node's holder goes (ValueError: refused)."""
        frame = Frame.from_wire(wire)
        error = frame.size_error(size)
        if error is not None:
            raise ValueError(error)
        return segments.piece_path(self.folder, frame.step, frame.rank, copy=True)

    def _landed_copy(self, wire: dict[str, Any], path: Path) -> str | None:
        """A piece from another node's holder is whole in ``path`` (the length its frame says,
        checked by ``_destination``): keep it ([Note: complete snapshot] in ``protocol.py``).
        """
        self._held.keep(Frame.from_wire(wire), str(path))
        return None

    def _handle(self, node: str):
        """The run's holder on ``node`` (looked up once; ValueError: there is none)."""
        if node not in self._handles:
            self._handles[node] = ray.get_actor(f"{self.run_id}:{node}", namespace=NAMESPACE)
        return self._handles[node]

    def _address(self, node: str) -> tuple[str, int, str]:
        if node not in self._addresses:
            self._addresses[node] = tuple(ray.get(self._handle(node).address.remote(), timeout=60))
        return self._addresses[node]

    def _link(self, node: str, purpose: str) -> Link:
        """The standing connection to ``node``'s holder for ``purpose`` ("pieces" or "marks"), opened
        on first use and after it broke.
        """
        with self._links_lock:
            link = self._links.get((node, purpose))
            if link is None or link.broken:
                link = self._links[(node, purpose)] = Link(self._address(node))
            return link

    def _forget(self, node: str) -> None:
        """``node``'s holder failed us: look it up again next time."""
        self._handles.pop(node, None)
        self._addresses.pop(node, None)
        with self._links_lock:
            for purpose in ("pieces", "marks"):
                link = self._links.pop((node, purpose), None)
                if link is not None:
                    link.close()

    def mark(self, step: int, rank: int, world_size: int, verified: bool | None = None) -> None:
        """Rank ``rank``'s pieces of ``step`` landed on its node and its buddy's ([Note: complete
        snapshot] in ``protocol.py``); ``verified``: the step passed its integrity checks (None: the
        run checks none).
        """
        self._held.mark(MarkRequest(step, (rank,), world_size, verified))

    def _mark_request(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Another holder's batch of marks, a ``MarkRequest`` on the wire ([Note: one request per snapshot])."""
        self._held.mark(MarkRequest.from_wire(wire))
        return {"error": None}

    def index(self) -> HolderIndex:
        """What this holder knows: per step, its marks and the pieces it holds; the bytes it holds."""
        return self._held.index()

    def manifest(self, step: int, rank: int) -> Manifest:
        """The whole manifest of rank ``rank``'s piece of ``step``, its details read from the piece
        ([Note: details in the file] in ``frame.py``; KeyError when not held, ValueError when the
        details do not match their checksum).
        """
        piece = self._held.piece(step, rank)
        return read_manifest(piece.frame, piece.path)

    def part(self, step: int, rank: int, name: str) -> bytes:
        """One part (``"shard"`` or ``"extras"``) of a piece's payload."""
        piece = self._held.piece(step, rank)
        start, end = piece.frame.parts[name]
        return segments.read_range(piece.path, start, end)

    def close(self) -> None:
        """Free every piece (their files) now; the run is over."""
        self._held.clear()
        self._endpoint.close()
        with self._links_lock:
            for link in self._links.values():
                link.close()
            self._links = {}
        segments.remove_run_folder(self.run_id)

    def _deliver_marks(self) -> None:
        # [Note: one request per snapshot]
        while True:
            batch = [self._to_mark.get()]
            while not self._to_mark.empty():
                batch.append(self._to_mark.get_nowait())
            groups: dict[tuple, list[_Mark]] = {}
            for m in batch:
                groups.setdefault((m.marks.step, m.marks.world_size, m.marks.verified, m.nodes), []).append(m)
            for (step, world_size, verified, nodes), marks in groups.items():
                ranks = tuple(sorted(rank for m in marks for rank in m.marks.ranks))
                others = [n for n in nodes if n != self.node_id]
                error = self._mark_everywhere(others, MarkRequest(step, ranks, world_size, verified))
                for m in marks:
                    m.error = error
                    m.done.set()

    def _mark_everywhere(self, others: list[str], marks: MarkRequest) -> str | None:
        """Record ``marks`` here and on the holders of ``others``; what went wrong, or None."""
        self._held.mark(marks)
        failed = []
        try:
            links = [self._link(n, "marks") for n in others]
        except (ValueError, OSError, ray.exceptions.RayError) as e:
            failed, links = [(n, repr(e)) for n in others], []
        for node, answer in zip(others, ask_all(links, marks.wire())):
            error = str(answer) if isinstance(answer, OSError) else answer.get("error")
            if error is not None:
                failed.append((node, error))
        for node, _ in failed:
            self._forget(node)
        if not failed:
            return None
        return f"a holder of the run is gone, step {marks.step} is not marked everywhere ({failed[0][1]})"

    def _watch(self, controller_id: str, interval_s: float) -> None:
        # [Note: holder lifetime] in holder_lifetime.py
        misses = 0
        while misses < 3:  # three checks in a row: a GCS that did not answer once is not a dead run
            time.sleep(interval_s)
            misses = 0 if actor_alive(controller_id) else misses + 1
        self.close()
        os._exit(0)


@dataclass
class _Mark:
    """A rank's marks, waiting for the thread that delivers them to the run's other holders
    ([Note: one request per snapshot]), and what went wrong once it did."""

    marks: MarkRequest
    nodes: tuple[str, ...]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


def holder_for(run: RunIdentity, node_id: str):
    """The run's holder on node ``node_id``, created there if it does not exist yet."""
    return SnapshotHolder.options(
        name=run.holder_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, run.controller_id, run.run_id)
