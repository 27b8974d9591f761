"""An identity kept with an image file, so a saved hot set never warms another image.

Path and size alone do not tell a replaced image from the one a hot set was
saved for (a VM reinstalled from a template keeps both). vmcache gives each
image it saves a hot set for a random id in an extended attribute of the
file (``user.vmcache.id``, as libvirt keeps its own ``trusted.libvirt.*``
attributes on images). The id lives and dies with the file: it is the same
on every host that opens the file (shared storage, migration) and across
restarts, and a file put in its place (``cp``/``qemu-img convert`` then
``mv``, a new volume) has none or another one. Where the file system keeps
no user attributes (or the image is a device node), there is no id and a
record is tied to path and size only.
"""

from __future__ import annotations

import errno
import os
import secrets

from ..errors import HostError

__all__ = ["XATTR", "image_id"]

XATTR = "user.vmcache.id"
_UNSUPPORTED = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.EACCES, errno.EROFS)


def _read(path: str) -> str | None:
    try:
        value = os.getxattr(path, XATTR)
    except OSError as err:
        if err.errno in (errno.ENODATA, *_UNSUPPORTED):
            return None
        raise HostError(f"cannot read {XATTR}: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    text = value.decode("ascii", "replace").strip()
    return text if 8 <= len(text) <= 64 and all(c in "0123456789abcdef" for c in text) else None


def image_id(path: str, *, create: bool = False) -> str | None:
    """The id of the image at ``path``; with ``create``, one is given to an image that has none.

    None where the file system keeps no user attributes (or, without
    ``create``, the image has no id yet). Raises HostError for another
    failure (the image is gone, I/O error).
    """
    found = _read(path)
    if found is not None or not create:
        return found
    new = secrets.token_hex(16)
    try:
        os.setxattr(path, XATTR, new.encode("ascii"), os.XATTR_CREATE)
    except OSError as err:
        if err.errno == errno.EEXIST:  # another writer was first: theirs stands
            return _read(path)
        if err.errno in _UNSUPPORTED:
            return None
        raise HostError(f"cannot set {XATTR}: {os.strerror(err.errno or 0)}", path=path, errno=err.errno) from err
    return new
