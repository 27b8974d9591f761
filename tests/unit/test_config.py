"""HostConfig: defaults, every key, one-line errors naming key and value."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vmcache.settings.config import HostConfig, PinnedCap, parse_host_config
from vmcache.settings.metrics import MetricsBasicAuth, MetricsTLS
from vmcache.host.configfile import load_host_config
from vmcache.errors import ConfigError
from vmcache.model.params import ModelParams

GiB = 1 << 30


def test_missing_file_gives_defaults(tmp_path):
    config = load_host_config(str(tmp_path / "absent.yaml"))
    assert config == HostConfig()
    assert config.budget == GiB
    assert config.cache_modes == frozenset({"writethrough"})
    assert config.runtime_dir == "/run/vmcache"
    assert config.metrics.listen == "127.0.0.1"
    assert config.pinned_cap.bytes_for(8 * GiB) == 4 * GiB
    assert config.model_params() == ModelParams(interval=10.0)


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "vmcache.yaml"
    path.write_text("# nothing set\n")
    assert load_host_config(str(path)) == HostConfig()


def test_shipped_default_file_equals_builtin_defaults():
    """hooks/vmcache.yaml documents every key with its default: it must load to HostConfig()."""
    import pathlib

    shipped = pathlib.Path(__file__).resolve().parents[2] / "hooks" / "vmcache.yaml"
    text = shipped.read_text()
    assert parse_host_config(text) == HostConfig()
    # every key is present (commented or not) in the shipped file
    for key in ("budget", "min_free", "interval", "cache_modes", "pinned_cap", "model", "runtime_dir",
                "log_dir", "agent_command", "metrics", "listen", "ports", "tls", "certfile", "keyfile",
                "client_cafile", "client_auth_required", "basic_auth", "username", "password_file", "heatmap", "every", "blocks_per_pixel", "aspect",
                "domains", "match", "nova_flavor", "nova_project", "hotset_interval", "hotset_dir", "hotset_keep",
                "hotset_max_age"):
        assert f"{key}:" in text, key


def test_every_key_is_read():
    config = parse_host_config(
        """
budget: 2G
min_free: 512MiB
interval: 5s
cache_modes: [writethrough, writeback]
pinned_cap: 8G
model:
  decay: 0.8
  block_size: 64K
runtime_dir: /tmp/vmc-run/
log_dir: /tmp/vmc-log
agent_command: [/usr/bin/python3, -m, vmcache.cli, agent]
metrics:
  listen: "::1"
  ports: 9000-9009
  tls: {certfile: /etc/vmcache/cert.pem, keyfile: /etc/vmcache/key.pem, client_cafile: /etc/vmcache/ca.pem,
        client_auth_required: true}
  basic_auth: {username: prom, password_file: /etc/vmcache/metrics.password}
heatmap:
  dir: /var/tmp/heat
  every: 6
  blocks_per_pixel: 4
  aspect: 1.5
