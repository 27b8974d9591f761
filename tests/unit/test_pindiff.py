"""pindiff: what the pinner locks, unlocks and keeps, decided without touching memory (pure)."""

from __future__ import annotations

from vmcache.model import pindiff
from vmcache.model.region import Region

PAGE = 4096
MB = 1 << 20


def pins(*regions: Region) -> dict[tuple[int, int], Region]:
    return {r.span: r for r in regions}


def test_clip_aligns_to_pages_cuts_to_the_file_and_dedupes_by_span() -> None:
    regions = [Region(100, 5000, 1.0), Region(0, 8192, 3.0), Region(3 * PAGE, 10 * PAGE, 2.0)]
    assert pindiff.clip(regions, 4 * PAGE + 1) == [Region(0, 2 * PAGE, 3.0), Region(3 * PAGE, 2 * PAGE, 2.0)]


def test_a_pin_overlapping_nothing_goes_and_a_moved_region_reshapes_its_old_pin() -> None:
    current = pins(Region(0, MB, 1.0), Region(10 * MB, MB, 1.0))
    wanted = [Region(MB // 2, MB, 2.0)]
    stale, overlapping = pindiff.unplanned(current, wanted)
    assert stale == [(10 * MB, MB)]
    assert overlapping == {(MB // 2, MB): [(0, MB)]}
    todo = pindiff.diff(pins(Region(0, MB, 1.0)), wanted, overlapping, budget=4 * MB, headroom=MB // 2)
    # only the new half needs headroom
    assert todo.add == [pindiff.Addition(Region(MB // 2, MB, 2.0), ((0, MB),))] and not todo.orphans


def test_without_headroom_a_reshaped_pin_stays_at_the_new_priority() -> None:
    current = pins(Region(0, MB, 1.0))
    wanted = [Region(0, 2 * MB, 5.0)]
    _, overlapping = pindiff.unplanned(current, wanted)
    todo = pindiff.diff(current, wanted, overlapping, budget=4 * MB, headroom=0)
    assert todo.add == [] and todo.skipped_floor == 2 * MB
    assert todo.keep == {(0, MB): Region(0, MB, 5.0)} and todo.kept == 1


def test_budget_keeps_the_highest_priority_and_releases_the_rest() -> None:
    current = pins(Region(0, MB, 1.0), Region(4 * MB, MB, 1.0))
    wanted = [Region(4 * MB, MB, 3.0), Region(0, MB, 2.0), Region(8 * MB, MB, 1.5)]
    _, overlapping = pindiff.unplanned(current, wanted)
    todo = pindiff.diff(current, wanted, overlapping, budget=MB, headroom=10 * MB)
    assert list(todo.keep) == [(4 * MB, MB)] and todo.release == [(0, MB)]
    assert todo.add == [] and todo.skipped_budget == 2 * MB


def test_pressure_gives_back_the_lowest_priority_first() -> None:
    order = pindiff.pressure_order([Region(0, MB, 2.0), Region(MB, MB, 1.0), Region(2 * MB, MB, 1.0)])
    assert order == [(2 * MB, MB), (MB, MB), (0, MB)]


def test_uncovered_is_what_a_grown_region_must_still_read() -> None:
    assert pindiff.uncovered(Region(0, 100), [(0, 40)]) == [(40, 60)]  # a chunk grown from its start
    assert pindiff.uncovered(Region(0, 100), []) == [(0, 100)]
    assert pindiff.uncovered(Region(10, 100), [(50, 10), (0, 20), (100, 50)]) == [(20, 30), (60, 40)]
    assert pindiff.uncovered(Region(10, 20), [(0, 100)]) == []


T = pindiff.TRIM_MIN


def test_a_region_larger_than_the_headroom_is_pinned_as_far_as_the_headroom_goes() -> None:
    """A 200 MiB zone in a cgroup with 90 MiB of room pins 86 MiB of it, not nothing."""
    wanted = [Region(0, 16 * T, 2.0), Region(32 * T, 4 * T, 1.0)]
    _, overlapping = pindiff.unplanned({}, wanted)
    todo = pindiff.diff({}, wanted, overlapping, budget=64 * T, headroom=4 * T + 100)
    assert todo.add == [pindiff.Addition(Region(0, 3 * T, 2.0))]  # TRIM_MIN of the room is left
    assert todo.skipped_floor == 13 * T + 4 * T


def test_a_cut_pin_grows_with_the_headroom_and_waits_without_it() -> None:
    current = pins(Region(0, 3 * T, 2.0))
    wanted = [Region(0, 16 * T, 2.5)]
    _, overlapping = pindiff.unplanned(current, wanted)
    todo = pindiff.diff(current, wanted, overlapping, budget=64 * T, headroom=3 * T)
    assert todo.add == [pindiff.Addition(Region(0, 5 * T, 2.5), ((0, 3 * T),))]  # only 2 T new
    assert todo.skipped_floor == 11 * T and not todo.keep
    todo = pindiff.diff(current, wanted, overlapping, budget=64 * T, headroom=2 * T - PAGE)
    assert todo.add == [] and todo.keep == {(0, 3 * T): Region(0, 3 * T, 2.5)}  # less than T to add


def test_a_head_that_would_add_little_waits_for_room() -> None:
    wanted = [Region(0, 16 * T, 2.0)]
    _, overlapping = pindiff.unplanned({}, wanted)
    todo = pindiff.diff({}, wanted, overlapping, budget=64 * T, headroom=2 * T - PAGE)
    assert todo.add == [] and todo.skipped_floor == 16 * T


def test_shrink_gives_back_what_is_needed_and_leaves_room() -> None:
    assert pindiff.shrunk(Region(0, 8 * T, 1.0), 3 * T - 100) == Region(0, 4 * T, 1.0)
    assert pindiff.shrunk(Region(0, 8 * T, 1.0), 6 * T + 1) is None  # less than T would be left
    assert pindiff.shrunk(Region(0, 8 * T, 1.0), 9 * T) is None
