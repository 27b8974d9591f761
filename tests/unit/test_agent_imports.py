"""What every agent carries: modules a cycle does not need are loaded when used, not at start.

With 100 agents on a host each module an agent imports for nothing costs
100 times its memory (docs/benchmarks.md, "Many agents on one host").
Pillow's part is in test_heatmap.py.
"""

from __future__ import annotations

import subprocess
import sys


def _loaded_after(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", "import sys, vmcache.service.agent\n" + code], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_asyncio_loads_only_for_a_plain_qemu_socket() -> None:
    """~2 MiB RssAnon per agent: an agent talks to QEMU through libvirt, qemu.qmp's asyncio is for sockets."""
    code = ("from vmcache.host.qmp import SocketMonitor\nbefore = 'asyncio' in sys.modules\n"
            "m = SocketMonitor('/nonexistent/qmp.sock')\ntry:\n    m.connect()\nexcept Exception:\n    pass\n"
            "print(before, 'asyncio' in sys.modules)")
    assert _loaded_after(code) == ["False", "True"]
