"""Where a node's snapshot pieces live: files in memory (``/dev/shm``), one folder per run and node.

A rank writes its piece straight into a file of its node's folder ([Note: one pass over the shard]
in ``file_layout.py``); its node's holder then keeps the file's path, not a copy, and the file outlives
the rank's process (a killed worker loses nothing its holder kept). ``/dev/shm`` is memory: a file
there costs RAM, like the object store that Ray also keeps there, and goes with the node.

Example::

    folder = node_folder("run-1", node_id)            # /dev/shm/hf_lowzero_snapshots/run-1/<node_id>
    path = piece_path(folder, step=15, rank=0)        # written by the rank, kept by the holder
    read_range(path, 0, 8)                            # what a restore fetches

# [Note: snapshot folder]
# The root is ``hf_lowzero_snapshots/`` inside ``$HF_LOWZERO_SNAPSHOT_DIR`` when set (never the
# named folder itself: it may hold the user's files), else inside ``/dev/shm`` when it exists and has
# MIN_SHM_FREE free (containers often mount 64 MiB there; Ray then falls back for its object store
# too), else inside the temp folder (disk-backed files in the page cache: slower under memory
# pressure, still no copy through Ray). The root and each run folder in it carry a marker file
# (ROOT_MARKER, RUN_MARKER) written when they are created. A holder removes each file as soon as the
# piece in it is no longer kept, and the run's folder when the run ends. Holders killed with the
# node's Ray (``ray stop --force``) cannot: a new holder removes the folders of runs that have no
# holder left in its cluster and whose files have not changed for STALE_S (``sweep``). Removal only
# ever takes a folder that carries RUN_MARKER in a root that carries ROOT_MARKER: anything else in
# the root, or beside it, is never touched.

# [Note: spare files]
# A new file in memory costs more than the bytes written into it: the kernel finds, zeroes and maps
# a page for every 4 KiB on first touch, about as much CPU again as the copy. So a file whose piece
# is no longer kept becomes a spare (``spare-<size>-<id>``) and the next piece of that size (the same
# rank's next snapshot, or the next copy from the buddy node) is written over it: its pages are
# already there. A spare is never read. A node keeps at most as many spares of a size as it holds
# pieces of that size, and none of a size it holds no piece of: rank 0's piece grows with the
# trainer state's log, and the spares of its old size, counted against one limit for all sizes,
# had left no room for the sizes still written (each copy then went into a new file: new pages,
# and a new mapping of them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

SHM = Path("/dev/shm")
MIN_SHM_FREE = 1 << 30
ENV = "HF_LOWZERO_SNAPSHOT_DIR"
ROOT_NAME = "hf_lowzero_snapshots"  # the root's name inside the named folder ([Note: snapshot folder])
ROOT_MARKER = ".hf_lowzero_snapshot_root"
RUN_MARKER = ".hf_lowzero_snapshot_run"
STALE_S = 3600.0  # a run folder untouched this long, with no holder in this cluster, is left over


def snapshot_root() -> Path:
    """The folder that holds every run's snapshot folders on this node: always a folder of our own,
    ``hf_lowzero_snapshots`` inside the one ``$HF_LOWZERO_SNAPSHOT_DIR`` names ([Note: snapshot folder]).

    Raises:
        ValueError: ``$HF_LOWZERO_SNAPSHOT_DIR`` is a relative path (each Ray process has its own
            working directory, so the holder and the ranks would not agree on it).
    """
    named = os.environ.get(ENV)
    if named:
        base = Path(named).expanduser()
        if not base.is_absolute():
            raise ValueError(
                f"{ENV}={named!r} is a relative path; expected an absolute folder, the same for every process "
                f"of the run, e.g. {ENV}=/mnt/fast/hf_lowzero"
            )
    elif SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free >= MIN_SHM_FREE:
        base = SHM
    else:
        base = Path(tempfile.gettempdir())
    return base / ROOT_NAME


def node_folder(run_id: str, node_id: str) -> Path:
    """The folder of run ``run_id``'s pieces kept on node ``node_id``, created if missing, in a run
    folder and a root that carry their markers ([Note: snapshot folder])."""
    run = _marked(_marked(snapshot_root(), ROOT_MARKER) / _safe(run_id), RUN_MARKER)
    folder = run / _safe(node_id)
    folder.mkdir(exist_ok=True)
    return folder


def _marked(folder: Path, marker: str) -> Path:
    """``folder``, created if missing, with the file ``marker`` that makes it ours to remove."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError), open(folder / marker, "x") as f:
        f.write("hf_lowzero memory snapshots: removed by hf_lowzero when its run is over\n")
    return folder


def _ours(run_folder: Path) -> bool:
    """``run_folder`` is a run folder hf_lowzero made: a real folder (no link) with RUN_MARKER, in a
    root with ROOT_MARKER ([Note: snapshot folder])."""
    return (
        not run_folder.is_symlink()
        and (run_folder / RUN_MARKER).is_file()
        and (run_folder.parent / ROOT_MARKER).is_file()
    )


def piece_path(folder: Path, step: int, rank: int, copy: bool = False) -> Path:
    """The file of rank ``rank``'s piece of ``step`` in ``folder`` (``copy``: a buddy node's copy)."""
    return folder / f"{'copy-' if copy else ''}step{step:08d}-rank{rank:05d}.piece"


