"""Heat-map pictures and JSON: colours where the blocks are, layout options, round trips."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vmcache.observe.heatmap import (
    HeatmapData,
    HeatmapWriter,
    RenderOptions,
    block_pixel,
    cell_colours,
    heatmap_from_json,
    heatmap_page,
    heatmap_json,
    layout,
    offset_label,
    pinned_regions,
    render_image,
    render_png,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BS = 64 * KiB
WHEN = datetime(2025, 3, 1, 12, 30, 5, tzinfo=timezone.utc)


def data(size: int = 64 * MiB, **marks: list[int]) -> HeatmapData:
    """A disk with every block cold and empty but those marked.

    marks: pinned=[blocks], guest=[blocks], written=[blocks], hot=[blocks]
    """
    n = -(-size // BS)
    heat = np.zeros(n, np.float32)
    pinned = np.zeros(n, bool)
    resident = np.zeros(n, np.float32)
    written = np.zeros(n, np.float32)
    pinned[marks.get("pinned", [])] = True
    resident[marks.get("guest", [])] = 1.0
    written[marks.get("written", [])] = 1.0
    heat[marks.get("hot", [])] = 1.0
    heat[marks.get("warm", [])] = 0.2
    return HeatmapData(heat, pinned, resident, written, BS, size, "vda", title="web1",
                       image="/images/web1.raw", when=WHEN)


def pixel(d: HeatmapData, block: int, options: RenderOptions = RenderOptions()) -> tuple[int, int, int]:
    img = Image.open(io.BytesIO(render_png(d, options))).convert("RGB")
    return img.getpixel(block_pixel(d, block, options))  # type: ignore[return-value]


def test_png_is_a_png_with_the_expected_pixels_in_the_papers_palette() -> None:
    d = data(pinned=[10], guest=[200], written=[500], hot=[10, 200, 500])
    r, g, b = pixel(d, 10)
    assert b > 200 and r < 40 and g < 40, (r, g, b)       # pinned: blue
    r, g, b = pixel(d, 200)
    assert g > 200 and r < 40 and b < 40, (r, g, b)       # guest-loaded: green
    r, g, b = pixel(d, 500)
    assert r > 200 and g < 40 and b < 40, (r, g, b)       # written: red
    r, g, b = pixel(d, 700)
    assert max(r, g, b) < 60 and max(r, g, b) - min(r, g, b) < 8  # nothing: dark grey


def test_colours_mix_for_blocks_in_two_states() -> None:
    d = data(pinned=[1], guest=[2], written=[1, 2], hot=[1, 2])
    r, g, b = pixel(d, 1)
    assert r > 200 and b > 200 and g < 40                 # pinned + written: magenta
    r, g, b = pixel(d, 2)
    assert r > 200 and g > 200 and b < 40                 # guest + written: yellow


def test_brightness_follows_heat() -> None:
    d = data(pinned=[1, 2, 3], hot=[1], warm=[2])
    hot, warm, cold = (pixel(d, i)[2] for i in (1, 2, 3))
    assert hot > warm > cold > 60                          # even a cold pinned block stays visibly blue
    # With a fixed heat scale the same block is dimmer when the scale is higher.
    dim = pixel(d, 1, RenderOptions(heat_scale=10.0))[2]
    assert dim < hot


def test_uncached_but_warm_blocks_are_lighter_grey_than_cold_ones() -> None:
    d = data(hot=[5])
    warm, cold = pixel(d, 5), pixel(d, 6)
    assert warm[0] > cold[0] + 20
    assert warm[0] == warm[1] == warm[2]


def test_blocks_are_laid_out_in_rows_from_the_top_left() -> None:
    d = data()
    lay = layout(d.nblocks, d.block_size)
    assert lay.cell_of(0) == (0, 0)
    assert lay.cell_of(lay.cols) == (0, 1)
    x0, y0 = block_pixel(d, 0)
    x1, y1 = block_pixel(d, 1)
    x2, y2 = block_pixel(d, lay.cols)
    assert (x1 > x0, y1 == y0) == (True, True)
    assert (x2 == x0, y2 > y0) == (True, True)
    # Every row covers 2^k or 3 * 2^k bytes, so the scale reads in round numbers.
    unit = lay.row_bytes // 3 if lay.row_bytes % 3 == 0 else lay.row_bytes
    assert unit & (unit - 1) == 0


@pytest.mark.parametrize("aspect", [0.5, 1.0, 1.5, 2.0, 4.0])
@pytest.mark.parametrize("nblocks", [1 << 15, 1 << 14, 10_000, 777])
def test_map_aspect_follows_the_option(aspect: float, nblocks: int) -> None:
    lay = layout(nblocks, BS, RenderOptions(aspect=aspect, max_width=4096, max_height=4096))
    assert 1 / 1.5 <= (lay.cols / lay.rows) / aspect <= 1.5


def test_image_size_follows_blocks_per_pixel_and_scale() -> None:
    d = data(size=256 * MiB)                                      # 4096 blocks
    small = render_image(d, RenderOptions(blocks_per_pixel=4, scale=2, aspect=1.0, legend=False))
    big = render_image(d, RenderOptions(blocks_per_pixel=1, scale=2, aspect=1.0, legend=False))
    lay_s = layout(d.nblocks, BS, RenderOptions(blocks_per_pixel=4, scale=2, aspect=1.0))
    lay_b = layout(d.nblocks, BS, RenderOptions(blocks_per_pixel=1, scale=2, aspect=1.0))
    assert (lay_s.cols * lay_s.rows, lay_b.cols * lay_b.rows) == (1024, 4096)
    assert big.height - small.height == (lay_b.rows - lay_s.rows) * 2
    scaled = render_image(d, RenderOptions(blocks_per_pixel=1, scale=4, aspect=1.0, legend=False))
    assert scaled.height - big.height == lay_b.rows * 2
    with_legend = render_image(d, RenderOptions(blocks_per_pixel=1, scale=2, aspect=1.0))
    assert with_legend.height > big.height + 60


def test_automatic_blocks_per_pixel_keeps_a_huge_disk_within_bounds() -> None:
    n = (1 << 40) // BS                                           # 1 TiB: 16M blocks
    lay = layout(n, BS)
    assert lay.blocks_per_cell > 1
    assert lay.cols * lay.scale <= 1024 and lay.rows * lay.scale <= 768
    d = HeatmapData(np.zeros(n, np.float32), np.zeros(n, bool), np.zeros(n, np.float32),
                    np.zeros(n, np.float32), BS, 1 << 40, "vdb")
    img = render_image(d)
    assert img.width <= 1300 and img.height <= 1000


def test_aggregated_cell_shows_a_single_written_block() -> None:
    d = data(written=[9], hot=[9])
    opts = RenderOptions(blocks_per_pixel=16)
    r, g, b = pixel(d, 9, opts)
    assert r > 200 and g < 40 and b < 40


def test_cells_past_the_end_of_the_image_are_page_white_not_cold_grey() -> None:
    size = 10 * BS + 100                                             # 11 blocks, last partial
    d = data(size=size)
    lay = layout(d.nblocks, BS, RenderOptions(aspect=1.0))
    colours = cell_colours(d, lay)
    flat = colours.reshape(-1, 3)
    assert (flat[: d.nblocks] < 60).all()
    assert (flat[d.nblocks:] == 255).all() and len(flat) > d.nblocks


def test_picture_has_title_legend_and_scale_areas() -> None:
    d = data(pinned=[0], hot=[0])
    img = render_image(d)
    x, y = block_pixel(d, 0)
    arr = np.asarray(img)
    assert arr[:y - 10].min() < 80                                   # title text above the map (dark ink)
    assert arr[:, : x - 10].min() < 80                               # offset labels left of the map
    legend = arr[y + 400:]                                           # below the map: the swatches
    blue = (legend[..., 2] > 200) & (legend[..., 0] < 40) & (legend[..., 1] < 40)
    red = (legend[..., 0] > 200) & (legend[..., 1] < 40) & (legend[..., 2] < 40)
    assert blue.any() and red.any()


def test_offset_labels_are_exact() -> None:
    assert [offset_label(v) for v in (0, 256 * MiB, 1280 * MiB, 3 * GiB, 1 << 40, 64 * KiB, 100)] == [
        "0", "256MiB", "1.25GiB", "3GiB", "1TiB", "64KiB", "100B"]


def test_mismatched_arrays_are_rejected() -> None:
    with pytest.raises(ValueError, match="heat has shape"):
        HeatmapData(np.zeros(3), np.zeros(4, bool), np.zeros(4), np.zeros(4), BS, 4 * BS, "vda")
    with pytest.raises(ValueError, match="non-negative"):
        HeatmapData(-np.ones(4), np.zeros(4, bool), np.zeros(4), np.zeros(4), BS, 4 * BS, "vda")


# --- JSON --------------------------------------------------------------


def test_json_regions_are_exact_pinned_runs_clipped_to_the_image() -> None:
    size = 20 * BS + 4096
    d = data(size=size, pinned=[2, 3, 4, 10, 20])
    assert pinned_regions(d) == [(2 * BS, 3 * BS), (10 * BS, BS), (20 * BS, 4096)]
    doc = heatmap_json(d)
    assert doc["regions"] == [{"start": 2 * BS, "length": 3 * BS}, {"start": 10 * BS, "length": BS},
                              {"start": 20 * BS, "length": 4096}]


def test_json_round_trips_through_text_and_back_to_the_same_picture() -> None:
    rng = np.random.default_rng(7)
    n = 1024
    d = HeatmapData(np.round(rng.random(n), 4), rng.random(n) > 0.8, np.round(rng.random(n), 4) * (rng.random(n) > 0.5),
                    (rng.random(n) > 0.9).astype(np.float32), BS, n * BS, "vda", title="web1",
                    image="/images/web1.raw", when=WHEN)
    doc = json.loads(json.dumps(heatmap_json(d)))
    assert doc["bucket_size"] == BS and len(doc["buckets"]["heat"]) == n
    back = heatmap_from_json(doc)
    np.testing.assert_allclose(back.heat, d.heat, atol=1e-4)
    np.testing.assert_array_equal(back.pinned, d.pinned)
    np.testing.assert_allclose(back.resident, d.resident, atol=1e-4)
    np.testing.assert_array_equal(back.written, d.written)
    assert (back.disk, back.title, back.image, back.when, back.image_size) == (
        "vda", "web1", "/images/web1.raw", WHEN, n * BS)
    assert heatmap_json(back) == doc
    assert render_png(back) == render_png(d)


def test_json_buckets_aggregate_large_disks() -> None:
    d = data(size=64 * MiB, written=[5], hot=[5], pinned=list(range(0, 8)))   # 1024 blocks
    doc = heatmap_json(d, max_buckets=128)                                      # 8 blocks a bucket
    assert doc["bucket_size"] == 8 * BS
    b = doc["buckets"]
    assert len(b["heat"]) == 128
    assert (b["heat"][0], b["written"][0], b["pinned"][0]) == (1.0, 1.0, 1.0)
    assert (b["heat"][1], b["pinned"][1]) == (0.0, 0.0)


def test_from_json_rejects_other_documents() -> None:
    with pytest.raises(ValueError):
        heatmap_from_json({"format": "something-else"})


def test_writer_writes_every_nth_cycle_and_builds_data_only_then(tmp_path: Path) -> None:
    png, js = tmp_path / "vda.png", tmp_path / "vda.json"
    built = []

    def make() -> HeatmapData:
        built.append(1)
        return data(pinned=[len(built)], hot=[len(built)])

    w = HeatmapWriter(png, json_path=js, every=3)
    wrote = [w.cycle(make) for _ in range(7)]
    assert wrote == [False, False, True, False, False, True, False]
    assert len(built) == 2
    assert Image.open(png).format == "PNG"
    assert json.loads(js.read_text())["regions"] == [{"start": 2 * BS, "length": BS}]


def test_heatmap_page_serves_png_and_json_of_known_disks_only() -> None:
    n = 64
    data = HeatmapData(heat=np.linspace(0, 1, n, dtype=np.float32), pinned=np.arange(n) < 8,
                       resident=np.zeros(n, dtype=np.float32), written=np.zeros(n, dtype=np.float32),
                       block_size=1 << 20, image_size=n << 20, disk="vda")
    lookup = {"vda": data}.get
    page = heatmap_page("/heatmap/vda.png", lookup)
    assert page is not None
    kind, body = page
    assert kind == "image/png" and body.startswith(b"\x89PNG")
    page = heatmap_page("/heatmap/vda.json", lookup)
    assert page is not None
    kind, body = page
    assert kind == "application/json" and json.loads(body)["disk"] == "vda"
    for path in ("/heatmap/vdb.png", "/heatmap/vda.gif", "/heatmap/vda", "/other/vda.png", "/heatmap/"):
        assert heatmap_page(path, lookup) is None, path


def test_the_engine_and_the_data_type_do_not_load_pillow() -> None:
    """HeatmapData is a data type: the engine builds it every cycle, only the renderer needs Pillow."""
    code = ("import sys, vmcache.service.engine, vmcache.service.diskworker, vmcache.service.app; "
            "from vmcache.observe.heatmap import HeatmapData; "
            "sys.exit(1 if [m for m in sys.modules if m.split('.')[0] == 'PIL'] else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    code = "import sys; from vmcache.observe.heatmap import render_png; sys.exit(0 if 'PIL' in sys.modules else 1)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # the check above can fail
