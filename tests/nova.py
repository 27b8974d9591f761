"""The ``<nova:instance>`` metadata element as OpenStack Nova writes it into a domain's XML.

Element for element what nova/virt/libvirt/config.py
(``LibvirtConfigGuestMetaNovaInstance`` and its Flavor, FlavorExtraSpecs,
Owner, Ports parts; openstack/nova at 00a030403f67, 2026-08-21) formats,
taken from Nova's own expected output in
nova/tests/unit/virt/libvirt/test_config.py
(``LibvirtConfigGuestMetadataNovaTest.test_config_metadata_flavor_extra_specs``).
Namespace 1.1 since 2020; 1.0 before, without the flavor's ``id`` and
``extraSpecs``. Used by the unit tests of host rules and by the live test
that defines a domain the way Nova does.
"""

from __future__ import annotations

NOVA_1_1 = "http://openstack.org/xmlns/libvirt/nova/1.1"
NOVA_1_0 = "http://openstack.org/xmlns/libvirt/nova/1.0"


def nova_instance(*, flavor: str = "m1.lowgravity", project: str = "f241e906-010e-4917-ae81-53f4fb8aa021",
                  user: str = "3472c2a6-de91-4fb5-b618-42bc781ef670", name: str = "moonbuggy",
                  namespace: str = NOVA_1_1) -> str:
    """The element (for inside ``<metadata>``) with this flavor name, project uuid, user uuid and display name."""
    newer = namespace == NOVA_1_1
    flavor_id = ' id="f719a0dd-4b43-4efe-8336-48ef74099ad4"' if newer else ""
    extra = ("""
        <nova:extraSpecs>
          <nova:extraSpec name="hw_rng:allowed">true</nova:extraSpec>
        </nova:extraSpecs>""" if newer else "")
    return f"""<nova:instance xmlns:nova="{namespace}">
      <nova:package version="2014.2.3"/>
      <nova:name>{name}</nova:name>
      <nova:creationTime>2009-02-13 23:31:30</nova:creationTime>
      <nova:flavor name="{flavor}"{flavor_id}>
        <nova:memory>2048</nova:memory>
        <nova:disk>50</nova:disk>
        <nova:swap>10</nova:swap>
        <nova:ephemeral>10</nova:ephemeral>
        <nova:vcpus>8</nova:vcpus>{extra}
      </nova:flavor>
      <nova:owner>
        <nova:user uuid="{user}">buzz</nova:user>
        <nova:project uuid="{project}">moonshot</nova:project>
      </nova:owner>
      <nova:root type="image" uuid="fe55c69a-8b2e-4bbc-811a-9ad2023a0426"/>
      <nova:ports>
        <nova:port uuid="567a4527-b0e4-4d0a-bcc2-71fda37897f7">
          <nova:ip type="fixed" address="192.168.1.1" ipVersion="4"/>
          <nova:ip type="floating" address="11.22.33.44" ipVersion="4"/>
        </nova:port>
      </nova:ports>
    </nova:instance>"""
