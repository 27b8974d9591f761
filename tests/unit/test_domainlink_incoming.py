"""DomainLink.incoming: a migration's destination, not a domain restored paused (both are paused/migration)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.errors import DomainError  # noqa: E402
from vmcache.service.domainlink import DomainLink  # noqa: E402


def refused(code: int) -> Any:
    err = libvirt.libvirtError("refused")
    err.err = (code, libvirt.VIR_FROM_QEMU, "refused", 2, None, None, None, 0, 0)
    return err


class Dom:
    def __init__(self, state: list[int], job: Any = None) -> None:
        self._state, self._job = state, job
        self.job_asked = 0

    def state(self) -> list[int]:
        return self._state

    def jobInfo(self) -> list[int]:
        self.job_asked += 1
        if self._job is not None:
            raise self._job
        return [libvirt.VIR_DOMAIN_JOB_NONE] + [0] * 11


def link(dom: Dom) -> DomainLink:
    out = DomainLink("d", "qemu:///system", connect=lambda uri: None, wake=threading.Event())
    out._dom = dom
    return out


PAUSED_MIGRATION = [libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_MIGRATION]


def test_a_destination_refusing_job_statistics_is_incoming() -> None:
    # libvirt on an incoming migration: "migration statistics are available only on the source host"
    assert link(Dom(PAUSED_MIGRATION, refused(libvirt.VIR_ERR_OPERATION_UNSUPPORTED))).incoming()


def test_a_domain_restored_paused_is_not_incoming() -> None:
    # what `virsh restore` of a paused domain leaves, for good: paused (migration), no job
    assert not link(Dom(PAUSED_MIGRATION)).incoming()


def test_other_states_are_not_incoming_and_no_job_is_asked() -> None:
    for state in ([libvirt.VIR_DOMAIN_RUNNING, 1], [libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_USER]):
        dom = Dom(state)
        assert not link(dom).incoming()
        assert dom.job_asked == 0


def test_another_job_error_is_a_domain_error() -> None:
    with pytest.raises(DomainError, match="cannot get its job"):
        link(Dom(PAUSED_MIGRATION, refused(libvirt.VIR_ERR_INTERNAL_ERROR))).incoming()
