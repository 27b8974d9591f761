"""Referenced bits of pinned pages on the real kernel: exactly the pages something read."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vmcache.host.pagerefs import PageRefs
from vmcache.host.pinner import Pinner
from vmcache.model.heat import HeatModel
from vmcache.model.params import ModelParams
from vmcache.model.region import Region

from tests.pagecache_util import fake_meminfo

MiB = 1 << 20
PAGE = 4096


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """32 MiB written a page at a time: its page-cache folios are single pages.

    The kernel keeps the referenced flag per folio, and folios made by large
    writes or readahead can be up to 2 MiB: the evidence vmcache gets is at
    that resolution. Single-page folios let the test check it page by page.
    """
    path = tmp_path / "disk.img"
    data = os.urandom(PAGE)
    with open(path, "wb", buffering=0) as f:
        for _ in range(32 * MiB // PAGE):
            f.write(data)
    return path


def test_reads_through_another_descriptor_mark_exactly_the_pages_read(image: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("PFNs in /proc/self/pagemap need root")
    refs = PageRefs()
    with Pinner(image, floor_bytes=0, meminfo=fake_meminfo(64 << 30)) as pin:
        pin.apply([Region(4 * MiB, 8 * MiB, 1.0)], 1 << 30)
        refs.clear()
        fd = os.open(image, os.O_RDONLY)
        try:
            # all of block 5, the first half of block 7 (the kernel keeps the flag per
            # folio, and a file's folios may be larger than a page: a half block is
            # a half whatever their size)
            for block, pages in ((5, MiB // PAGE), (7, MiB // PAGE // 2)):
                for page in range(pages):
                    os.pread(fd, PAGE, block * MiB + page * PAGE)
        finally:
            os.close(fd)
        seen = pin.read_evidence(MiB, 32, refs, phase=1).to_dense(32, fill=np.nan)
        assert np.isnan(seen[:4]).all() and np.isnan(seen[12:]).all()  # not pinned: no evidence
        assert seen[5] == 1.0
        assert seen[7] == 0.5
        assert seen[[4, 6, 8, 9, 10, 11]].tolist() == [0.0] * 6
        refs.clear()
        evidence = pin.read_evidence(MiB, 32, refs)
        assert evidence.index.tolist() == list(range(4, 12)) and not evidence.value.any()


def test_strided_reads_are_seen_as_the_share_of_pages_they_read(image: Path) -> None:
    """A guest reading one page in 16 reads a sixteenth of each block, whatever the sample's phase."""
    if os.geteuid() != 0:
        pytest.skip("PFNs in /proc/self/pagemap need root")
    refs = PageRefs()
    with Pinner(image, floor_bytes=0, meminfo=fake_meminfo(64 << 30)) as pin:
        pin.apply([Region(0, 32 * MiB, 1.0)], 1 << 30)
        means = []
        for phase in range(4):
            refs.clear()
            fd = os.open(image, os.O_RDONLY)
            try:
                for page in range(3 * phase % 16, 32 * MiB // PAGE, 16):
                    os.pread(fd, PAGE, page * PAGE)
            finally:
                os.close(fd)
            means.append(float(pin.read_evidence(MiB, 32, refs, per_block=16, phase=phase).value.mean()))
        # 512 pages sampled a call, each read with chance 1/16: 32 expected, 5.5 its deviation
        assert all(1 / 32 < m < 1 / 8 for m in means), means  # a sample aliased to the stride saw 0 or 1


def test_a_pin_that_starts_inside_a_block_samples_that_block_s_own_pages(image: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("PFNs in /proc/self/pagemap need root")
    refs = PageRefs()
    with Pinner(image, floor_bytes=0, meminfo=fake_meminfo(64 << 30)) as pin:
        pin.apply([Region(4 * MiB + MiB // 2, 2 * MiB, 1.0)], 1 << 30)  # the second half of block 4 to half of 6
        refs.clear()
        fd = os.open(image, os.O_RDONLY)
        try:
            for page in range(MiB // PAGE):  # all of block 5, nothing of 4 or 6
                os.pread(fd, PAGE, 5 * MiB + page * PAGE)
        finally:
            os.close(fd)
        seen = pin.read_evidence(MiB, 32, refs, phase=3)
        assert seen.index.tolist() == [4, 5, 6] and seen.value.tolist() == [0.0, 1.0, 0.0]


def test_without_pfns_there_is_no_evidence(image: Path) -> None:
    refs = PageRefs(kpageflags="/nonexistent")
    with Pinner(image, floor_bytes=0, meminfo=fake_meminfo(64 << 30)) as pin:
        pin.apply([Region(0, 4 * MiB, 1.0)], 1 << 30)
        assert pin.read_evidence(MiB, 32, refs).index.size == 0


def test_model_judges_pinned_blocks_by_their_evidence() -> None:
    p = ModelParams(block_size=MiB, interval=1.0, decay=0.5, pinned_decay=0.99, read_sigma=0.0, write_sigma=0.0)
    n = 8
    ours = np.zeros(n, dtype=bool)
    ours[2:6] = True
    model = HeatModel(p, n)
    model.step(np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, bool), 1.0)
    seen = np.full(n, np.nan, dtype=np.float32)
    seen[2:4] = 0.5   # still read: min(1, 4 * 0.5) = 1
    seen[4:6] = 0.0   # pinned, nobody read them
    for t in range(2, 8):
        heat = model.step(np.ones(n, np.float32), np.zeros(n, np.float32), ours, float(t), seen=seen)
    assert heat[2] == pytest.approx(heat[0], rel=1e-3)        # as hot as guest-resident blocks
    assert heat[4] < 0.02                                     # cooled at decay 0.5, not held at 0.99
    held = HeatModel(p, n)
    held.step(np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, bool), 1.0)
    for t in range(2, 8):
        blind = held.step(np.ones(n, np.float32), np.zeros(n, np.float32), ours, float(t))
    assert blind[4] > 0.4                                     # without evidence: held
