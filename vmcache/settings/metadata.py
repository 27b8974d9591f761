"""The domain XML as vmcache reads it: opt-in metadata, disks, name, uuid and Nova's metadata (pure).

An operator opts a domain in with one element in the domain's
``<metadata>``, in vmcache's own namespace (docs/metadata.md)::

    <metadata>
      <vmcache:cache xmlns:vmcache="urn:x-vmcache:domain:1" enabled="yes" budget="2G" min="512M">
        <vmcache:disk dev="vdb" exclude="yes"/>
        <vmcache:disk dev="vdc" budget="512M"/>
        <vmcache:model decay="0.95" threshold="0.3"/>
      </vmcache:cache>
    </metadata>

This module only maps XML to objects and back (policy, such as which disks
are eligible, is in :mod:`vmcache.settings.policy`). XML is parsed with defusedxml:
DTDs, entity expansion and external entities are refused. Every problem
with the input is a :class:`~vmcache.errors.ConfigError` naming what was
wrong; nothing else escapes the parsers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from xml.etree.ElementTree import Element, ParseError, SubElement, tostring

import defusedxml.ElementTree as SafeET
from defusedxml import DefusedXmlException

from ..errors import ConfigError
from ..units import number_or_text, parse_size
from .nova import NovaInstance, nova_instance

__all__ = [
    "NAMESPACE",
    "PREFIX",
    "ELEMENT",
    "DiskOverride",
    "DomainSettings",
    "DiskInfo",
    "DomainInfo",
    "parse_domain",
    "parse_settings",
    "build_settings",
    "parse_xml",
    "parse_element",
    "known_attrs",
]

NAMESPACE = "urn:x-vmcache:domain:1"
"""Namespace URI of vmcache's metadata element (virDomainSetMetadata ``uri``)."""
PREFIX = "vmcache"
"""Prefix libvirt writes the element with (virDomainSetMetadata ``key``)."""
ELEMENT = "cache"
"""Local name of the metadata element."""

_NS = "{" + NAMESPACE + "}"
_TRUE = ("yes", "true", "1", "on")
_FALSE = ("no", "false", "0", "off")
_DEV_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_MODEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class DiskOverride:
    """Settings of one disk, by its target dev (``vda``): left out, or its own budget."""

    dev: str
    exclude: bool = False
    budget: int | None = None


@dataclass(frozen=True)
class DomainSettings:
    """What a domain's vmcache metadata says.

    ``budget`` None means the host's default budget; ``minimum`` (``min=``)
    is the part of the host's pinned cap guaranteed to the domain, never
    above its budget (None: nothing guaranteed); ``model`` holds model
    parameter overrides as given (validated against ModelParams by
    :meth:`vmcache.settings.config.HostConfig.model_params`).
    """

    enabled: bool = True
    budget: int | None = None
    disks: tuple[DiskOverride, ...] = ()
    model: Any = field(default_factory=lambda: MappingProxyType({}))
    minimum: int | None = None

    def disk(self, dev: str) -> DiskOverride | None:
        """The override for target ``dev``, if any."""
        for override in self.disks:
            if override.dev == dev:
                return override
        return None


@dataclass(frozen=True)
class DiskInfo:
    """One ``<disk>`` of the domain XML.

    ``cache`` is the ``<driver cache=...>`` attribute as written, None when
    absent (QEMU's default, which behaves as writeback); ``source`` is the
    image path for file and block disks, None for network/volume sources
    or an empty drive.
    """

    target: str
    device: str = "disk"
    source_type: str = "file"
    source: str | None = None
    driver_type: str | None = None
    cache: str | None = None
    readonly: bool = False
    alias: str | None = None  # libvirt's device alias (live XML): QEMU's -device id

    @property
    def cache_mode(self) -> str:
        """The cache mode QEMU uses: the attribute, or ``writeback`` when absent."""
        return self.cache or "writeback"


