"""A thin facade over a libvirt domain for vmcache's metadata: look up, read, set.

libvirt's errors are translated here, once, into DomainError; callers see
named flags (Affect) instead of libvirt integers. The agent's own libvirt
needs (events, QMP) live elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import libvirt

from ..errors import DomainError, DomainGoneError
from ..settings.hotset import HOTSET_NAMESPACE, HOTSET_PREFIX, HotSet, build_hotset, parse_hotset
from ..settings.metadata import (NAMESPACE, PREFIX, DomainInfo, DomainSettings, build_settings, parse_domain,
                                 parse_settings)

__all__ = ["DEFAULT_URI", "Affect", "VirtDomain", "active_domains", "connect"]

DEFAULT_URI = "qemu:///system"


class Affect(enum.IntFlag):
    """Which definition a change applies to (VIR_DOMAIN_AFFECT_*)."""

    CURRENT = libvirt.VIR_DOMAIN_AFFECT_CURRENT  # live if running, else persistent
    LIVE = libvirt.VIR_DOMAIN_AFFECT_LIVE
    CONFIG = libvirt.VIR_DOMAIN_AFFECT_CONFIG


def _error(what: str, err: libvirt.libvirtError) -> DomainError:
    kind = DomainGoneError if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN else DomainError
    return kind(f"{what}: {err.get_error_message()}")


def connect(uri: str = DEFAULT_URI, *, open_: Callable[[str], Any] = libvirt.open) -> Any:
    """A libvirt connection; DomainError if libvirtd cannot be reached."""
    # libvirt prints every error to stderr by default: ours are raised, with their message
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        return open_(uri)
    except libvirt.libvirtError as err:
        raise _error(f"cannot connect to {uri}", err) from err


def active_domains(conn: Any) -> list[tuple[str, str]]:
    """``(name, live XML)`` of every running domain. Raises DomainError when libvirt cannot list them.

    A domain that stops between the listing and the read of its XML is left out.
    """
    try:
        domains = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
    except libvirt.libvirtError as err:
        raise _error("cannot list the running domains", err) from err
    found = []
    for dom in domains:
        try:
            found.append((dom.name(), dom.XMLDesc(0)))
        except libvirt.libvirtError as err:
            if err.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:  # else a transient domain stopped meanwhile
                raise _error("cannot read a running domain's XML", err) from err
    return found


class VirtDomain:
    """One domain, looked up by name on ``conn``."""

    def __init__(self, conn: Any, name: str) -> None:
        try:
            self._dom = conn.lookupByName(name)
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                raise DomainError(f"no domain named {name!r}") from err
            raise _error(f"cannot look up domain {name!r}", err) from err
        self.name = name

    @classmethod
    def of(cls, dom: Any) -> VirtDomain:
        """The facade over a virDomain already looked up (the agent's)."""
        facade = cls.__new__(cls)
        facade._dom = dom
        facade.name = dom.name()
        return facade

    def info(self, affect: Affect = Affect.CURRENT) -> DomainInfo:
        """The domain's XML (live if running, else persistent; or as ``affect`` says), parsed.

        Raises DomainError (libvirt) or ConfigError (the XML or vmcache's metadata is not acceptable).
        """
        flags = libvirt.VIR_DOMAIN_XML_INACTIVE if affect == Affect.CONFIG else 0
        try:
            xml = self._dom.XMLDesc(flags)
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot read its XML", err) from err
        return parse_domain(xml)

    def uuid(self) -> str:
        """The domain's uuid (the key of the host's copy of its hot set). Raises DomainError."""
        try:
            return str(self._dom.UUIDString())
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot get its uuid", err) from err

    def job(self) -> str | None:
        """The libvirt job running on the domain now, if any (a call that needs the domain's job - a QMP
        command, a metadata change - would wait for it, up to 30 s); None when there is none.

        ``virDomainGetControlInfo`` (which waits for nothing) tells a job that holds the domain (a snapshot
        revert, another client's command); ``virDomainGetJobStats`` then a background one (a migration, a
        save, a dump), between whose steps the domain looks free. A backup's job is not one: libvirt lets
        commands and metadata changes through while a backup runs. Raises DomainError (the domain is not
        running, libvirtd gone).
        """
        try:
            state = int(self._dom.controlInfo()[0])
            if state != libvirt.VIR_DOMAIN_CONTROL_OK:
                return f"control state {state}"
            stats = self._dom.jobStats()
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot ask for its job", err) from err
        kind = int(stats.get("type", libvirt.VIR_DOMAIN_JOB_NONE))
        operation = int(stats.get("operation", libvirt.VIR_DOMAIN_JOB_OPERATION_UNKNOWN))
        if kind == libvirt.VIR_DOMAIN_JOB_NONE or operation == libvirt.VIR_DOMAIN_JOB_OPERATION_BACKUP:
            return None
        return f"job operation {operation}"

    def is_active(self) -> bool:
        try:
            return bool(self._dom.isActive())
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot get state", err) from err

    def is_persistent(self) -> bool:
        try:
            return bool(self._dom.isPersistent())
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot get persistence", err) from err

    def settings(self, affect: Affect = Affect.CURRENT) -> DomainSettings | None:
        """vmcache's metadata of the live (LIVE) or persistent (CONFIG) definition; None if absent.

        Raises DomainError (libvirt) or ConfigError (the element is not acceptable).
        """
        xml = self._metadata(NAMESPACE, affect)
        return None if xml is None else parse_settings(xml)

    def set_settings(self, settings: DomainSettings | None, affect: Affect = Affect.CURRENT) -> None:
        """Write (or, with None, remove) vmcache's metadata element. Raises DomainError."""
        self._set_metadata(NAMESPACE, PREFIX, None if settings is None else build_settings(settings), affect,
                           "metadata")

    def _metadata(self, namespace: str, affect: Affect) -> str | None:
        try:
            return str(self._dom.metadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, namespace, int(affect)))
        except libvirt.libvirtError as err:
            if err.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN_METADATA:
                return None
            raise _error(f"{self.name}: cannot read metadata", err) from err

    def hotset(self, affect: Affect = Affect.CURRENT) -> HotSet | None:
        """The saved hot set of the live (LIVE) or persistent (CONFIG) definition; None if absent.

        Raises DomainError (libvirt) or ConfigError (the element is not acceptable).
        """
        xml = self._metadata(HOTSET_NAMESPACE, affect)
        return None if xml is None else parse_hotset(xml)

    def set_hotset(self, hotset: HotSet | None, affect: Affect = Affect.CURRENT) -> None:
        """Write (or, with None, remove) the saved hot set element. Raises DomainError."""
        self._set_metadata(HOTSET_NAMESPACE, HOTSET_PREFIX, None if hotset is None else build_hotset(hotset),
                           affect, "the hot set")

    def _set_metadata(self, namespace: str, prefix: str, xml: str | None, affect: Affect, what: str) -> None:
        """One element per namespace: ``xml`` replaces it, None removes it."""
        try:
            self._dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, xml, prefix if xml else None,
                                  namespace, int(affect))
        except libvirt.libvirtError as err:
            raise _error(f"{self.name}: cannot set {what}", err) from err
