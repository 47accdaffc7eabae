"""Kept mappings ([Note: kept mappings] in ``hf_lowzero/snapshot/mapped.py``): a file written again
through its kept mapping holds exactly the new bytes, and no mapping outlives its file's name."""

from __future__ import annotations

import os

import pytest

from hf_lowzero.snapshot import segments
from hf_lowzero.snapshot.mapped import MappedFiles
from hf_lowzero.snapshot.segments import recycle, take_spare


def _write(files: MappedFiles, path, data: bytes, create: bool) -> None:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        with files.writing(fd, len(data)) as buffer:
            buffer[:] = data
    finally:
        os.close(fd)


def test_a_spare_written_again_reuses_its_mapping_and_holds_the_new_bytes(tmp_path):
    files = MappedFiles()
    first, second = tmp_path / "step1.piece", tmp_path / "step2.piece"
    _write(files, first, b"a" * 4096 + b"b" * 100, create=True)
    kept = next(iter(files._kept.values())).buffer
    recycle(first, keep_at_most=2)  # its piece is no longer kept: a spare of its size
    assert take_spare(tmp_path, 4196, second)
    _write(files, second, b"c" * 4196, create=False)
    assert len(files) == 1 and next(iter(files._kept.values())).buffer is kept  # the same file, mapped once
    assert second.read_bytes() == b"c" * 4196
    files.close()
    assert len(files) == 0


def test_a_file_that_changed_size_is_mapped_again(tmp_path):
    files = MappedFiles()
    path = tmp_path / "piece"
    _write(files, path, b"x" * 100, create=True)
    _write(files, path, b"y" * 9000, create=False)
    assert path.read_bytes() == b"y" * 9000
    _write(files, path, b"z" * 10, create=False)
    assert path.read_bytes() == b"z" * 10
    assert len(files) == 1
    files.close()


def test_no_mapping_outlives_its_files_name_and_at_most_max_kept_are_kept(tmp_path):
    files = MappedFiles(max_kept=2)
    paths = [tmp_path / f"p{i}" for i in range(4)]
    for path in paths[:3]:
        _write(files, path, b"1" * 10, create=True)
    assert len(files) == 2  # the least recently used went
    kept = list(files._kept.values())
    for path in paths[:3]:
        segments.unlink(path)  # the holder removed them: their pages must not stay mapped
    assert [os.fstat(k.fd).st_size for k in kept] == [0, 0]  # emptied: the pages are freed already
    _write(files, paths[3], b"2" * 10, create=True)
    assert len(files) == 1
    assert sorted(os.fstat(k.fd).st_nlink for k in files._kept.values()) == [1]
    files.close()


def test_a_write_that_fails_keeps_nothing_of_a_removed_file(tmp_path):
    files = MappedFiles()
    path = tmp_path / "piece"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with pytest.raises(RuntimeError), files.writing(fd, 10):
        os.close(fd)
        path.unlink()  # what write_piece does when it fails
        raise RuntimeError("the copy failed")
    _write(files, tmp_path / "next", b"n" * 10, create=True)
    assert len(files) == 1
    files.close()
