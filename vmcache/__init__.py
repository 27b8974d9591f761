"""vmcache: keeps the hot regions of virtual disks resident in the host page cache."""

__version__ = "0.1.0"
