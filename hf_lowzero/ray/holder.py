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
    manifest = write_piece(shard, extras, fields, path)                # the rank writes its piece in memory
    link.request({"op": "land", "manifest": frame_of(manifest), "path": str(path), "buddy": buddy_node, "nodes": nodes})

# [Note: one request per snapshot]
# A snapshot costs a rank one request, on a connection to its own node's holder that stays open
# for the run ([Note: piece transfer] in ``hf_lowzero/snapshot/transfer.py``): ``land``, with the
# path of the file it wrote its piece into. The holder checks the piece's frame and the file's
# length ([Note: complete snapshot]), keeps the file (a reference: no copy), sends the file to the
# buddy node's holder on its connection to it (the kernels copy it once on each node), which marks
# the step as the copy lands (both pieces are whole then: the mark rides on the copy's request),
# and then marks the step here and on every other holder of the run (none when the run has two
# nodes). Nothing of it
# is a Ray call: a Ray call costs milliseconds of CPU on each side, on the cores that train; Ray
# only tells a holder where the others listen (``address``), once. A holder's marks for other
# holders are batched: the ranks of a node that land together are marked with one request per
# holder, sent to all of them before any answer is read. ``land`` is answered when the marks are
# delivered, so the rank knows that its piece is complete, or what went wrong: it posts the request
# and reads the answer at a later stop ([Note: posted requests] in ``transfer.py``).

# [Note: complete snapshot]
# Rank r's step S is marked on every holder of the run only after both its pieces (own node, buddy
# node) landed whole: the rank wrote its file before it asked (a rank that dies while writing asks
# nothing), the own holder checked the frame (format, version) and the file's length, and the
# buddy received exactly that many bytes. S is complete when every rank of S marked it; only a
# complete snapshot is ever restored, so a failure while a snapshot is being taken (a torn
# snapshot) resumes the previous one. The rest is checked when a restore fetches the pieces, before
# any is used: every part's header, every tensor's extent and every chunk's checksum, once per
# restore instead of once per snapshot on holders whose CPU training needs (reading the headers as
# each piece landed, on both nodes, was a sixth of the holders' CPU per snapshot for the main job),
# and a piece that fails sends every rank to storage together (``restore.py``), never into a
# restart loop. A holder keeps the newest
# complete snapshot and anything newer in progress, and drops the rest as soon as a newer one completes.
# When the run checks its integrity, each mark says whether the step passed its checks; only those
# snapshots are rollback points ([Note: rollback] in ``integrity.py``), so the newest complete one
# that passed is kept until a newer one that passed completes.

"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hf_lowzero.checkpoint.shards import atomic_write
from hf_lowzero.ray.holder_lifetime import NAMESPACE, RunIdentity, actor_alive, sweep_left_over_runs
from hf_lowzero.snapshot import segments
from hf_lowzero.snapshot.checks import payload_error, piece_length_error
from hf_lowzero.snapshot.format import frame_of, manifest_error, read_manifest
from hf_lowzero.snapshot.priority import lower_this_process
from hf_lowzero.snapshot.segments import node_folder
from hf_lowzero.snapshot.transfer import Endpoint, Link, ask_all

WATCH_INTERVAL_S = 1.0


