"""The tracker's bitmap granularity against the size of the node it covers (pure)."""

from __future__ import annotations

from vmcache.model.extents import MAX_BITMAP_BITS, granularity_for

KiB, TiB = 1024, 1 << 40


def test_granularity_grows_only_where_the_bitmap_would_pass_its_bits() -> None:
    assert granularity_for(0, 64 * KiB) == 64 * KiB
    assert granularity_for(8 * TiB, 64 * KiB) == 64 * KiB  # 2^27 granules exactly
    assert granularity_for(8 * TiB + 1, 64 * KiB) == 128 * KiB
    assert granularity_for(64 * TiB, 64 * KiB) == 512 * KiB
    assert granularity_for(64 * TiB, 64 * KiB) * MAX_BITMAP_BITS >= 64 * TiB
    assert granularity_for(100 * KiB, 16 * KiB, max_bits=4) == 32 * KiB
