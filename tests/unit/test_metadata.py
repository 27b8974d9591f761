"""Domain XML -> DomainInfo/DomainSettings and back; hostile XML refused; disk policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmcache.settings.config import HostConfig, parse_host_config
from vmcache.errors import ConfigError
from vmcache.settings.metadata import (
    NAMESPACE,
    DiskInfo,
    DiskOverride,
    DomainSettings,
    build_settings,
    parse_domain,
    parse_settings,
)
from vmcache.settings.policy import choose_disks, domain_budget, domain_minimum, total_budget

GiB = 1 << 30
MiB = 1 << 20

DOMAIN = f"""<domain type='qemu' id='3'>
  <name>web-1</name>
  <uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid>
  <metadata>
    <other:thing xmlns:other="http://example.org/other" budget="nonsense"/>
    <vmcache:cache xmlns:vmcache="{NAMESPACE}" enabled="yes" budget="2G">
      <vmcache:disk dev="vdb" exclude="yes"/>
      <vmcache:disk dev="vdc" budget="512M"/>
      <vmcache:model decay="0.95" threshold="0.3" max_regions="64" block_size="64K"/>
    </vmcache:cache>
  </metadata>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='/var/lib/libvirt/images/web-1.img'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' cache='writethrough'/>
      <source file='/var/lib/libvirt/images/web-1-b.qcow2'/>
      <target dev='vdb' bus='virtio'/>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source file='/var/lib/libvirt/images/web-1-c.img'/>
      <target dev='vdc' bus='virtio'/>
    </disk>
    <disk type='block' device='disk'>
      <driver name='qemu' type='raw' cache='none' io='native'/>
      <source dev='/dev/vg0/web-1-d'/>
      <target dev='vdd' bus='virtio'/>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/var/lib/libvirt/images/web-1-e.img'/>
      <target dev='vde' bus='virtio'/>
    </disk>
    <disk type='network' device='disk'>
      <driver name='qemu' type='raw' cache='writethrough'/>
      <source protocol='nbd' name='x'><host name='h' port='10809'/></source>
      <target dev='vdf' bus='virtio'/>
    </disk>
    <disk type='file' device='cdrom'>
      <driver name='qemu' type='raw'/>
      <target dev='sda' bus='sata'/>
      <readonly/>
    </disk>
  </devices>