def confined(folder: str | Path, path: object) -> str:
    """``path`` resolved, when it names a file directly in ``folder``: a holder empties, renames and
    removes the files it is sent, so it takes none elsewhere ([Note: snapshot folder]).

    Example::

        path = confined(holder_folder, request["path"])    # ValueError: not a file of this folder

    Raises:
        ValueError: ``path`` is not an absolute path, has a ``..``, is a link, or resolves outside
            ``folder``; the message names it and the folder.
    """
    home = os.path.realpath(folder)
    why = None
    if not isinstance(path, str) or not os.path.isabs(path):
        why = "not an absolute path"
    elif ".." in Path(path).parts:
        why = "it has a '..'"
    elif os.path.islink(path):
        why = "it is a link"
    elif os.path.realpath(path) != os.path.join(home, os.path.basename(path)):
        why = f"it resolves to {os.path.realpath(path)}"
    if why is not None:
        raise ValueError(
            f"this holder takes only files directly in its folder {home}; {path!r} is not one ({why}). "
            "A rank sends the path piece_path(node_folder(run_id, node_id), step, rank) gives"
        )
    return os.path.join(home, os.path.basename(path))


def recycle(path: str | Path, keep_at_most: int) -> None:
    """The piece in ``path`` is no longer kept: keep its file as a spare of its size for the next
    piece ([Note: spare files]), or remove it when its folder already has ``keep_at_most`` spares
    of its size."""
    folder = os.path.dirname(path)
    try:
        size = os.stat(path).st_size
        if size == 0 or len(_spares(folder, f"spare-{size}-")) >= keep_at_most:
            raise FileNotFoundError
        os.rename(path, os.path.join(folder, f"spare-{size}-{uuid.uuid4().hex}"))
    except FileNotFoundError:
        unlink(path)


def drop_spares(folder: str | Path, sizes: set[int]) -> None:
    """Remove the spare files in ``folder`` of sizes other than ``sizes`` ([Note: spare files])."""
    for spare in _spares(folder, "spare-"):
        size = os.path.basename(spare).split("-")[1]
        if not size.isdigit() or int(size) not in sizes:
            unlink(spare)


def take_spare(folder: str | Path, size: int, target: str | Path) -> bool:
    """Move a spare file of ``size`` bytes in ``folder`` to ``target`` (True), or find none (False).
    Another process may take the same spare first: ``rename`` gives it to one of them."""
    for spare in _spares(folder, f"spare-{size}-"):
        try:
            os.rename(spare, target)
            return True
        except FileNotFoundError:
            continue
    return False


def _spares(folder: str | Path, prefix: str) -> list[str]:
    """The paths of the files in ``folder`` whose names start with ``prefix`` (a listing, no
    pattern matching: a snapshot lists its folder several times)."""
    try:
        return [os.path.join(folder, name) for name in os.listdir(folder) if name.startswith(prefix)]
    except FileNotFoundError:
        return []


def read_range(path: str | Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the file ``path``."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise ValueError(f"{path}: {len(data)} bytes at {start}, expected {end - start}")
    return data


def remove_run_folder(run_id: str) -> None:
    """Remove run ``run_id``'s folder on this machine, once the run is over: its node's pieces, and
    on a machine that runs several Ray nodes (a local test cluster) every node's, a killed one's too."""
    folder = snapshot_root() / _safe(run_id)
    if _ours(folder):  # [Note: snapshot folder]: nothing unmarked is ever removed
        shutil.rmtree(folder, ignore_errors=True)


def sweep(live_runs: set[str], older_than_s: float = STALE_S) -> list[Path]:
    """Remove the folders of runs that are over but were not cleaned up (their holders were killed
    with the node's Ray, e.g. ``ray stop --force``): every run folder on this machine whose run is
    not in ``live_runs`` and whose files have not changed for ``older_than_s`` seconds (another Ray
    cluster on the same machine may have a live run here). Returns the folders removed."""
    removed = []
    now = time.time()
    live = {_safe(run) for run in live_runs}
    for folder in run_folders():
        if folder.name in live:
            continue
        try:
            newest = max(p.stat().st_mtime for p in [folder, *folder.iterdir()])
        except OSError:  # removed meanwhile
            continue
        if now - newest >= older_than_s:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def run_folders() -> list[Path]:
    """The runs' folders on this machine, those that carry our marker (a finished run leaves none)."""
    root = snapshot_root()
    return sorted(p for p in root.iterdir() if _ours(p)) if root.is_dir() else []


def unlink(path: str | Path) -> None:
    """Remove the file ``path`` and free its memory now: it is emptied first, because a writer may
    keep a mapping of it ([Note: kept mappings] in ``mapped.py``), which would keep its pages."""
    with contextlib.suppress(FileNotFoundError):
        os.truncate(path, 0)
        os.unlink(path)


def _safe(name: str) -> str:
    """``name`` as one folder name (never the folder above, nor the same one)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    if not safe.strip("."):
        raise ValueError(f"{name!r} cannot name a snapshot folder; expected a run or node id, e.g. 'run-1'")
    return safe