read_model: inferred
"""
    )
    assert config.budget == 2 * GiB
    assert config.min_free == 512 << 20
    assert config.interval == 5.0
    assert config.cache_modes == frozenset({"writethrough", "writeback"})
    assert config.pinned_cap == PinnedCap(size=8 * GiB, fraction=None)
    assert config.pinned_cap.bytes_for(1) == 8 * GiB
    assert config.runtime_dir == "/tmp/vmc-run"
    assert config.agents_dir == "/tmp/vmc-run/agents"
    assert config.ledger_path == "/tmp/vmc-run/ledger.json"
    assert config.log_dir == "/tmp/vmc-log"
    assert config.agent_command == ("/usr/bin/python3", "-m", "vmcache.cli", "agent")
    assert (config.metrics.listen, config.metrics.port_first, config.metrics.port_last) == ("::1", 9000, 9009)
    assert config.metrics.ports == range(9000, 9010)
    assert config.metrics.tls == MetricsTLS("/etc/vmcache/cert.pem", "/etc/vmcache/key.pem", "/etc/vmcache/ca.pem", True)
    assert config.metrics.basic_auth == MetricsBasicAuth("prom", "/etc/vmcache/metrics.password")
    assert (config.heatmap.dir, config.heatmap.every, config.heatmap.blocks_per_pixel, config.heatmap.aspect) == (
        "/var/tmp/heat", 6, 4, 1.5)
    assert config.read_model == "inferred"
    params = config.model_params()
    assert (params.decay, params.block_size, params.interval) == (0.8, 65536, 5.0)


def test_fill_is_whole_or_cached():
    assert parse_host_config("").fill == "whole"
    assert parse_host_config("fill: cached\n").fill == "cached"
    with pytest.raises(ConfigError, match="fill.*whole or cached"):
        parse_host_config("fill: pages\n")


def test_read_model_is_counted_or_inferred():
    assert parse_host_config("").read_model == "counted"
    assert parse_host_config("read_model: inferred\n").read_model == "inferred"
    with pytest.raises(ConfigError, match="read_model.*inferred or counted"):
        parse_host_config("read_model: exact\n")


def test_pinned_cap_percent():
    config = parse_host_config("pinned_cap: 25%")
    assert config.pinned_cap.bytes_for(16 * GiB) == 4 * GiB
    assert str(config.pinned_cap) == "25%"


def test_domain_model_overrides_are_validated():
    config = parse_host_config("model: {decay: 0.8}")
    assert config.model_params({"threshold": 0.5}).threshold == 0.5
    assert config.model_params({"threshold": 0.5}).decay == 0.8
    with pytest.raises(ConfigError) as err:
        config.model_params({"decay": 2})
    assert str(err.value).startswith("metadata model.decay: 2:")


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("budget: lots", "budget: 'lots': not a size"),
        ("min_free: -1", "min_free: -1: must not be negative"),
        ("interval: 0", "interval: 0: must be at least 0.1s"),
        ("cache_modes: [none]", "cache_modes: 'none': bypasses the page cache"),
        ("cache_modes: [directsync]", "cache_modes: 'directsync': bypasses the page cache"),
        ("cache_modes: [fast]", "cache_modes: 'fast': unknown cache mode"),
        ("cache_modes: []", "cache_modes: []: must be a list"),
        ("pinned_cap: 150%", "pinned_cap: '150%': a share of RAM"),
        ("model: {decay: 1.5}", "model.decay: 1.5: must be in (0, 1)"),
        ("model: {speed: 3}", "model.speed: 3: unknown model parameter"),
        ("model: {interval: 5}", "model.interval: 5: set the top-level interval key"),
        ("model: {decay: 0.99, pinned_decay: 0.9}", "model.pinned_decay: 0.9: must be at least decay"),
        ("runtime_dir: run/vmcache", "runtime_dir: 'run/vmcache': must be an absolute path"),
        ("agent_command: [vmcache, agent]", "agent_command: ['vmcache', 'agent']: the program must be an absolute"),
        ("agent_command: [/bin/x, 3]", "agent_command: ['/bin/x', 3]: must be a command"),
        ("metrics: {listen: localhost}", "metrics.listen: 'localhost': must be an IP address"),
        ("metrics: {ports: 9010-9000}", "metrics.ports: '9010-9000': ports must be in 1-65535"),
        ("metrics: {ports: 70000}", "metrics.ports: 70000: ports must be in 1-65535"),
        ("metrics: {tls: {certfile: /a.pem}}", "metrics.tls.keyfile: None: must be an absolute path"),
        ("metrics: {tls: {certfile: /a, keyfile: /b, client_auth_required: true}}",
         "metrics.tls.client_auth_required: True: needs client_cafile"),
        ("metrics: {tls: {cert: /a}}", "metrics.tls.cert: '/a': unknown key"),
        ("metrics: {basic_auth: {username: 'a:b', password_file: /p}}", "metrics.basic_auth.username: 'a:b'"),
        ("metrics: {basic_auth: {username: a}}", "metrics.basic_auth.password_file: None: must be an absolute"),
        ("metrics: {port: 9000}", "metrics.port: 9000: unknown key"),
        ("metrics: [1]", "metrics: [1]: must be a mapping"),
        ("heatmap: {aspect: 0}", "heatmap.aspect: 0: must be a number"),
        ("heatmap: {every: -1}", "heatmap.every: -1: must be a whole number >= 0"),
        ("budgte: 1G", "budgte: '1G': unknown key"),
        ("budget: 1G\nbudget: 2G", "budget: None: key given twice (line 2)"),
        ("- 1\n- 2", "/etc/vmcache/vmcache.yaml: [1, 2]: must be a mapping"),
    ],
)
def test_bad_values_name_key_and_value(text, line):
    with pytest.raises(ConfigError) as err:
        parse_host_config(text)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(line), message


def test_invalid_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "vmcache.yaml"
    path.write_text("budget: 1G\nmetrics: {listen: [\n")
    with pytest.raises(ConfigError) as err:
        load_host_config(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}:"), message
    assert "invalid YAML" in message and "\n" not in message


def test_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_host_config(str(tmp_path))  # a directory


def test_yaml_tags_are_refused():
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_host_config("budget: !!python/object/apply:os.system [true]")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_any_text_gives_config_or_config_error(text):
    try:
        result = parse_host_config(text)
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(result, HostConfig)


_yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(
    st.sampled_from(["budget", "min_free", "interval", "cache_modes", "pinned_cap", "model", "runtime_dir",
                     "log_dir", "agent_command", "metrics", "heatmap"]),
    _yaml_values, max_size=4))
def test_fuzz_structured_values(data):
    import yaml

    try:
        result = parse_host_config(yaml.safe_dump(data))
    except ConfigError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(result, HostConfig)


def test_hook_mode_leaves_model_values_to_the_agent():
    """The hook loads the config without vmcache.model (numpy); everything else is still checked."""
    config = parse_host_config("model: {decay: 7}\nruntime_dir: /r", check_model=False)
    assert config.runtime_dir == "/r"
    with pytest.raises(ConfigError, match="model.decay: 7"):
        config.model_params()
    with pytest.raises(ConfigError, match="budget"):
        parse_host_config("model: {decay: 7}\nbudget: x", check_model=False)
    with pytest.raises(ConfigError, match="model: 3: must be a mapping"):
        parse_host_config("model: 3", check_model=False)


# --- the cache of validated configs (what the hook reads instead of the YAML) ----

import json  # noqa: E402
import os  # noqa: E402

import vmcache.host.configfile as config_module  # noqa: E402
from vmcache.host.configfile import cache_path  # noqa: E402

FULL = """\
budget: 2G
cache_modes: [writeback, writethrough]
pinned_cap: 25%
model: {decay: 7}
runtime_dir: /r
log_dir: /l
agent_command: [/usr/bin/agent, --x]
metrics:
  listen: "::1"
  ports: 9000-9010
  tls: {certfile: /c, keyfile: /k, client_cafile: /ca, client_auth_required: true}
  basic_auth: {username: u, password_file: /p}