</domain>"""


def test_parse_full_domain():
    info = parse_domain(DOMAIN)
    assert info.name == "web-1"
    assert info.uuid == "4dea22b3-1d52-d8f3-2516-782e98ab3fa0"
    assert info.settings == DomainSettings(
        enabled=True,
        budget=2 * GiB,
        disks=(DiskOverride("vdb", exclude=True), DiskOverride("vdc", budget=512 * MiB)),
        model={"decay": 0.95, "threshold": 0.3, "max_regions": 64, "block_size": "64K"},
    )
    assert [d.target for d in info.disks] == ["vda", "vdb", "vdc", "vdd", "vde", "vdf", "sda"]
    vda, vdb, _, vdd, vde, vdf, sda = info.disks
    assert vda == DiskInfo("vda", "disk", "file", "/var/lib/libvirt/images/web-1.img", "raw", "writethrough", False)
    assert vdb.driver_type == "qcow2"
    assert (vdd.source_type, vdd.source, vdd.cache) == ("block", "/dev/vg0/web-1-d", "none")
    assert (vde.cache, vde.cache_mode) == (None, "writeback")
    assert (vdf.source_type, vdf.source) == ("network", None)
    assert (sda.device, sda.readonly, sda.source) == ("cdrom", True, None)
    # the model overrides are valid ModelParams once merged with the host's
    params = HostConfig().model_params(info.settings.model)
    assert (params.decay, params.threshold, params.max_regions, params.block_size) == (0.95, 0.3, 64, 65536)


def test_domain_without_metadata_has_no_settings():
    info = parse_domain("<domain><name>plain</name><metadata><x:y xmlns:x='urn:other'/></metadata></domain>")
    assert info.settings is None
    assert info.disks == ()
    assert parse_domain(b"<domain><name>plain</name></domain>").settings is None


def test_the_user_qemu_runs_as_comes_from_the_dac_seclabel():
    live = ("<domain><name>d</name><seclabel type='dynamic' model='apparmor' relabel='yes'><label>libvirt-x</label>"
            "</seclabel><seclabel type='dynamic' model='dac' relabel='yes'><label>+64055:+108</label>"
            "<imagelabel>+64055:+108</imagelabel></seclabel></domain>")
    assert parse_domain(live).qemu_user == (64055, 108)
    assert parse_domain("<domain><name>d</name></domain>").qemu_user is None
    named = "<domain><name>d</name><seclabel model='dac'><label>qemu:qemu</label></seclabel></domain>"
    assert parse_domain(named).qemu_user is None


def test_element_without_enabled_means_enabled_and_host_budget():
    settings_ = parse_settings(f"<vmcache:cache xmlns:vmcache='{NAMESPACE}'/>")
    assert settings_ == DomainSettings(enabled=True, budget=None)
    assert domain_budget(settings_, HostConfig()) == GiB


def test_disabled():
    assert parse_settings("<cache enabled='no' budget='1G'/>").enabled is False


def test_virsh_metadata_output_parses():
    """virDomainGetMetadata returns the element without its namespace, as virsh shows it."""
    text = '<cache enabled="yes" budget="2G">\n  <disk dev="vda" exclude="yes"/>\n</cache>\n'
    assert parse_settings(text) == DomainSettings(True, 2 * GiB, (DiskOverride("vda", exclude=True),))


@pytest.mark.parametrize(
    ("xml", "start"),
    [
        ("<cache enabled='maybe'/>", "metadata enabled: 'maybe': must be yes or no"),
        ("<cache budget='huge'/>", "metadata budget: 'huge': not a size"),
        ("<cache colour='red'/>", "metadata colour: 'red': unknown attribute"),
        ("<cache><disk/></cache>", "metadata disk[0] dev: None: must be a target dev"),
        ("<cache><disk dev='v a'/></cache>", "metadata disk[0] dev: 'v a': must be a target dev"),
        ("<cache><disk dev='vda' budget='-1'/></cache>", "metadata disk vda budget: '-1': not a size"),
        ("<cache><disk dev='vda' exclude='perhaps'/></cache>", "metadata disk vda exclude: 'perhaps'"),
        ("<cache><disk dev='vda'/><disk dev='vda'/></cache>", "metadata disk dev: 'vda': given twice"),
        ("<cache><model/><model/></cache>", "metadata model: {}: given twice"),
        ("<cache><model Decay='1'/></cache>", "metadata model Decay: '1': not a model parameter name"),
        ("<cache><pin/></cache>", "metadata: 'pin': unknown element"),
        ("<budget/>", "metadata: 'budget': root element is not <cache>"),
        ("<cache", "metadata: '<cache': not acceptable XML"),
    ],
)
def test_bad_metadata_names_key_and_value(xml, start):
    with pytest.raises(ConfigError) as err:
        parse_settings(xml)
    assert str(err.value).startswith(start), str(err.value)


def test_bad_metadata_inside_domain_is_a_config_error():
    xml = DOMAIN.replace('budget="2G"', 'budget="two"')
    with pytest.raises(ConfigError, match="metadata budget: 'two'"):
        parse_domain(xml)


def test_not_a_domain():
    with pytest.raises(ConfigError, match="root element is not <domain>"):
        parse_domain("<network><name>x</name></network>")
    with pytest.raises(ConfigError, match="domain has no name"):
        parse_domain("<domain/>")


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<domain><name>&lol3;</name></domain>"""
EXTERNAL = """<?xml version="1.0"?>
<!DOCTYPE d [<!ENTITY x SYSTEM "file:///etc/shadow">]><domain><name>&x;</name></domain>"""


@pytest.mark.parametrize("xml", [BILLION_LAUGHS, EXTERNAL, "<!DOCTYPE domain><domain><name>a</name></domain>"])
def test_entities_and_dtds_are_refused(xml):
    with pytest.raises(ConfigError, match="not acceptable XML"):
        parse_domain(xml)


def test_build_is_what_parse_reads():
    original = DomainSettings(
        enabled=False, budget=3 * GiB,
        disks=(DiskOverride("vda", budget=MiB), DiskOverride("sdb", exclude=True)),
        model={"decay": 0.5, "block_size": "64K", "max_regions": 12}, minimum=GiB,
    )
    xml = build_settings(original)
    assert xml.startswith("<cache ")
    assert "xmlns" not in xml  # libvirt adds the namespace itself
    assert parse_settings(xml) == original


_devs = st.from_regex(r"\A[a-z]{2,4}[0-9]?\Z")
_overrides = st.builds(DiskOverride, _devs, st.booleans(), st.none() | st.integers(0, 1 << 50))
_model_values = st.integers(-1000, 1 << 40) | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from(
    ["1M", "64KiB", "10s"])