@dataclass(frozen=True)
class DomainInfo:
    """Name, uuid, disks and vmcache settings (None: no metadata) of a domain.

    ``id`` is the run's domain id (``<domain id='N'>``, a new one at every
    start), None in the XML of a domain that is not running.
    """

    name: str
    uuid: str
    disks: tuple[DiskInfo, ...]
    settings: DomainSettings | None
    id: int | None = None
    #: uid and gid QEMU runs as (the running domain's DAC ``<seclabel>``); None when the XML does not say.
    qemu_user: tuple[int, int] | None = None
    #: what OpenStack Nova wrote about the instance (host rules match on it); None on other hosts
    nova: NovaInstance | None = None


def parse_xml(text: str | bytes, what: str) -> Element:
    """Parse ``text`` with defusedxml; ConfigError (naming ``what``) for anything not acceptable."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(what, text[:60], "not UTF-8") from err
    if not isinstance(text, str):
        raise ConfigError(what, text, "not XML text")
    try:
        root = SafeET.fromstring(text, forbid_dtd=True)
    except (ParseError, DefusedXmlException) as err:
        raise ConfigError(what, text[:60], f"not acceptable XML: {err}") from None
    except ValueError as err:  # e.g. characters expat refuses before parsing
        raise ConfigError(what, text[:60], f"not acceptable XML: {err}") from None
    return root


def parse_domain(xml: str | bytes) -> DomainInfo:
    """Parse a full domain XML (``virsh dumpxml``, or what a libvirt hook gets on stdin).

    Raises ConfigError if the XML is malformed, is not a ``<domain>``, or
    its vmcache metadata is not acceptable.
    """
    root = parse_xml(xml, "domain XML")
    if root.tag != "domain":
        raise ConfigError("domain XML", root.tag, "root element is not <domain>")
    name = (root.findtext("name") or "").strip()
    if not name:
        raise ConfigError("domain XML", "<name>", "domain has no name")
    uuid = (root.findtext("uuid") or "").strip()
    disks = tuple(_disk(d) for d in root.iterfind("devices/disk") if d.find("target") is not None)
    settings = None
    metadata = root.find("metadata")
    if metadata is not None:
        element = metadata.find(_NS + ELEMENT)
        if element is not None:
            settings = _settings(element, _NS)
    run_id = root.get("id", "")
    return DomainInfo(name=name, uuid=uuid, disks=disks, settings=settings,
                      id=int(run_id) if run_id.isdigit() else None, qemu_user=_dac_user(root),
                      nova=nova_instance(metadata))


def _dac_user(root: Element) -> tuple[int, int] | None:
    """``(uid, gid)`` from a running domain's ``<seclabel model='dac'><label>+UID:+GID</label>``, else None."""
    for seclabel in root.iterfind("seclabel"):
        if seclabel.get("model") != "dac":
            continue
        uid, _, gid = (seclabel.findtext("label") or "").strip().partition(":")
        uid, gid = uid.removeprefix("+"), gid.removeprefix("+")
        if uid.isdigit() and gid.isdigit():
            return int(uid), int(gid)
    return None


def parse_element(xml: str | bytes, namespace: str, name: str, what: str) -> tuple[Element, str]:
    """One metadata element alone, as virDomainGetMetadata returns it (no namespace) or with it.

    Returns the element and the namespace prefix (``{uri}`` or "") its
    children are named with. Raises ConfigError when the XML is not
    acceptable or its root is not ``name``.
    """
    root = parse_xml(xml, what)
    ns = "{" + namespace + "}"
    if root.tag == ns + name:
        return root, ns
    if root.tag != name:
        raise ConfigError(what, root.tag, f"root element is not <{name}>")
    return root, ""


def parse_settings(xml: str | bytes) -> DomainSettings:
    """Parse the element alone, as virDomainGetMetadata returns it (no namespace) or with it."""
    return _settings(*parse_element(xml, NAMESPACE, ELEMENT, "metadata"))


