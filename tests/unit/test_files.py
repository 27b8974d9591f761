"""host/files: the one atomic writer and the one name-to-file-name function."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.host.files import file_stem, write_atomic


def test_file_stem_is_safe_and_distinct() -> None:
    assert file_stem("web-1") == "web-1"
    assert file_stem("a b/c") == "a%20b%2Fc"
    assert file_stem(".x") == "%2Ex"
    assert file_stem("ü") == "%C3%BC"
    assert file_stem("a%20b") != file_stem("a b")
    assert file_stem("a b") != file_stem("a_b")
    assert file_stem("/etc/vmcache/vmcache.yaml") == "%2Fetc%2Fvmcache%2Fvmcache.yaml"
    long = file_stem("x" * 1000)
    assert len(long) <= 200 and long != file_stem("x" * 999)
    for name in ["..", ".", "a/../b", "\n", ""]:
        assert "/" not in file_stem(name) and file_stem(name) not in ("", ".", "..")


def test_write_atomic_replaces_without_partial_reads(tmp_path: Path) -> None:
    target = tmp_path / "vda.png"
    payloads = [bytes([i]) * (1 << 20) for i in range(2)]
    write_atomic(target, payloads[0])
    stop, bad = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            content = target.read_bytes()
            if content not in payloads:
                bad.append(len(content))

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(100):
        write_atomic(target, payloads[i % 2])
    stop.set()
    reader.join()
    assert bad == []
    assert [p.name for p in tmp_path.iterdir()] == ["vda.png"]


def test_mode_whatever_the_umask_and_directories_on_request(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        target = tmp_path / "a" / "b" / "targets.json"
        write_atomic(target, "text\n", make_dirs=True, fsync=False)
    finally:
        os.umask(old)
    assert target.read_text() == "text\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_failure_is_a_host_error_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(HostError, match="cannot write ledger"):
        write_atomic(tmp_path / "missing" / "x.json", b"{}", what="ledger")
    (tmp_path / "dir").mkdir()
    with pytest.raises(HostError):
        write_atomic(tmp_path / "dir", b"{}")  # a directory cannot be replaced by a file
    assert [p.name for p in tmp_path.iterdir()] == ["dir"]


def test_try_lock_takes_a_free_lock_and_names_the_holder_of_a_taken_one(tmp_path):
    from vmcache.host.files import try_lock

    path = str(tmp_path / "x.lock")
    fd, _ = try_lock(path, b"first\n")
    assert fd is not None
    assert try_lock(path, b"second\n") == (None, b"first\n")
    os.unlink(path)  # the holder's release: unlinked while held, then closed
    os.close(fd)
    again, _ = try_lock(path, b"third\n")
    assert again is not None and Path(path).read_bytes() == b"third\n"
    os.close(again)