@settings(max_examples=200, deadline=None)
@given(
    st.booleans(),
    st.none() | st.integers(0, 1 << 50),
    st.lists(_overrides, max_size=4, unique_by=lambda o: o.dev),
    st.dictionaries(st.from_regex(r"\A[a-z][a-z0-9_]{0,10}\Z"), _model_values, max_size=4),
)
def test_roundtrip_property(enabled, budget, disks, model):
    original = DomainSettings(enabled, budget, tuple(disks), model, minimum=None if budget is None else budget // 2)
    assert parse_settings(build_settings(original)) == original


def test_min_is_the_guaranteed_share_never_above_the_budget():
    s = parse_settings('<cache budget="2G" min="512M"/>')
    assert s.minimum == 512 * MiB and s.budget == 2 * GiB
    assert parse_settings('<cache/>').minimum is None
    with pytest.raises(ConfigError) as err:
        parse_settings('<cache budget="1G" min="2G"/>')
    assert err.value.key == "metadata min" and "budget" in err.value.reason
    with pytest.raises(ConfigError):
        parse_settings('<cache min="lots"/>')
    host = HostConfig(budget=256 * MiB)
    assert domain_minimum(parse_settings('<cache min="1G"/>'), host) == 256 * MiB  # cut to the host default
    assert domain_minimum(parse_settings('<cache budget="1G"/>'), host) == 0


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300) | st.binary(max_size=100))
def test_fuzz_any_input_gives_value_or_config_error(data):
    for parse in (parse_domain, parse_settings):
        try:
            parse(data)
        except ConfigError as err:
            assert "\n" not in str(err)


_attr = st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="<&\"\x00"), max_size=8)


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["enabled", "budget", "colour"]), _attr, max_size=3),
    st.lists(st.tuples(st.sampled_from(["disk", "model", "x"]),
                       st.dictionaries(st.sampled_from(["dev", "exclude", "budget", "decay", "Bad"]), _attr,
                                       max_size=3)), max_size=3),
)
def test_fuzz_structured_metadata(attrs, children):
    from xml.sax.saxutils import quoteattr

    def attr_text(a):
        return " ".join(f"{k}={quoteattr(v)}" for k, v in a.items())

    inner = "".join(f"<vmcache:{tag} {attr_text(a)}/>" for tag, a in children)
    xml = (f"<domain><name>d</name><metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' {attr_text(attrs)}>"
           f"{inner}</vmcache:cache></metadata></domain>")
    try:
        info = parse_domain(xml)
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        assert info.settings is not None
        try:
            HostConfig().model_params(info.settings.model)
        except ConfigError as err:
            assert str(err).startswith("metadata model.")


# --- policy: which disks, which budget ---------------------------------------


def test_choose_disks_default_host():
    info = parse_domain(DOMAIN)
    choices = {c.disk.target: c for c in choose_disks(info.disks, info.settings, HostConfig())}
    assert {t for t, c in choices.items() if c.eligible} == {"vda", "vdc"}
    assert choices["vdb"].reason == "excluded in metadata"
    assert choices["vdd"].reason == "cache=none bypasses the page cache"
    assert choices["vde"].reason == "cache=default (writeback) not in cache_modes (writethrough)"
    assert choices["vdf"].reason == "no local image (source type network)"
    assert choices["sda"].reason == "device cdrom"
    # vdc keeps its own 512M; vda gets the rest of the 2G domain budget
    assert choices["vdc"].budget == 512 * MiB
    assert choices["vda"].budget == 2 * GiB - 512 * MiB
    assert all(c.budget == 0 for c in choices.values() if not c.eligible)


def test_choose_disks_writeback_opt_in_shares_the_rest_of_the_budget():
    host = parse_host_config("cache_modes: [writethrough, writeback]")
    info = parse_domain(DOMAIN)
    listed = choose_disks(info.disks, info.settings, host)
    choices = {c.disk.target: c for c in listed}
    assert choices["vde"].eligible and choices["vda"].eligible
    # either may take the whole rest (the hot one gets it), both together no more than it
    assert choices["vda"].budget == choices["vde"].budget == 2 * GiB - 512 * MiB
    assert choices["vda"].shared and choices["vde"].shared and not choices["vdc"].shared
    assert total_budget(listed) == 2 * GiB
    assert choices["vdd"].eligible is False  # none is never eligible


def test_own_budgets_larger_than_domain_budget_leave_nothing_to_share():
    settings_ = DomainSettings(budget=GiB, disks=(DiskOverride("vdc", budget=4 * GiB),))
    info = parse_domain(DOMAIN)
    choices = {c.disk.target: c for c in choose_disks(info.disks, settings_, HostConfig())}
    assert choices["vdc"].budget == 4 * GiB
    assert choices["vda"].budget == 0
    assert total_budget(choices.values()) == 4 * GiB
