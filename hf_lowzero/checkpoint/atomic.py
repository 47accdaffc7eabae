"""Files that readers never see half written, and renames that survive a power loss: a checkpoint's
files (``save.py``), a snapshot's shared files, a holder's records. No torch: a snapshot holder
(a Ray actor per node) writes with these.

Example::

    atomic_write(folder / "zero_meta.json", lambda tmp: Path(tmp).write_text(text))
    replace_synced(partial_folder, final_folder)
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(target: Path, write) -> None:
    """``write(tmp_path)``, fsync, then rename over ``target``: readers never see half a file. The
    temporary name is this process's own, so processes writing the same file (the ranks of one node
    writing a snapshot's shared files) never write into each other's.

    Args:
        target: The file to write.
        write (Callable[[str], Any]): Called with the temporary file's path (a ``str``); writes the whole file there.
    """
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    write(str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    replace_synced(tmp, target)


def replace_synced(source: Path, target: Path) -> None:
    """``os.replace(source, target)``, then fsync the folder holding ``target``: a rename is durable only
    once its folder's entry is on disk (after a power loss the folder could show the old name otherwise).

    Args:
        source: The file or folder to rename.
        target: Its new name, in the same filesystem (replaced if it exists; a folder must be empty).
    """
    os.replace(source, target)
    fd = os.open(Path(target).parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
