"""Replay results as a text table, JSON rows and a PNG plot against memory (Pillow, pure).

:func:`table` prints one row per budget and one column per policy, of one
measure (:data:`MEASURES`: device reads per request by default, the
headline; read hit ratio; hit ratio over all accesses; vmcache's loads and
their use). :func:`plot_png`
draws device reads per request: memory on the x axis (log scale when the
budgets span a factor of 4 or more), one coloured line with dots per
policy, a legend. It returns PNG bytes; writing them is the caller's job.
"""

from __future__ import annotations

import io
import math
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from ..units import format_size
from .measures import PolicyResult
from .restartreport import aligned

__all__ = ["MEASURES", "table", "host_table", "rows_json", "plot_png", "COLOURS"]

MEASURES = {
    "reads": "device reads per guest request",
    "read_hits": "read hit ratio",
    "hits": "hit ratio over all accesses",
    "loads": "cache units vmcache's pins loaded per guest request",
    "load_use": "share of those loads the guest read within 2 minutes",
}

COLOURS = {
    "vmcache": (31, 119, 180),   # blue: vmcache's pins (the heat-map palette)
    "inferred": (148, 103, 189),  # purple: vmcache without read counts
    "lru": (214, 39, 40),        # red
    "linux": (255, 187, 120),    # light orange: the kernel's lists
    "belady": (90, 90, 90),      # grey: the bound
    "static": (44, 160, 44),     # green
    "warm": (23, 190, 207),      # cyan: vmcache warm-started
    # host mode
    "first-come": (255, 127, 14),  # orange
    "equal": (140, 86, 75),        # brown
    "proportional": (227, 119, 194),  # pink
    "benefit": (31, 119, 180),     # blue: vmcache's split
}
_FALLBACK = (148, 103, 189)


def _grid(results: list[PolicyResult]) -> tuple[list[int], list[str], dict[tuple[int, str], PolicyResult]]:
    budgets = sorted({r.budget for r in results})
    policies: list[str] = []
    for r in results:
        if r.policy not in policies:
            policies.append(r.policy)
    return budgets, policies, {(r.budget, r.policy): r for r in results}


def _cell(r: PolicyResult, measure: str, first: bool) -> str:
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r} (known: {', '.join(MEASURES)})")
    if first:
        key = {"reads": "head_reads_per_request", "read_hits": "head_read_hit_ratio"}.get(measure, "")
        return f"{r.extra[key]:.4f}" if key in r.extra else "-"
    if measure == "reads":
        return f"{r.reads_per_request:.4f}"
    if measure == "loads":
        return f"{r.extra['loaded_per_request']:.4f}" if "loaded_per_request" in r.extra else "-"
    if measure == "load_use":
        return f"{r.extra['loaded_read_share']:.3f}" if r.extra.get("loaded_units") else "-"
    return f"{(r.read_hit_ratio if measure == 'read_hits' else r.hit_ratio):.3f}"


def table(results: list[PolicyResult], *, measure: str = "reads", first: bool = False, corner: str = "budget") -> str:
    """The results as aligned text: ``budget`` (or ``corner``) then one column per policy, of ``measure``.

    ``measure``: a key of :data:`MEASURES`; ``first``: the figures over the
    first seconds (``replay(head=...)``). ValueError for an unknown measure.
    """
    budgets, policies, cell = _grid(results)
    head = [corner] + policies
    lines = [head]
    for b in budgets:
        row = [format_size(b)]
        for p in policies:
            r = cell.get((b, p))
            row.append("-" if r is None else _cell(r, measure, first))
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for line in lines:
        out.append("  ".join([line[0].ljust(widths[0])] + [c.rjust(max(w, 7)) for c, w in zip(line[1:], widths[1:])]))
    return "\n".join(out)


