"""Property-based fuzzing of what operators and libvirt hand to vmcache (issue 7).

test_config.py and test_metadata.py already fuzz each parser alone (any
text, structured YAML values, structured metadata attributes, round trip).
This file fuzzes what lies around them:

- the whole hook call (``vmcache.service.hook.run``) with hostile domain names,
  metadata values, operations and host configs: it never raises, echoes
  filter XML byte for byte, starts an agent only for a domain whose XML
  names it and opts in, and logs one line per event;
- the files named after a domain (pidfile, status, agent log): always one
  plain name inside the directory, whatever the domain name;
- sizes (budgets): accepted means a whole, non-negative number of bytes
  no larger than MAX_SIZE; anything else is a one-line ConfigError;
- the disk policy on parsed metadata: budgets never negative, never more
  than the domain's in total unless a disk set its own.
"""

from __future__ import annotations

import io
import logging
import os
from xml.sax.saxutils import escape, quoteattr

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vmcache.settings.config import HostConfig, parse_host_config
from vmcache.errors import ConfigError
from vmcache.service.hook import FILTER_OPS, START_OPS, STOP_OPS, Action, run
from vmcache.service.launchresult import LaunchResult
from vmcache.settings.metadata import NAMESPACE, DiskInfo, parse_domain
from vmcache.settings.policy import choose_disks, domain_budget, total_budget
from vmcache.host.files import file_stem
from vmcache.observe.status import status_path
from vmcache.units import MAX_SIZE, parse_size

# libvirt allows any character in a name but '/' (and the hook may still be handed one).
_names = st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
                 min_size=1, max_size=80)
_xml_chars = st.characters(blacklist_categories=("Cs", "Cc"))
_hostile_values = st.one_of(
    st.text(alphabet=_xml_chars, max_size=24),
    st.integers(-(1 << 70), 1 << 70).map(str),
    st.sampled_from(["-1G", "1e400", "nan", "inf", "0x10", "1 G", "1GG", "1.5.5M", "", " ", "99999999999999T",
                     "1048576", "&amp;", "1G\n2G", "１G", "1\u00a0G"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


class RecordingLauncher:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, config: HostConfig, *, config_path: str) -> RecordingLauncher:
        return self

    def start(self, domain: str, domain_id: int | None = None) -> LaunchResult:
        self.calls.append(("start", domain))
        return LaunchResult("started", domain, pid=1)

    def stop(self, domain: str) -> LaunchResult:
        self.calls.append(("stop", domain))
        return LaunchResult("stopping", domain, pid=1)


def _domain(name: str, cache_attrs: str, children: str = "") -> bytes:
    return (f"<domain type='qemu'><name>{escape(name)}</name><uuid>1b4e28ba-2fa1-11d2-883f-0016d3cca427</uuid>"
            f"<metadata><vmcache:cache xmlns:vmcache='{NAMESPACE}' {cache_attrs}>{children}</vmcache:cache>"
            "</metadata><devices><disk type='file' device='disk'><driver name='qemu' type='raw' "
            "cache='writethrough'/><source file='/img/a.raw'/><target dev='vda' bus='virtio'/></disk>"
            "</devices></domain>").encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=_names,
    argv_name=_names | st.just(""),
    op=st.sampled_from(sorted(START_OPS) * 3 + sorted(STOP_OPS | FILTER_OPS | {"prepare", "", "started\n"})),
    budget=st.sampled_from(["1G", "512MiB", "1048576", "0"]) | _hostile_values,
    extra=st.sampled_from(["", "", "", "<vmcache:evil/>", "<vmcache:disk dev='../etc'/>", "<vmcache:model decay='x'/>",
                           "<vmcache:disk dev='vda' budget='-5'/>", "<!-- c -->"]),
    same_name=st.booleans(),
    config_text=st.sampled_from(["", "", "", "budget: [1G", "interval: 0", "runtime_dir: relative", "budget: 1G"]),
)
def test_hook_run_never_raises_and_starts_only_opted_in_domains_named_in_their_xml(
        tmp_path_factory, name, argv_name, op, budget, extra, same_name, config_text) -> None:
    tmp = tmp_path_factory.mktemp("hook")
    config = tmp / "vmcache.yaml"
    config.write_text(config_text)
    domain = name if same_name else (argv_name or name)
    xml = _domain(name, f"budget={quoteattr(budget)}", extra)
    out = io.BytesIO()
    launcher = RecordingLauncher()
    records: list[str] = []
    handler = _ListHandler(records)
    logging.getLogger("vmcache.service.hook").addHandler(handler)
    try:
        decision = run([domain, op, "begin", "-"], io.BytesIO(xml), out, config_path=str(config),
                       launcher_for=launcher, setup_logging=None)
    finally:
        logging.getLogger("vmcache.service.hook").removeHandler(handler)
    event(f"action={decision.action.value}")
    if op in FILTER_OPS:
        assert out.getvalue() == xml
    else:
        assert out.getvalue() == b""
    for action, who in launcher.calls:
        assert who == domain
        if action == "start":
            assert decision.action is Action.START and op in START_OPS
            info = parse_domain(xml)              # the XML parsed and names this very domain
            assert info.name == domain and info.settings is not None and info.settings.enabled
            assert parse_host_config(config_text, check_model=False) is not None
    if decision.action is Action.START:
        assert launcher.calls == [("start", domain)] or "host config" in decision.reason
    for record in records:
        assert "\n" not in record.replace("\\n", "")


class _ListHandler(logging.Handler):
    def __init__(self, records: list[str]) -> None:
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@settings(max_examples=500, deadline=None)
@given(_names)
def test_files_named_after_a_domain_stay_in_their_directory(name) -> None:
    stem = file_stem(name)
    assert stem and "/" not in stem and "\0" not in stem and stem not in (".", "..") and not stem.startswith(".")
    assert len(stem.encode()) <= 255 - len(".json")
    path = status_path("/run/vmcache/agents", name)
    assert os.path.dirname(path) == "/run/vmcache/agents"
    assert os.path.normpath(path) == path


@settings(max_examples=500, deadline=None)
@given(_hostile_values | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.booleans() | st.none())
def test_a_size_is_whole_bytes_in_range_or_a_one_line_config_error(value) -> None:
    try:
        size = parse_size(value, key="budget")
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).startswith("budget")
    else:
        assert isinstance(size, int) and 0 <= size <= MAX_SIZE


