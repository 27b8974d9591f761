"""The inferred path's reads: residency and pinned evidence judged against the guest's rate (pure).

Where the guest's reads are not counted (``read_model: inferred``), the
cycle (vmcache.model.cycle) learns them from residency that grew and from
the referenced bits of sampled pinned pages; these two steps make a slow
guest's hot set show before its pages fill the blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from .blocks import BlockValues, window_mean
from .params import PAGE_SIZE, ModelParams

__all__ = ["relative_reads", "held_evidence"]


def relative_reads(params: ModelParams, nblocks: int, resident: BlockValues, grown: NDArray[np.float32] | None,
                   seen: BlockValues | None, sample: int | None = None, *,
                   held: Callable[[BlockValues, np.float32, int | None], BlockValues] | None = None
                   ) -> tuple[BlockValues, BlockValues | None]:
    """The residency and evidence the model sees: each block's reads also judged against the guest's rate.

    The level of residency alone says little about a slow guest: one
    that reads 20 pages a second fills a hot 1 MiB block by a page or
    two per cycle, and its hot set would need many minutes to look
    resident. How the cycle's reads are spread says it at once: a block
    taking many times its fair share of them (the cycle's reads - read
    misses of the blocks not ours and read evidence of the pinned ones,
    in blocks' worth - spread evenly over the disk) is where the guest
    reads, whatever its rate. At ``miss_contrast`` times its share a
    block counts as fully resident: ``max(R, min(1, misses /
    (miss_contrast * fair share)))``. Reads spread evenly give ``1 /
    miss_contrast``, under the threshold; a one-pass read counts in one
    cycle only; where the level is higher (a fast guest) nothing changes.
    The pinned blocks' evidence is judged the same way where it is too
    weak to hold anything (:func:`held_evidence`, or ``held``).
    """
    contrast = params.miss_contrast
    if contrast == 0 or grown is None:
        return resident, seen
    total = float(grown.sum(dtype=np.float64))
    if seen is not None:
        total += float(np.nansum(seen.value, dtype=np.float64))
    if total <= 0.0:
        return resident, seen
    scale = np.float32(nblocks / (contrast * total))  # 1 / (miss_contrast * fair share)
    share = np.minimum(np.float32(1.0), grown * scale)
    resident = BlockValues(resident.index, np.maximum(resident.value, share).astype(np.float32))
    if seen is None:
        return resident, None
    return resident, (held(seen, scale, sample) if held else held_evidence(params, seen, scale, sample))


def held_evidence(params: ModelParams, seen: BlockValues, scale: np.float32, sample: int | None = None) -> BlockValues:
    """The pinned blocks' evidence, judged against the guest's rate where it is too weak to hold a pin.

    Evidence ``e`` (the share of a pinned block's pages read in the
    cycle) counts as residency ``seen_scale * e``: a fast guest's hot
    pinned blocks stay hot by it, a slow guest's cannot - 20 reads a
    second over a 205 MiB zone read about a page per block per cycle
    (``e`` = 1/256), and its pins cooled and were released while it kept
    reading them. So where the pinned blocks' mean input ``seen_scale *
    mean(e)`` is under the level at which the planner releases a pin
    (``threshold / keep_factor``: by its evidence nothing pinned could
    stay), each block's evidence also counts as ``min(threshold *
    keep_factor, e * scale)`` (``scale`` = 1 / (``miss_contrast`` x fair
    share), as for read misses). Capped there, it holds a block the guest
    reads - a cycle without a read of it, common at such rates, gives 0 -
    but never outranks a block hot by its own residency (input up to 1),
    and a region ``keep_factor`` times hotter still displaces the pin.
    Blocks nobody reads get ``e = 0`` and cool at the normal decay.
    Where ``e`` is sampled from ``sample`` of a block's pages, a slow
    guest's page read per block per cycle is seen in one block of
    ``pages / sample`` (as 1/``sample``, cut down by the cap): the
    evidence is first pooled over that many pinned blocks around each
    (:func:`~vmcache.model.blocks.window_mean`), so the cap applies to a mean, not to a
    sampled spike. With all pages (the replay) nothing is pooled; pooled
    there too, it held blocks the guest left beside ones it still read
    (moving and zipf cost up to 1.4 points). Above
    the gate, evidence is left as it is: judged the same way there, it
    held pins that the absolute evidence rotated through a hot zone
    larger than the budget, and cost fast guests up to 2.3 points of hit
    ratio in the page-by-page replay (docs/replay.md).
    """
    p = params
    known = ~np.isnan(seen.value)
    count = int(np.count_nonzero(known))
    if count == 0:
        return seen
    mean_input = p.seen_scale * float(seen.value[known].sum(dtype=np.float64)) / count
    if mean_input >= p.threshold / p.keep_factor:
        return seen
    index, value = seen.index[known], seen.value[known]
    pages = p.block_size // PAGE_SIZE
    pooled = window_mean(index, value, 0 if sample is None else pages // max(1, min(sample, pages)) // 2)
    held = np.minimum(np.float32(p.threshold * p.keep_factor), pooled * scale) / np.float32(p.seen_scale)
    return BlockValues(index, np.maximum(value, held).astype(np.float32))
