"""What OpenStack Nova writes about an instance into its domain's ``<metadata>`` (pure).

Nova's libvirt driver (nova/virt/libvirt/config.py,
``LibvirtConfigGuestMetaNovaInstance`` and its parts) writes one element,
in namespace ``http://openstack.org/xmlns/libvirt/nova/1.1`` (``.../1.0``
before 2020)::

    <nova:instance xmlns:nova="http://openstack.org/xmlns/libvirt/nova/1.1">
      <nova:package version="..."/>
      <nova:name>web-frontend-3</nova:name>
      <nova:creationTime>2026-11-20 10:01:02</nova:creationTime>
      <nova:flavor name="m1.large" id="...">
        <nova:memory>8192</nova:memory> ... <nova:extraSpecs>...</nova:extraSpecs>
      </nova:flavor>
      <nova:owner>
        <nova:user uuid="...">alice</nova:user>
        <nova:project uuid="3f0e...">web</nova:project>
      </nova:owner>
      ...
    </nova:instance>

The domain's own uuid is Nova's instance uuid; its name is Nova's
``instance-XXXXXXXX``, the display name is ``nova:name``. This element is
Nova's, not vmcache's: it is read leniently (anything missing or odd is
None) and never refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xml.etree.ElementTree import Element

__all__ = ["NOVA_NAMESPACES", "NovaInstance", "nova_instance"]

#: Newest first: where a domain somehow has both, the newer one is read.
NOVA_NAMESPACES = ("http://openstack.org/xmlns/libvirt/nova/1.1", "http://openstack.org/xmlns/libvirt/nova/1.0")


@dataclass(frozen=True)
class NovaInstance:
    """The parts of Nova's instance metadata host rules can match on."""

    namespace: str
    name: str | None = None       # the display name (nova:name)
    flavor: str | None = None     # nova:flavor name=
    project: str | None = None    # nova:owner/nova:project uuid=
    user: str | None = None       # nova:owner/nova:user uuid=


def _text(value: str | None) -> str | None:
    text = (value or "").strip()
    return text or None


def nova_instance(metadata: Element | None) -> NovaInstance | None:
    """Nova's instance element under a domain's ``<metadata>``, if there is one."""
    if metadata is None:
        return None
    for namespace in NOVA_NAMESPACES:
        ns = "{" + namespace + "}"
        element = metadata.find(ns + "instance")
        if element is None:
            continue
        flavor = element.find(ns + "flavor")
        project = element.find(f"{ns}owner/{ns}project")
        user = element.find(f"{ns}owner/{ns}user")
        return NovaInstance(
            namespace=namespace,
            name=_text(element.findtext(ns + "name")),
            flavor=_text(flavor.get("name")) if flavor is not None else None,
            project=_text(project.get("uuid")) if project is not None else None,
            user=_text(user.get("uuid")) if user is not None else None,
        )
    return None
