"""The identity kept with an image file: created once, read back, gone with a replaced file."""

from __future__ import annotations

import os
import shutil

import pytest

from vmcache.host.imageid import XATTR, image_id


def _xattrs_supported(path) -> bool:
    try:
        os.setxattr(path, "user.vmcache.probe", b"1")
        os.removexattr(path, "user.vmcache.probe")
        return True
    except OSError:
        return False


def test_id_is_created_once_and_does_not_survive_a_replacement(tmp_path):
    image = tmp_path / "disk.img"
    image.write_bytes(b"\0" * 8192)
    if not _xattrs_supported(image):
        pytest.skip("this file system keeps no user xattrs")
    assert image_id(str(image)) is None  # reading never creates one
    first = image_id(str(image), create=True)
    assert first is not None and len(first) == 32
    assert image_id(str(image)) == first == image_id(str(image), create=True)
    os.truncate(image, 16384)  # a resize keeps the file, and its id (the size check catches it)
    assert image_id(str(image)) == first
    copy = tmp_path / "disk.new"
    shutil.copyfile(image, copy)  # cp, qemu-img convert: a new file, no id
    os.replace(copy, image)
    assert image_id(str(image)) is None
    assert image_id(str(image), create=True) not in (None, first)


def test_garbage_in_the_attribute_is_no_id(tmp_path):
    image = tmp_path / "disk.img"
    image.write_bytes(b"\0" * 4096)
    if not _xattrs_supported(image):
        pytest.skip("this file system keeps no user xattrs")
    os.setxattr(image, XATTR, b"not an id; rm -rf /")
    assert image_id(str(image)) is None
    assert image_id(str(image), create=True) is None  # never overwrites what someone else wrote


def test_device_node_has_no_id():
    assert image_id("/dev/null", create=True) is None