@ray.remote(num_cpus=0, max_concurrency=8)
class SnapshotHolder:
    """A node's memory snapshots of one run: pieces by (step, rank), each a file in the node's
    memory ([Note: snapshot folder] in ``hf_lowzero/snapshot/segments.py``), and the ranks' marks.
    """

    def __init__(
        self, node_id: str, controller_id: str | None, run_id: str = "", watch_interval_s: float = WATCH_INTERVAL_S
    ) -> None:
        lower_this_process()  # [Note: background priority] in hf_lowzero/snapshot/priority.py
        self.node_id = node_id
        self.run_id = run_id or "unnamed"
        self.folder = node_folder(self.run_id, node_id)
        self._lock = threading.Lock()
        self._pieces: dict[tuple[int, int], tuple[dict[str, Any], str]] = {}  # (step, rank) -> (frame, file)
        self._marks: dict[int, set[int]] = {}
        self._worlds: dict[int, int] = {}
        self._verified: dict[int, bool | None] = {}
        self._complete: int | None = None
        self._kept: int | None = None  # the oldest step held on purpose: the newest complete one that may be restored
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

    def _land_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """A rank's one request per snapshot ([Note: one request per snapshot]): ``manifest`` (the
        piece's frame: [Note: details in the file] in ``format.py``) and ``path`` (the file the rank
        wrote its piece into, on this node), ``buddy`` (the node that keeps a copy, or None),
        ``nodes`` (the run's nodes, whose holders mark the step), ``verified`` (the step passed its
        integrity checks; None: not checked) and ``mark`` (False: land only, never mark; the tests'
        torn snapshot). Answers ``error`` (what went wrong, or
        None) and where the time went: ``send_s`` (the copy to the buddy node) and ``mark_s``.
        """
        manifest, path, buddy_node = request["manifest"], request["path"], request.get("buddy")
        marks, verified = request.get("mark", True), request.get("verified")
        start = time.perf_counter()
        error = piece_length_error(manifest, path)  # [Note: complete snapshot]
        if error is None and self._keep(manifest, path) and buddy_node is not None:
            then = None
            if marks:  # the buddy marks the step as the copy lands: both pieces are whole then
                then = {"op": "mark", "step": manifest["step"], "ranks": [manifest["rank"]],
                        "world_size": manifest["world_size"], "verified": verified}  # fmt: skip
            error = self._send_copy(buddy_node, manifest, path, then)
        sent = time.perf_counter()
        if error is not None:
            segments.unlink(path)
        elif marks:
            nodes = tuple(n for n in dict.fromkeys(request["nodes"]) if n != buddy_node)  # the buddy marked
            if all(n == self.node_id for n in nodes):  # no other holder to tell: no thread to wake
                self._mark_many(manifest["step"], [manifest["rank"]], manifest["world_size"], verified)
            else:
                mark = _Mark(manifest["step"], manifest["rank"], manifest["world_size"], verified, nodes)
                self._to_mark.put(mark)
                mark.done.wait()
                error = mark.error
        return {"error": error, "send_s": sent - start, "mark_s": time.perf_counter() - sent}

    def _send_copy(
        self, node: str, manifest: dict[str, Any], path: str, then: dict[str, Any] | None = None
    ) -> str | None:
        """Send the piece in ``path`` to ``node``'s holder, with ``then`` (its marks, or None);
        returns what went wrong, or None.
        """
        try:
            link = self._link(node, "pieces")
        except (ValueError, OSError, ray.exceptions.RayError) as e:
            self._forget(node)
            return f"the buddy node's holder is gone or cannot be reached ({e})"
        try:
            return link.send_piece(manifest, path, then)  # [Note: piece transfer]
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

    def put(self, manifest_json: str, payload: bytes | memoryview) -> str | None:
        """Keep a piece given as its bytes after checking its structure; returns what is wrong with
        it, or None when it landed (pieces from other nodes come through ``address()`` instead).
        """
        manifest = json.loads(manifest_json)
        error = payload_error(manifest, payload, checksums=False)
        if error is not None:
            return error
        path = segments.piece_path(self.folder, manifest["step"], manifest["rank"], copy=True)
        atomic_write(path, lambda f: Path(f).write_bytes(memoryview(payload)))
        self._keep(frame_of(manifest), str(path))
        return None

    def _destination(self, manifest: dict[str, Any], size: int) -> Path:
        """Where a piece sent by another node's holder goes (ValueError: refused)."""
        try:
            error, step, rank = manifest_error(manifest, size), int(manifest["step"]), int(manifest["rank"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not an hf_lowzero snapshot piece ({e!r})") from e
        if error is not None:
            raise ValueError(error)
        return segments.piece_path(self.folder, step, rank, copy=True)

    def _landed_copy(self, manifest: dict[str, Any], path: Path) -> str | None:
        """A piece from another node's holder is whole in ``path`` (the length its frame says,
        checked by ``_destination``): keep it ([Note: complete snapshot]).
        """
        self._keep(manifest, str(path))
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
        snapshot]); ``verified``: the step passed its integrity checks (None: the run checks none).
        """
        self._mark_many(step, [rank], world_size, verified)

    def _mark_request(self, request: dict[str, Any]) -> dict[str, Any]:
        """Another holder's batch of marks ([Note: one request per snapshot])."""
        self._mark_many(int(request["step"]), list(request["ranks"]), int(request["world_size"]), request["verified"])
        return {"error": None}

    def _mark_many(self, step: int, ranks: list[int], world_size: int, verified: bool | None = None) -> None:
        """``mark`` for several ranks at once (a node's holder batches its ranks' marks)."""
        dropped, held = [], Counter()
        with self._lock:
            self._marks.setdefault(step, set()).update(ranks)
            self._worlds[step] = world_size
            self._verified[step] = verified
            if len(self._marks[step]) == world_size and (self._complete is None or step > self._complete):
                self._complete = step
                if verified is not False:  # a rollback point: older snapshots are no longer needed
                    self._kept = step
                keep = self._kept if self._kept is not None else step
                dropped = [(path, _size(m)) for key, (m, path) in self._pieces.items() if key[0] < keep]
                self._pieces = {key: v for key, v in self._pieces.items() if key[0] >= keep}
                held = Counter(_size(m) for m, _ in self._pieces.values())
                self._marks = {s: m for s, m in self._marks.items() if s >= keep}
                self._worlds = {s: w for s, w in self._worlds.items() if s >= keep}
                self._verified = {s: v for s, v in self._verified.items() if s >= keep}
        for path, size in dropped:  # [Note: spare files] in segments.py: as many as the pieces of a size held
            segments.recycle(path, keep_at_most=held[size])
        if dropped:
            segments.drop_spares(self.folder, set(held))

    def index(self) -> dict[str, Any]:
        """What this holder knows: per step, the world size, the ranks that marked it, the ranks
        whose pieces it holds, and whether the step passed its integrity checks (None: not checked);
        and the bytes it holds.
        """
        with self._lock:
            steps = set(self._marks) | {step for step, _ in self._pieces}
            return {
                "node_id": self.node_id,
                "bytes": sum(_size(manifest) for manifest, _ in self._pieces.values()),
                "steps": {
                    step: {
                        "world_size": self._worlds.get(step),
                        "marked": sorted(self._marks.get(step, ())),
                        "pieces": sorted(rank for s, rank in self._pieces if s == step),
                        "verified": self._verified.get(step),
                    }
                    for step in steps
                },
            }

    def manifest(self, step: int, rank: int) -> dict[str, Any]:
        """The whole manifest of rank ``rank``'s piece of ``step``, its details read from the piece
        ([Note: details in the file] in ``format.py``; KeyError when not held, ValueError when the
        details do not match their checksum).
        """
        with self._lock:
            frame, path = self._pieces[(step, rank)]
        return read_manifest(frame, path)

    def part(self, step: int, rank: int, name: str) -> bytes:
        """One part (``"shard"`` or ``"extras"``) of a piece's payload."""
        with self._lock:
            manifest, path = self._pieces[(step, rank)]
        start, end = manifest["parts"][name]
        return segments.read_range(path, start, end)

    def close(self) -> None:
        """Free every piece (their files) now; the run is over."""
        with self._lock:
            self._pieces = {}
            self._complete = 1 << 62  # nothing lands any more
        self._endpoint.close()
        with self._links_lock:
            for link in self._links.values():
                link.close()
            self._links = {}
        segments.remove_run_folder(self.run_id)

    def _keep(self, manifest: dict[str, Any], path: str) -> bool:
        """Hold the piece in ``path`` (which this holder now owns); False when it is older than the
        newest complete snapshot (its file is removed).
        """
        key = (manifest["step"], manifest["rank"])
        with self._lock:
            if self._complete is not None and key[0] <= self._complete:
                stale, kept = path, False
            else:
                stale = self._pieces[key][1] if key in self._pieces else None  # the same piece again
                self._pieces[key] = (manifest, path)
                kept = True
        if stale is not None and (stale != path or not kept):
            segments.unlink(stale)
        return kept

    def _deliver_marks(self) -> None:
        # [Note: one request per snapshot]
        while True:
            batch = [self._to_mark.get()]
            while not self._to_mark.empty():
                batch.append(self._to_mark.get_nowait())
            groups: dict[tuple, list[_Mark]] = {}
            for m in batch:
                groups.setdefault((m.step, m.world_size, m.verified, m.nodes), []).append(m)
            for (step, world_size, verified, nodes), marks in groups.items():
                others = [n for n in nodes if n != self.node_id]
                error = self._mark_everywhere(others, step, sorted(m.rank for m in marks), world_size, verified)
                for m in marks:
                    m.error = error
                    m.done.set()

    def _mark_everywhere(
        self, others: list[str], step: int, ranks: list[int], world_size: int, verified: bool | None
    ) -> str | None:
        """Mark ``ranks`` at ``step`` here and on the holders of ``others``; what went wrong, or None."""
        self._mark_many(step, ranks, world_size, verified)
        request = {"op": "mark", "step": step, "ranks": ranks, "world_size": world_size, "verified": verified}
        failed = []
        try:
            links = [self._link(n, "marks") for n in others]
        except (ValueError, OSError, ray.exceptions.RayError) as e:
            failed, links = [(n, repr(e)) for n in others], []
        for node, answer in zip(others, ask_all(links, request)):
            error = str(answer) if isinstance(answer, OSError) else answer.get("error")
            if error is not None:
                failed.append((node, error))
        for node, _ in failed:
            self._forget(node)
        if not failed:
            return None
        return f"a holder of the run is gone, step {step} is not marked everywhere ({failed[0][1]})"

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
    step: int
    rank: int
    world_size: int
    verified: bool | None
    nodes: tuple[str, ...]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


def _size(manifest: dict[str, Any]) -> int:
    return max(end for _, end in manifest["parts"].values())


def holder_for(run: RunIdentity, node_id: str):
    """The run's holder on node ``node_id``, created there if it does not exist yet."""
    return SnapshotHolder.options(
        name=run.holder_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, run.controller_id, run.run_id)