_disks = st.lists(st.builds(DiskInfo, target=st.sampled_from(["vda", "vdb", "sda", "hdc"]),
                            device=st.sampled_from(["disk", "cdrom", "lun"]),
                            source=st.none() | st.just("/img/x.raw"),
                            cache=st.none() | st.sampled_from(["writethrough", "writeback", "none", "unsafe"])),
                  max_size=4, unique_by=lambda d: d.target)


@settings(max_examples=300, deadline=None)
@given(_disks, _hostile_values, st.lists(st.tuples(st.sampled_from(["vda", "vdb", "sda"]), st.booleans(),
                                                   _hostile_values), max_size=3, unique_by=lambda t: t[0]))
def test_policy_on_any_parsed_metadata_gives_sane_budgets(disks, budget, overrides) -> None:
    children = "".join(f"<vmcache:disk dev='{dev}' exclude='{'yes' if ex else 'no'}' budget={quoteattr(b)}/>"
                       for dev, ex, b in overrides)
    try:
        info = parse_domain(_domain("d", f"budget={quoteattr(budget)}", children))
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert info.settings is not None
    host = HostConfig()
    choices = choose_disks(tuple(disks), info.settings, host)
    assert [c.disk.target for c in choices] == [d.target for d in disks]
    own = sum(c.budget for c in choices if c.eligible and (o := info.settings.disk(c.disk.target))
              and o.budget is not None)
    rest = max(0, domain_budget(info.settings, host) - own)
    for c in choices:
        assert c.budget >= 0 and (c.eligible or c.budget == 0)
        assert c.eligible == (c.reason is None)
        has_own = (o := info.settings.disk(c.disk.target)) is not None and o.budget is not None
        assert c.shared == (c.eligible and not has_own) and (not c.shared or c.budget == rest)
    assert total_budget(choices) <= max(own, domain_budget(info.settings, host))
