"""Staged files (``transports.net.mapped_file``): a file that any process still maps is
never written again (retiring it removes it, and the mapping keeps its bytes); one that
no process maps becomes the spare, and the next version is written into its pages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from weightsync.transports.net.mapped_file import fresh_or_spare, map_locked, retire

_READER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from weightsync.transports.net.mapped_file import map_locked
    view = map_locked(Path(sys.argv[1]), int(sys.argv[2]), write=False)[100:200]
    print("mapped", flush=True)
    sys.stdin.readline()  # until the test has retired the file
    print(int(view.sum()), flush=True)
""")


def _staged(folder: Path, name: str, value: int, nbytes: int = 4096) -> Path:
    buffer = fresh_or_spare(folder / "incoming.bin", folder / "spare.bin", nbytes)
    buffer.fill_(value)
    del buffer
    os.replace(folder / "incoming.bin", folder / name)
    return folder / name


def test_a_file_no_one_maps_becomes_the_spare_and_its_pages_are_written_again(tmp_path: Path):
    folder = tmp_path
    path = _staged(folder, "v1.bin", 1)
    inode = os.stat(path).st_ino
    assert retire(path, folder / "spare.bin")
    assert not path.exists()
    again = fresh_or_spare(folder / "incoming.bin", folder / "spare.bin", 4096)
    assert os.stat(folder / "incoming.bin").st_ino == inode  # the same pages
    assert not (folder / "spare.bin").exists()
    again.fill_(2)
    assert int(map_locked(folder / "incoming.bin", 4096, write=False).sum()) == 2 * 4096


def test_a_file_another_process_maps_is_removed_not_reused_and_keeps_its_bytes(tmp_path: Path):
    folder = tmp_path
    path = _staged(folder, "v1.bin", 3)
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(path), "4096"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "mapped"
        assert not retire(path, folder / "spare.bin")  # mapped there: removed, not kept
        assert not path.exists() and not (folder / "spare.bin").exists()
        fresh_or_spare(folder / "incoming.bin", folder / "spare.bin", 4096).fill_(9)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        assert int(reader.stdout.readline()) == 3 * 100  # what it mapped, unchanged
    finally:
        reader.kill()
        reader.wait(10)


def test_a_view_in_this_process_holds_the_file_until_it_is_gone(tmp_path: Path):
    folder = tmp_path
    path = _staged(folder, "v1.bin", 4)
    view = map_locked(path, 4096, write=False)[:10]
    assert not retire(path, folder / "spare.bin")
    assert torch.equal(view, torch.full((10,), 4, dtype=torch.uint8))
    path = _staged(folder, "v2.bin", 5)
    del view
    assert retire(path, folder / "spare.bin")


def test_a_spare_of_another_size_is_dropped_and_a_file_left_by_a_failed_fetch_is_replaced(
        tmp_path: Path):
    folder = tmp_path
    assert retire(_staged(folder, "v1.bin", 1), folder / "spare.bin")
    left = fresh_or_spare(folder / "incoming.bin", folder / "spare.bin", 8192)  # another layout
    assert not (folder / "spare.bin").exists()
    left.fill_(6)  # a fetch that failed, whose bytes a relay may still be serving
    again = fresh_or_spare(folder / "incoming.bin", folder / "spare.bin", 8192)
    again.fill_(7)
    assert int(left.sum()) == 6 * 8192  # replaced, not truncated under it


def test_a_retired_path_is_not_found(tmp_path: Path):
    folder = tmp_path
    path = _staged(folder, "v1.bin", 1)
    assert retire(path, folder / "spare.bin")
    with pytest.raises(FileNotFoundError):
        map_locked(path, 4096, write=False)