heatmap: {dir: /h, every: 3, blocks_per_pixel: 8, aspect: 1.5}
"""


@pytest.fixture
def settled(monkeypatch):
    """Files count as unchanged for long at once (the cache waits 2 s after a change)."""
    monkeypatch.setattr(config_module, "_SETTLE_NS", -1)


def no_yaml(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("parsed the YAML")

    monkeypatch.setattr(config_module, "parse_host_config", refuse)


def test_cache_gives_the_same_config_without_parsing(tmp_path, settled, monkeypatch):
    path = tmp_path / "vmcache.yaml"
    path.write_text(FULL)
    cache = tmp_path / "cache"
    first = load_host_config(str(path), check_model=False, cache_dir=str(cache))
    assert first == parse_host_config(FULL, check_model=False)
    written = cache_path(str(path), str(cache))
    assert os.path.basename(written) == str(path).replace("/", "%2F") + ".json"
    assert os.stat(written).st_mode & 0o777 == 0o644
    no_yaml(monkeypatch)
    assert load_host_config(str(path), check_model=False, cache_dir=str(cache)) == first


def test_cached_config_still_has_its_model_checked(tmp_path, settled):
    path = tmp_path / "vmcache.yaml"
    path.write_text("model: {decay: 7}\n")
    load_host_config(str(path), check_model=False, cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="model.decay: 7"):
        load_host_config(str(path), cache_dir=str(tmp_path))


def test_changed_file_is_parsed_again(tmp_path, settled):
    path = tmp_path / "vmcache.yaml"
    path.write_text("budget: 2G\n")
    assert load_host_config(str(path), cache_dir=str(tmp_path)).budget == 2 * GiB
    path.write_text("budget: 3G\n")  # same size, likely the same mtime tick: the ctime/inode key still differs
    assert load_host_config(str(path), cache_dir=str(tmp_path)).budget == 3 * GiB
    path.write_text("budget: x\n")
    with pytest.raises(ConfigError, match="budget: 'x'"):
        load_host_config(str(path), cache_dir=str(tmp_path))


def test_a_file_changed_just_now_is_not_cached(tmp_path):
    path = tmp_path / "vmcache.yaml"
    path.write_text("budget: 2G\n")
    assert load_host_config(str(path), cache_dir=str(tmp_path / "cache")).budget == 2 * GiB
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("damage", ["group-writable", "foreign-owner", "other-path", "garbage", "symlink"])
def test_untrusted_or_damaged_cache_is_ignored(tmp_path, settled, monkeypatch, damage):
    path = tmp_path / "vmcache.yaml"
    path.write_text("budget: 2G\n")
    cache_dir = tmp_path / "cache"
    load_host_config(str(path), cache_dir=str(cache_dir))
    cache = cache_path(str(path), str(cache_dir))
    data = json.loads(Path(cache).read_text())
    data["config"]["budget"] = 5  # what a forged cache would say
    forged = json.dumps(data)
    if damage == "group-writable":
        Path(cache).write_text(forged)
        os.chmod(cache, 0o664)
    elif damage == "foreign-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        Path(cache).write_text(forged)
        os.chown(cache, 65534, 65534)
    elif damage == "other-path":
        data["path"] = str(tmp_path / "other.yaml")
        Path(cache).write_text(json.dumps(data))
    elif damage == "garbage":
        Path(cache).write_text('{"version": 1, "path": ')
    else:
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(forged)
        os.unlink(cache)
        os.symlink(elsewhere, cache)
    assert load_host_config(str(path), cache_dir=str(cache_dir)).budget == 2 * GiB
    assert not os.path.islink(cache)  # parsed again and written anew
    assert json.loads(Path(cache).read_text())["config"]["budget"] == 2 * GiB


def test_values_json_cannot_carry_are_not_cached(tmp_path, settled):
    path = tmp_path / "vmcache.yaml"
    path.write_text("model: {decay: .nan, when: 2024-01-01}\n")
    config = load_host_config(str(path), check_model=False, cache_dir=str(tmp_path / "cache"))
    assert "when" in config.model
    assert not (tmp_path / "cache").exists() or os.listdir(tmp_path / "cache") == []


def test_missing_file_gives_defaults_and_no_cache(tmp_path):
    assert load_host_config(str(tmp_path / "absent.yaml"), cache_dir=str(tmp_path / "cache")) == HostConfig()
    assert not (tmp_path / "cache").exists()


def test_long_config_paths_get_short_cache_names():
    name = os.path.basename(cache_path("/" + "d" * 300 + "/vmcache.yaml", "/c"))
    assert len(name) <= 210 and name.endswith(".json")
    assert name != os.path.basename(cache_path("/" + "e" + "d" * 299 + "/vmcache.yaml", "/c"))


def test_psi_threshold_is_a_percentage() -> None:
    assert parse_host_config("").psi_threshold == 10.0
    assert parse_host_config("psi_threshold: 25").psi_threshold == 25.0
    assert parse_host_config("psi_threshold: 12.5%").psi_threshold == 12.5
    for bad, why in (("0", "must be in (0, 100]"), ("150", "must be in (0, 100]"), ("-1", "must be in (0, 100]"),
                     ("high", "must be a percentage"), ("true", "must be a percentage"), ("[1]", "must be a percentage")):
        with pytest.raises(ConfigError) as err:
            parse_host_config(f"psi_threshold: {bad}")
        assert str(err.value).startswith("psi_threshold: ") and why in str(err.value), str(err.value)


def test_prefetch_rate_is_a_size_or_unlimited() -> None:
    assert parse_host_config("").prefetch_rate == 8 << 20
    assert parse_host_config("prefetch_rate: 32M").prefetch_rate == 32 << 20
    assert parse_host_config("prefetch_rate: unlimited").prefetch_rate is None
    with pytest.raises(ConfigError) as err:
        parse_host_config("prefetch_rate: fast")
    assert str(err.value).startswith("prefetch_rate: 'fast'")


def test_warm_rate_is_a_size_above_zero() -> None:
    assert parse_host_config("").warm_rate == 32 << 20
    assert parse_host_config("warm_rate: 64M").warm_rate == 64 << 20
    for bad, why in (("0", "must be more than 0"), ("unlimited", "never unlimited"), ("fast", "size"),
                     ("-1M", "not a size"), ("-1", "negative")):
        with pytest.raises(ConfigError) as err:
            parse_host_config(f"warm_rate: {bad}")
        assert str(err.value).startswith("warm_rate: ") and why in str(err.value), str(err.value)


def test_settings_package_does_no_io() -> None:
    """settings/ parses what operators say; reading files and caching are vmcache.host.configfile's."""
    import ast
    import pathlib

    import vmcache.settings

    forbidden = {"socket", "ctypes", "libvirt", "qemu", "prometheus_client", "time", "io", "subprocess", "stat",
                 "tempfile", "fcntl", "shutil", "json"}
    for path in pathlib.Path(vmcache.settings.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                names = ["open()"]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & (forbidden | {"open()"}), f"{path.name}: {names}"


def test_the_hosts_hot_set_copies_keys():
    config = parse_host_config("hotset_dir: /srv/vmcache/hot/\nhotset_keep: 20\nhotset_max_age: 7d\n")
    assert (config.hotset_dir, config.hotset_keep, config.hotset_max_age) == ("/srv/vmcache/hot", 20, 7 * 86400.0)
    assert parse_host_config("hotset_dir: null\n").hotset_dir is None
    for text, message in (("hotset_dir: hot\n", "hotset_dir: 'hot': must be an absolute path"),
                          ("hotset_keep: 0\n", "hotset_keep: 0: must be a whole number >= 1"),
                          ("hotset_max_age: 10m\n", "hotset_max_age: '10m': must be at least 3600s")):
        with pytest.raises(ConfigError) as err:
            parse_host_config(text)
        assert str(err.value) == message
