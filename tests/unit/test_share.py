"""The split of the host cap by benefit (vmcache.model.share)."""

from __future__ import annotations

import numpy as np
import pytest

from vmcache.model.params import ModelParams
from vmcache.model.region import Region
from vmcache.model.share import Demand, demand_curve, merge_curves, split, split_budget

MiB = 1 << 20


def sparse(heat):
    blocks = np.flatnonzero(heat)
    return blocks, heat[blocks]


def flat(nbytes: int, density: float) -> tuple[tuple[int, float], ...]:
    return ((nbytes, nbytes * density),)


def test_curve_is_densest_first_and_per_byte_whatever_the_block_size():
    heat_1m = np.array([0.5, 0.5, 1.0, 0.0])
    curve = demand_curve([Region(0, 2 * MiB, 99.0), Region(2 * MiB, MiB, 1.0)], *sparse(heat_1m),
                         ModelParams(block_size=MiB))
    assert curve == ((MiB, 1.0 * MiB), (3 * MiB, 2.0 * MiB))
    # the same heat on 64 KiB blocks: the same curve
    heat_64k = np.repeat(heat_1m, 16)
    again = demand_curve([Region(0, 2 * MiB), Region(2 * MiB, MiB)], *sparse(heat_64k),
                         ModelParams(block_size=64 << 10))
    assert again == curve


def test_curve_divides_by_the_read_amplitude_and_is_bounded():
    heat = np.full(100, 2.0)
    regions = [Region(i * MiB, MiB) for i in range(100)]
    curve = demand_curve(regions, *sparse(heat), ModelParams(block_size=MiB, read_amplitude=2.0), points=8)
    assert len(curve) <= 8
    assert curve[-1] == (100 * MiB, pytest.approx(100 * MiB * 1.0))


def test_merge_curves_of_two_disks_interleaves_their_steps():
    a = ((MiB, 0.9 * MiB), (3 * MiB, 1.1 * MiB))  # 0.9 then 0.1 per byte
    b = flat(MiB, 0.5)
    merged = merge_curves([a, b])
    assert merged == ((MiB, 0.9 * MiB), (2 * MiB, 1.4 * MiB), (4 * MiB, pytest.approx(1.6 * MiB)))


def test_cap_goes_to_the_densest_bytes_each_within_its_budget():
    demands = {
        "hot": Demand(budget=40 * MiB, curve=flat(100 * MiB, 0.9)),
        "warm": Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.5)),
        "cold": Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.1)),
    }
    s = split(demands, 100 * MiB)
    assert s.grants == {"hot": 40 * MiB, "warm": 60 * MiB, "cold": 0}
    assert sum(s.grants.values()) == 100 * MiB


def test_no_cap_grants_every_budget_and_one_vm_gets_the_cap():
    d = {"a": Demand(budget=10 * MiB, curve=flat(MiB, 1.0))}
    assert split(d, None).grants == {"a": 10 * MiB}
    assert split(d, 4 * MiB).grants == {"a": 4 * MiB}  # unused cap is handed out up to the budget


def test_unasked_cap_is_shared_equally_up_to_budgets():
    demands = {"a": Demand(budget=10 * MiB), "b": Demand(budget=50 * MiB), "c": Demand(budget=50 * MiB)}
    assert split(demands, 70 * MiB).grants == {"a": 10 * MiB, "b": 30 * MiB, "c": 30 * MiB}


def test_minimums_come_first_and_too_many_are_an_error_not_a_crash():
    demands = {
        "hot": Demand(budget=100 * MiB, curve=flat(100 * MiB, 0.9)),
        "idle": Demand(budget=100 * MiB, minimum=30 * MiB),
    }
    s = split(demands, 100 * MiB)
    assert s.grants == {"hot": 70 * MiB, "idle": 30 * MiB} and s.error is None
    over = {"a": Demand(budget=100 * MiB, minimum=80 * MiB), "b": Demand(budget=100 * MiB, minimum=40 * MiB)}
    s = split(over, 60 * MiB)
    assert s.error and "minimums" in s.error
    assert sum(s.grants.values()) <= 60 * MiB
    assert s.grants["a"] == 2 * s.grants["b"]