def host_table(results: list[Any]) -> str:
    """Host-mode results (vmcache.replay.host.HostResult) per VM: ``cap arm``, then per VM device reads per request
    and the mean grant."""
    if not results:
        return ""
    names = list(results[0].vms)
    lines = [["cap", "arm"] + names]
    for r in results:
        cells = []
        for n in names:
            grant = r.grant_mean.get(n)
            shown = f"/{format_size(int(grant))}" if grant is not None else ""
            cells.append(f"{r.vms[n].reads_per_request:.4f}{shown}")
        lines.append([format_size(r.cap), r.arm] + cells)
    return aligned(lines, left=2)


def rows_json(results: list[PolicyResult]) -> list[dict[str, Any]]:
    return [r.to_json() for r in results]


def plot_png(results: list[PolicyResult], *, title: str = "", width: int = 800, height: int = 500,
             x_label: str = "memory (same for every policy)") -> bytes:
    """A PNG of device reads per request against memory, one line per policy. ValueError if nothing to plot."""
    budgets, policies, cell = _grid(results)
    if not budgets:
        raise ValueError("no results to plot")
    scale = _axis_top(max(r.reads_per_request for r in results))
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    left, right, top, bottom = 70, width - 150, 40, height - 60
    logx = len(budgets) > 1 and budgets[0] > 0 and budgets[-1] / budgets[0] >= 4

    def fx(b: int) -> float:
        lo, hi = budgets[0], budgets[-1]
        if lo == hi:
            return (left + right) / 2
        if logx:
            return left + (right - left) * (math.log(b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return left + (right - left) * (b - lo) / (hi - lo)

    def fy(v: float) -> float:
        return bottom - (bottom - top) * v / scale

    # axes and grid
    for i in range(11):
        y = fy(scale * i / 10)
        draw.line([(left, y), (right, y)], fill=(225, 225, 225) if i else (0, 0, 0))
        draw.text((left - 8, y), f"{scale * i / 10:.3g}", fill="black", font=font, anchor="rm")
    draw.line([(left, top), (left, bottom)], fill="black")
    for b in budgets:
        x = fx(b)
        draw.line([(x, bottom), (x, bottom + 5)], fill="black")
        draw.text((x, bottom + 8), format_size(b), fill="black", font=font, anchor="mt")
    draw.text(((left + right) / 2, height - 18), x_label + (", log scale" if logx else ""),
              fill="black", font=font, anchor="mm")
    draw.text((6, (top + bottom) / 2), "device", fill="black", font=font, anchor="lm")
    draw.text((6, (top + bottom) / 2 + 14), "reads /", fill="black", font=font, anchor="lm")
    draw.text((6, (top + bottom) / 2 + 28), "request", fill="black", font=font, anchor="lm")
    if title:
        draw.text(((left + right) / 2, 16), title, fill="black", font=font, anchor="mm")

    # one line per policy, legend on the right
    for p in reversed(policies):  # the first policy (vmcache) drawn last, on top
        colour = COLOURS.get(p, _FALLBACK)
        points = [(fx(b), fy(cell[(b, p)].reads_per_request)) for b in budgets if (b, p) in cell]
        if len(points) > 1:
            draw.line(points, fill=colour, width=3)
        for x, y in points:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
    _legend(draw, policies, right + 20, top + 10, font)

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _axis_top(value: float) -> float:
    """The y axis's top for a largest ``value``: the power of ten above it, or half that when it fits."""
    scale = 10 ** math.ceil(math.log10(value)) if value > 0 else 1.0
    return scale / 2 if value <= scale / 2 else scale


def _legend(draw: ImageDraw.ImageDraw, policies: list[str], x: float, y: float, font: Any) -> None:
    """Each policy's line, dot and name, one under the other from (``x``, ``y``)."""
    for n, p in enumerate(policies):
        colour = COLOURS.get(p, _FALLBACK)
        ly = y + 22 * n
        draw.line([(x, ly), (x + 30, ly)], fill=colour, width=3)
        draw.ellipse([x + 11, ly - 4, x + 19, ly + 4], fill=colour)
        draw.text((x + 38, ly), p, fill="black", font=font, anchor="lm")
