"""DomainLink.sending: a QMP command waits a little for libvirt to end the domain's job, then is not sent."""

from __future__ import annotations

import threading
from typing import Any

import pytest

libvirt = pytest.importorskip("libvirt")

from vmcache.errors import MonitorBusyError, MonitorRunOverError  # noqa: E402
from vmcache.service import domainlink  # noqa: E402
from vmcache.service.domainlink import DomainLink  # noqa: E402


class Dom:
    """Answers controlInfo with the states given, one per call, the last one for good; jobInfo with ``job``."""

    def __init__(self, *states: int, job: int = libvirt.VIR_DOMAIN_JOB_NONE,
                 operation: int = libvirt.VIR_DOMAIN_JOB_OPERATION_UNKNOWN) -> None:
        self.states = list(states)
        self.job, self.operation = job, operation
        self.asked = 0

    def name(self) -> str:
        return "d"

    def jobStats(self) -> dict[str, int]:
        return {"type": self.job} if self.job == libvirt.VIR_DOMAIN_JOB_NONE else {
            "type": self.job, "operation": self.operation}

    def controlInfo(self) -> list[int]:
        self.asked += 1
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if state < 0:
            raise libvirt.libvirtError("domain is not running")
        return [state, 0, 0]


def link(dom: Dom, monkeypatch: pytest.MonkeyPatch) -> DomainLink:
    out = DomainLink("d", "qemu:///system", connect=lambda uri: None, wake=threading.Event(), domain_id=3)
    out._dom = dom
    monkeypatch.setattr(out, "check_run", lambda: None)
    monkeypatch.setattr(domainlink, "BUSY_WAIT", 0.3)
    monkeypatch.setattr(domainlink, "BUSY_POLL", 0.01)
    return out


def sent(lnk: DomainLink) -> bool:
    with lnk.sending():
        return True


def test_a_command_goes_when_the_domain_has_no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    dom = Dom(libvirt.VIR_DOMAIN_CONTROL_OK)
    assert sent(link(dom, monkeypatch)) and dom.asked == 2   # once before the gate, once holding it


def test_a_short_job_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    dom = Dom(libvirt.VIR_DOMAIN_CONTROL_OCCUPIED, libvirt.VIR_DOMAIN_CONTROL_JOB, libvirt.VIR_DOMAIN_CONTROL_OK)
    assert sent(link(dom, monkeypatch))


def test_a_long_job_holds_the_command_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # a snapshot revert's job runs the hook that fences this run: waiting for it would hold the revert up
    dom = Dom(libvirt.VIR_DOMAIN_CONTROL_ERROR)
    body: list[Any] = []
    with pytest.raises(MonitorBusyError, match="busy with a job"):
        with link(dom, monkeypatch).sending():
            body.append(1)
    assert body == [] and dom.asked > 5


def test_a_background_job_between_its_steps_holds_the_command_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # an outgoing migration: the domain looks free between its steps, but a command would wait for the job
    dom = Dom(libvirt.VIR_DOMAIN_CONTROL_OK, job=libvirt.VIR_DOMAIN_JOB_UNBOUNDED,
              operation=libvirt.VIR_DOMAIN_JOB_OPERATION_MIGRATION_OUT)
    with pytest.raises(MonitorBusyError, match="job operation"):
        sent(link(dom, monkeypatch))
    # a backup's job lets commands through (libvirt's job mask): the agent goes on beside it
    assert sent(link(Dom(libvirt.VIR_DOMAIN_CONTROL_OK, job=libvirt.VIR_DOMAIN_JOB_UNBOUNDED,
                         operation=libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP), monkeypatch))


def test_a_domain_that_stopped_ends_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MonitorRunOverError, match="command not sent"):
        sent(link(Dom(-1), monkeypatch))


def test_once_a_command_was_held_back_the_next_ones_do_not_wait_until_one_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    dom = Dom(libvirt.VIR_DOMAIN_CONTROL_ERROR)
    lnk = link(dom, monkeypatch)
    with pytest.raises(MonitorBusyError):
        sent(lnk)
    waited = dom.asked
    with pytest.raises(MonitorBusyError):
        sent(lnk)
    assert dom.asked - waited == 2          # looked once, then once holding the gate: no wait
    dom.states = [libvirt.VIR_DOMAIN_CONTROL_OK]
    assert sent(lnk)
    dom.states = [libvirt.VIR_DOMAIN_CONTROL_ERROR]
    asked = dom.asked
    with pytest.raises(MonitorBusyError):
        sent(lnk)
    assert dom.asked - asked > 5            # a new job: waited for again