def test_fixed_bytes_of_older_agents_come_off_the_cap():
    d = {"new": Demand(budget=100 * MiB, curve=flat(100 * MiB, 1.0))}
    assert split(d, 100 * MiB, fixed=70 * MiB).grants == {"new": 30 * MiB}
    assert split(d, 100 * MiB, fixed=170 * MiB).grants == {"new": 0}


def test_incumbent_keeps_its_bytes_against_a_slightly_denser_newcomer():
    curve_a, curve_b = flat(60 * MiB, 0.50), flat(60 * MiB, 0.55)
    fresh = split({"a": Demand(100 * MiB, curve=curve_a), "b": Demand(100 * MiB, curve=curve_b)}, 60 * MiB)
    assert fresh.grants == {"a": 0, "b": 60 * MiB}
    held = split({"a": Demand(100 * MiB, curve=curve_a, granted=60 * MiB),
                  "b": Demand(100 * MiB, curve=curve_b)}, 60 * MiB)
    assert held.grants == {"a": 60 * MiB, "b": 0}
    # but not against one much denser
    beaten = split({"a": Demand(100 * MiB, curve=curve_a, granted=60 * MiB),
                    "b": Demand(100 * MiB, curve=flat(60 * MiB, 0.9))}, 60 * MiB)
    assert beaten.grants == {"a": 0, "b": 60 * MiB}


def test_quantum_keeps_small_moves_when_they_fit():
    demands = {"a": Demand(100 * MiB, curve=flat(51 * MiB, 0.9), granted=50 * MiB),
               "b": Demand(100 * MiB, curve=flat(100 * MiB, 0.5), granted=50 * MiB)}  # budgets/32 > 2 MiB
    assert split(demands, 100 * MiB, keep=1.0).grants == {"a": 51 * MiB, "b": 49 * MiB}
    assert split(demands, 100 * MiB, keep=1.0, quantum=2 * MiB).grants == {"a": 50 * MiB, "b": 50 * MiB}


def test_split_is_deterministic_on_ties():
    demands = {n: Demand(100 * MiB, curve=flat(100 * MiB, 0.5)) for n in ("b", "a", "c")}
    assert split(demands, 150 * MiB).grants == {"a": 100 * MiB, "b": 50 * MiB, "c": 0}


def test_split_budget_between_disks():
    disks = {"vda": Demand(20 * MiB, curve=flat(20 * MiB, 0.2)), "vdb": Demand(80 * MiB, curve=flat(80 * MiB, 0.8))}
    assert split_budget(50 * MiB, disks) == {"vda": 0, "vdb": 50 * MiB}


def test_refuses_nonsense():
    with pytest.raises(ValueError):
        split({"a": Demand(budget=-1)}, 10)
    with pytest.raises(ValueError):
        split({}, -1)
    with pytest.raises(ValueError):
        split({}, 1, keep=0.5)


def test_the_worked_example_in_docs_architecture():
    demands = {
        "db": Demand(1024 * MiB, curve=((300 * MiB, 0.9 * 300 * MiB), (800 * MiB, 0.9 * 300 * MiB + 0.3 * 500 * MiB))),
        "web": Demand(1024 * MiB, curve=((200 * MiB, 0.6 * 200 * MiB), (600 * MiB, 0.6 * 200 * MiB + 0.1 * 400 * MiB))),
        "backup": Demand(1024 * MiB, minimum=128 * MiB, curve=flat(2048 * MiB, 0.05)),
    }
    assert split(demands, 1024 * MiB).grants == {"db": 696 * MiB, "web": 200 * MiB, "backup": 128 * MiB}
