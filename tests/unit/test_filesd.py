"""Prometheus file_sd targets files: content, atomic replacement, removal."""

from __future__ import annotations

import fnmatch
import json
import threading
from pathlib import Path

import pytest

from vmcache.errors import HostError
from vmcache.host.files import file_stem
from vmcache.observe.filesd import TargetsFile

UUID = "6a1f0c3e-2b4d-4e8f-9a0b-1c2d3e4f5a6b"


def test_written_file_is_a_file_sd_document_with_domain_and_uuid_labels(tmp_path: Path) -> None:
    d = tmp_path / "prometheus"  # created on demand
    path = TargetsFile("web1", UUID, "127.0.0.1:9851", directory=d).write()
    assert path == d / "web1.json"
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9851"], "labels": {"domain": "web1", "uuid": UUID}}
    ]
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_extra_labels_cannot_override_domain_or_uuid(tmp_path: Path) -> None:
    tf = TargetsFile("web1", UUID, "h:1", directory=tmp_path, labels={"domain": "evil", "host": "kvm3"})
    doc = json.loads(tf.write().read_text())
    assert doc[0]["labels"] == {"domain": "web1", "uuid": UUID, "host": "kvm3"}


def test_each_agent_has_its_own_file_and_the_glob_finds_all(tmp_path: Path) -> None:
    a = TargetsFile("web1", UUID, "127.0.0.1:9850", directory=tmp_path).write()
    b = TargetsFile("db.prod", "u2", "127.0.0.1:9851", directory=tmp_path).write()
    found = sorted(p for p in tmp_path.iterdir() if fnmatch.fnmatch(p.name, "*.json"))
    assert found == sorted([a, b])
    targets = sorted(json.loads(p.read_text())[0]["targets"][0] for p in found)
    assert targets == ["127.0.0.1:9850", "127.0.0.1:9851"]


def test_rewrite_replaces_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    TargetsFile("web1", UUID, "127.0.0.1:9850", directory=tmp_path).write()
    TargetsFile("web1", UUID, "127.0.0.1:9860", directory=tmp_path).write()
    assert [p.name for p in tmp_path.iterdir()] == ["web1.json"]
    assert json.loads((tmp_path / "web1.json").read_text())[0]["targets"] == ["127.0.0.1:9860"]


def test_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    big = {f"l{i}": "x" * 200 for i in range(200)}  # ~40 KB: many write() calls if not atomic
    files = [TargetsFile("web1", UUID, f"127.0.0.1:{9850 + i}", directory=tmp_path, labels=big) for i in range(2)]
    files[0].write()
    stop = threading.Event()
    bad: list[str] = []

    def read() -> None:
        while not stop.is_set():
            text = (tmp_path / "web1.json").read_text()
            try:
                json.loads(text)
            except ValueError:
                bad.append(text[-40:])

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(200):
        files[i % 2].write()
    stop.set()
    reader.join()
    assert bad == []


def test_remove_deletes_our_file_and_is_idempotent(tmp_path: Path) -> None:
    tf = TargetsFile("web1", UUID, "127.0.0.1:9850", directory=tmp_path)
    tf.write()
    assert tf.remove() is True
    assert not tf.path.exists()
    assert tf.remove() is False


def test_remove_leaves_a_newer_agents_file_alone(tmp_path: Path) -> None:
    old = TargetsFile("web1", UUID, "127.0.0.1:9850", directory=tmp_path)
    new = TargetsFile("web1", UUID, "127.0.0.1:9851", directory=tmp_path)
    old.write()
    new.write()  # a restarted agent took over before the old one stopped
    assert old.remove() is False
    assert json.loads(new.path.read_text())[0]["targets"] == ["127.0.0.1:9851"]


def test_context_manager_adds_on_start_and_removes_on_stop_even_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with TargetsFile("web1", UUID, "127.0.0.1:9850", directory=tmp_path) as tf:
            assert tf.path.exists()
            raise RuntimeError("agent crashed in its loop")
    assert list(tmp_path.iterdir()) == []


def test_directory_that_is_a_file_is_a_host_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("not a directory")
    with pytest.raises(HostError) as caught:
        TargetsFile("web1", UUID, "h:1", directory=tmp_path / "plain").write()
    assert "web1.json" in str(caught.value)


@pytest.mark.parametrize("domain", ["web1", "db.prod", "a b", "../etc", ".hidden", "x" * 300])
def test_the_file_is_named_like_the_status_file(domain: str, tmp_path: Path) -> None:
    path = TargetsFile(domain, UUID, "h:1", directory=tmp_path).write()
    assert path == tmp_path / f"{file_stem(domain)}.json" and path.parent == tmp_path
