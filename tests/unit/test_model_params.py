"""ModelParams: defaults that work, and one-line errors naming key and value."""

from __future__ import annotations

import dataclasses

import pytest

from vmcache.errors import ConfigError
from vmcache.model.params import ModelParams


def test_defaults_are_valid_and_sane() -> None:
    p = ModelParams()
    assert p.block_size == 1 << 20 and p.block_size % 4096 == 0
    assert p.write_amplitude > p.read_amplitude > 0
    assert 0 < p.decay <= p.pinned_decay < 1
    assert p.threshold < p.read_amplitude  # a fully read region can get hot
    assert 1 <= p.max_regions <= 4096  # far from vm.max_map_count
    assert p.keep_factor >= 1


def test_from_mapping_maps_keys_and_parses_units() -> None:
    p = ModelParams.from_mapping({"block_size": "64KiB", "interval": "500ms", "decay": 0.5, "max_regions": 10})
    assert p.block_size == 65536
    assert p.interval == 0.5
    assert p.decay == 0.5
    assert p.max_regions == 10
    assert p.threshold == ModelParams().threshold  # untouched keys keep defaults


def test_int_given_for_float_field_becomes_float() -> None:
    p = ModelParams.from_mapping({"threshold": 1, "write_amplitude": 3})
    assert isinstance(p.threshold, float) and p.threshold == 1.0
    assert isinstance(p.write_amplitude, float)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("nonsense", 1, "unknown model parameter"),
        ("block_size", "6K", "multiple of 4096"),
        ("block_size", "1.5K", "must be in"),
        ("block_size", "lots", "not a size"),
        ("block_size", "2G", "must be in"),
        ("decay", 1.0, "must be in (0, 1)"),
        ("decay", 0, "must be in (0, 1)"),
        ("decay", "0.9", "must be a number"),
        ("pinned_decay", 0.5, "must be at least decay"),
        ("read_sigma", -1.0, "must be in"),
        ("read_sigma", 1000, "must be in"),
        ("threshold", 0, "must be in"),
        ("threshold", float("nan"), "finite"),
        ("interval", "soon", "not a duration"),
        ("interval", 0, "must be in"),
        ("max_regions", 0, "must be in"),
        ("max_regions", 100000, "must be in"),
        ("max_regions", 10.0, "whole number"),
        ("max_regions", True, "whole number"),
        ("merge_gap", -1, "must be in"),
        ("min_region", 0, "must be in"),
        ("keep_factor", 0.5, "must be in"),
    ],
)
def test_bad_values_raise_one_line_naming_key_and_value(key: str, value: object, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelParams.from_mapping({key: value}, prefix="model.")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"model.{key}: {value!r}: ")
    assert reason in message
    assert info.value.key == f"model.{key}"
    assert info.value.value == value or value != value  # NaN != NaN


def test_both_amplitudes_zero_is_rejected() -> None:
    with pytest.raises(ConfigError, match="read_amplitude and write_amplitude"):
        ModelParams.from_mapping({"read_amplitude": 0, "write_amplitude": 0})


def test_not_a_mapping_is_rejected() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        ModelParams.from_mapping([("decay", 0.5)], prefix="model.")  # type: ignore[arg-type]


def test_direct_construction_and_replace_validate() -> None:
    with pytest.raises(ConfigError, match="^decay: 2.0: "):
        ModelParams(decay=2.0)
    with pytest.raises(ConfigError, match="^block_size: 5000: "):
        dataclasses.replace(ModelParams(), block_size=5000)


def test_params_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelParams().decay = 0.5  # type: ignore[misc]
