"""Where an arm's processes go in the memory cgroup tree, and the limits each cgroup gets.

Pure: names and byte counts, no cgroup file is touched here (bench/e2e_run.py
applies them through bench/e2e_host.py's Cgroup). Unit tested in
tests/unit/test_bench_layout.py.

Two layouts (docs/benchmarks.md, "Memory accounting"):

- ``same``: one cgroup holds QEMU, the agent, the oracle's locker and the
  neighbour. On a real host: I/O charged to the VM's own cgroup - a backup
  or block job QEMU runs on the image, a host tool started in the VM's scope.
- ``sibling``: the parent holds the limit (the cache the VMs and the
  neighbour share, as a host's or a slice's memory does); each VM (QEMU, its
  agent, the oracle's locker) and the neighbour have a child cgroup of their
  own, as libvirt's machine scopes and other services do on a real host.

The parent's limit is the same in every mode of a scenario: the VMs' QEMU
anonymous memory (guest RAM, measured once the guests are up) plus the cache
room. ``partition`` adds hard limits on the children (libvirt's
``<memtune><hard_limit>``): beside a neighbour each VM gets its anon plus the
vmcache budget and the neighbour the rest; VMs alone share the room equally.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "vmcache-bench-e2e"


@dataclass(frozen=True)
class Layout:
    parent: str                   # memory cgroup (under the controller's root) holding the arm's limit
    vms: tuple[str, ...]          # each VM's cgroup, in VM order (the parent itself in the same layout)
    neighbour: str | None         # the neighbour's cgroup; None without a neighbour

    @property
    def children(self) -> tuple[str, ...]:
        """The cgroups below the parent, to create after it."""
        return tuple(c for c in (*self.vms, self.neighbour) if c and c != self.parent)


def layout(kind: str, vms: int, neighbour: bool, root: str = ROOT) -> Layout:
    """The layout ``kind`` ("same" or "sibling") for ``vms`` guests, with or without a neighbour."""
    if kind == "same":
        if vms != 1:
            raise ValueError("the same-cgroup layout holds one VM")
        return Layout(root, (root,), root if neighbour else None)
    if kind != "sibling":
        raise ValueError(f"unknown layout {kind!r}")
    names = ("vm",) if vms == 1 else tuple(f"vm{i}" for i in range(1, vms + 1))
    return Layout(root, tuple(f"{root}/{n}" for n in names), f"{root}/nb" if neighbour else None)


def limits(lay: Layout, mode: str, anons: list[int], cache: int, budget: int) -> dict[str, int]:
    """memory.limit_in_bytes per cgroup: the parent's always, the children's in ``partition`` mode.

    ``anons``: each VM's QEMU anonymous memory, bytes; ``cache``: the room for page cache and every
    other tenant (agents, lockers, the neighbour); ``budget``: vmcache's budget per VM, what the
    partition gives each VM beside a neighbour. Raises ValueError for a partition that cannot be drawn.
    """
    if len(anons) != len(lay.vms):
        raise ValueError(f"{len(anons)} anon sizes for {len(lay.vms)} VMs")
    out = {lay.parent: sum(anons) + cache}
    if mode != "partition":
        return out
    if not lay.children:
        raise ValueError("a partition needs the sibling layout")
    if lay.neighbour is not None:
        rest = cache - budget * len(lay.vms)
        if rest <= 0:
            raise ValueError(f"budgets of {len(lay.vms)} VMs leave the neighbour no room in {cache} bytes")
        shares = [budget] * len(lay.vms)
        out[lay.neighbour] = rest
    else:
        shares = [cache // len(lay.vms)] * len(lay.vms)
    for vm, anon, share in zip(lay.vms, anons, shares):
        out[vm] = anon + share
    return out
