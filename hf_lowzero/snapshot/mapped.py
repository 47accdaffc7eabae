"""Piece files mapped once per writer: the mapping of a file that is written again is kept.

Example::

    files = MappedFiles()
    with files.writing(fd, size) as buffer:                  # the open file, ``size`` bytes, mapped
        buffer[0:8] = header
    files.close()                                            # every kept mapping, unmapped

# [Note: kept mappings]
# Writing into a file in memory through a new mapping costs the kernel one page-table entry per
# 4 KiB page on the way in and their teardown on the way out: for 30 MiB, 2.9 ms with MAP_POPULATE,
# next to 4 ms for the copy itself (``pwrite`` pays the same per page inside the call: 9 ms). The
# files are written over and over: a piece's file becomes a spare when the piece is no longer kept,
# and the next piece of its size takes it ([Note: spare files] in ``segments.py``). So a writer (a
# rank's background thread, a holder receiving a buddy node's piece) keeps the mapping of each file
# it wrote, by inode, with the file open, and maps a taken spare only if it never mapped that file.
# A mapping would keep a file's pages in memory once the file is removed, so a piece's file is
# emptied before it is removed (``segments.unlink``: the pages go at once, whoever maps them), each
# ``writing`` first drops the mappings of files that no longer have a name, and at most
# ``max_kept`` are kept, the least recently used going first. A kept mapping is only written
# through right after its file was sized again to the mapping's size.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: map a piece's pages in one call
MAX_KEPT = 6  # a rank's own pieces and spares, and its buddy's copies: about as many as a holder keeps


@dataclass
class _Kept:
    fd: int
    size: int
    buffer: mmap.mmap


class MappedFiles:
    """The writable mappings of the files one writer wrote, kept for the next write ([Note: kept
    mappings]). Thread-safe; each file is written by one thread at a time (whoever took it): a
    mapping in use is out of the kept ones until its write ends.

    Args:
        max_kept: At most this many mappings are kept between writes.
    """

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._kept: OrderedDict[tuple[int, int], _Kept] = OrderedDict()  # (device, inode) -> mapping
        self._lock = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def writing(self, fd: int, size: int) -> Iterator[mmap.mmap]:
        """The open file ``fd``, resized to ``size`` bytes, mapped for writing; the mapping (with a
        descriptor of its own) is kept for the file's next write."""
        info = os.fstat(fd)
        if info.st_size != size:
            os.ftruncate(fd, size)
        key = (info.st_dev, info.st_ino)
        with self._lock:
            self._drop_unnamed()
            kept = self._kept.pop(key, None)
        if kept is not None and kept.size != size:
            _unmap(kept)
            kept = None
        if kept is None:
            own = os.dup(fd)
            try:
                kept = _Kept(own, size, mmap.mmap(own, size, flags=MAP_FLAGS))
            except BaseException:
                os.close(own)
                raise
        try:
            yield kept.buffer
        finally:
            with self._lock:
                if self._closed:
                    _unmap(kept)
                else:
                    self._kept[key] = kept  # the most recently used
                    self._trim()

    def close(self) -> None:
        """Unmap every kept mapping (one in use goes when its write ends); nothing is kept any more."""
        with self._lock:
            self._closed = True
            while self._kept:
                _unmap(self._kept.popitem()[1])

    def __len__(self) -> int:
        return len(self._kept)

    def _drop_unnamed(self) -> None:
        for key in [k for k, kept in self._kept.items() if os.fstat(kept.fd).st_nlink == 0]:
            _unmap(self._kept.pop(key))

    def _trim(self) -> None:
        while len(self._kept) > self.max_kept:
            _unmap(self._kept.popitem(last=False)[1])  # the least recently used


def _unmap(kept: _Kept) -> None:
    kept.buffer.close()
    os.close(kept.fd)