def _disk(element: Element) -> DiskInfo:
    target = element.find("target")
    assert target is not None
    dev = target.get("dev") or ""
    source_type = element.get("type") or "file"
    source_el = element.find("source")
    source = None
    if source_el is not None:
        source = {"file": source_el.get("file"), "block": source_el.get("dev")}.get(source_type)
    driver = element.find("driver")
    alias = element.find("alias")
    return DiskInfo(
        target=dev,
        device=element.get("device") or "disk",
        source_type=source_type,
        source=source,
        driver_type=driver.get("type") if driver is not None else None,
        cache=driver.get("cache") if driver is not None else None,
        readonly=element.find("readonly") is not None,
        alias=alias.get("name") if alias is not None else None,
    )


def _flag(value: str | None, key: str, default: bool) -> bool:
    if value is None:
        return default
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(key, value, "must be yes or no")


def _budget(value: str | None, key: str) -> int | None:
    return None if value is None else parse_size(value, key=key)


def _settings(element: Element, ns: str) -> DomainSettings:
    known_attrs(element, ("enabled", "budget", "min"), "metadata")
    enabled = _flag(element.get("enabled"), "metadata enabled", True)
    budget = _budget(element.get("budget"), "metadata budget")
    minimum = _budget(element.get("min"), "metadata min")
    if minimum is not None and budget is not None and minimum > budget:
        raise ConfigError("metadata min", element.get("min"), f"must not be above the budget ({element.get('budget')})")
    disks: list[DiskOverride] = []
    model: dict[str, Any] | None = None
    for child in element:
        if not isinstance(child.tag, str):  # comments, processing instructions
            continue
        if child.tag == ns + "disk":
            disks.append(_override(child, len(disks)))
        elif child.tag == ns + "model":
            if model is not None:
                raise ConfigError("metadata model", child.attrib, "given twice")
            model = _model(child)
        else:
            raise ConfigError("metadata", child.tag.replace(_NS, PREFIX + ":"), "unknown element (use disk, model)")
    devs = [d.dev for d in disks]
    for dev in devs:
        if devs.count(dev) > 1:
            raise ConfigError("metadata disk dev", dev, "given twice")
    return DomainSettings(enabled=enabled, budget=budget, disks=tuple(disks), model=MappingProxyType(model or {}),
                          minimum=minimum)


def known_attrs(element: Element, known: tuple[str, ...], where: str) -> None:
    """ConfigError naming the first attribute of ``element`` not in ``known``."""
    for name, value in element.attrib.items():
        if name not in known:
            raise ConfigError(f"{where} {name}", value, "unknown attribute (known: " + ", ".join(known) + ")")


def _override(element: Element, index: int) -> DiskOverride:
    known_attrs(element, ("dev", "exclude", "budget"), "metadata disk")
    dev = element.get("dev")
    if dev is None or not _DEV_RE.match(dev):
        raise ConfigError(f"metadata disk[{index}] dev", dev, "must be a target dev such as vda")
    return DiskOverride(
        dev=dev,
        exclude=_flag(element.get("exclude"), f"metadata disk {dev} exclude", False),
        budget=_budget(element.get("budget"), f"metadata disk {dev} budget"),
    )


def _model(element: Element) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for name, text in element.attrib.items():
        if not _MODEL_KEY_RE.match(name):
            raise ConfigError(f"metadata model {name}", text, "not a model parameter name")
        model[name] = number_or_text(text.strip())
    return model


def build_settings(settings: DomainSettings) -> str:
    """The element for virDomainSetMetadata(VIR_DOMAIN_METADATA_ELEMENT, uri=NAMESPACE, key=PREFIX).

    Written without a namespace: libvirt puts it in NAMESPACE with PREFIX.
    ``parse_settings(build_settings(s)) == s``.
    """
    root = Element(ELEMENT, {"enabled": "yes" if settings.enabled else "no"})
    if settings.budget is not None:
        root.set("budget", str(settings.budget))
    if settings.minimum is not None:
        root.set("min", str(settings.minimum))
    for override in settings.disks:
        attrs = {"dev": override.dev}
        if override.exclude:
            attrs["exclude"] = "yes"
        if override.budget is not None:
            attrs["budget"] = str(override.budget)
        SubElement(root, "disk", attrs)
    if settings.model:
        SubElement(root, "model", {k: _text(v) for k, v in settings.model.items()})
    return tostring(root, encoding="unicode")


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)
