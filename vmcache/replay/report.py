"""Replay results as a text table, JSON rows and a PNG plot of hit ratio against memory (Pillow, pure).

:func:`table` prints one row per budget and one column per policy (hit
ratio over all block accesses). :func:`plot_png` draws the same numbers:
memory on the x axis (log scale when the budgets span a factor of 4 or
more), hit ratio 0..1 on the y axis, one coloured line with dots per
policy, a legend. It returns PNG bytes; writing them is the caller's job.
"""

from __future__ import annotations

import io
import math
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from ..units import format_size
from .sim import PolicyResult

__all__ = ["table", "host_table", "rows_json", "plot_png", "COLOURS"]

COLOURS = {
    "vmcache": (31, 119, 180),   # blue: vmcache's pins (the heat-map palette)
    "lru": (214, 39, 40),        # red
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


def _ratio(r: PolicyResult, reads: bool, first: bool) -> str:
    if first:
        return f"{r.extra['head_hit_ratio']:.3f}" if "head_hit_ratio" in r.extra else "-"
    return f"{(r.read_hit_ratio if reads else r.hit_ratio):.3f}"


def table(results: list[PolicyResult], *, reads: bool = False, first: bool = False, corner: str = "budget") -> str:
    """The results as aligned text: ``budget`` (or ``corner``) then one hit-ratio column per policy.

    ``reads``: show read hit ratios instead of hit ratios over all accesses;
    ``first``: the hit ratios over the first seconds (``replay(head=...)``).
    """
    budgets, policies, cell = _grid(results)
    head = [corner] + policies
    lines = [head]
    for b in budgets:
        row = [format_size(b)]
        for p in policies:
            r = cell.get((b, p))
            row.append("-" if r is None else _ratio(r, reads, first))
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for line in lines:
        out.append("  ".join([line[0].ljust(widths[0])] + [c.rjust(max(w, 7)) for c, w in zip(line[1:], widths[1:])]))
    return "\n".join(out)


def host_table(results: list[Any]) -> str:
    """Host-mode results (vmcache.replay.host.HostResult) per VM: ``cap arm`` then ``hit ratio/mean grant`` per VM."""
    if not results:
        return ""
    names = list(results[0].vms)
    lines = [["cap", "arm"] + names]
    for r in results:
        cells = []
        for n in names:
            grant = r.grant_mean.get(n)
            cells.append(f"{r.vms[n].hit_ratio:.3f}" + (f"/{format_size(int(grant))}" if grant is not None else ""))
        lines.append([format_size(r.cap), r.arm] + cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def rows_json(results: list[PolicyResult]) -> list[dict[str, Any]]:
    return [r.to_json() for r in results]


def plot_png(results: list[PolicyResult], *, title: str = "", width: int = 800, height: int = 500,
             x_label: str = "memory (same for every policy)") -> bytes:
    """A PNG of hit ratio against memory, one line per policy. ValueError if there is nothing to plot."""
    budgets, policies, cell = _grid(results)
    if not budgets:
        raise ValueError("no results to plot")
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
        return bottom - (bottom - top) * v

    # axes and grid
    for i in range(11):
        y = fy(i / 10)
        draw.line([(left, y), (right, y)], fill=(225, 225, 225) if i else (0, 0, 0))
        draw.text((left - 8, y), f"{i / 10:.1f}", fill="black", font=font, anchor="rm")
    draw.line([(left, top), (left, bottom)], fill="black")
    for b in budgets:
        x = fx(b)
        draw.line([(x, bottom), (x, bottom + 5)], fill="black")
        draw.text((x, bottom + 8), format_size(b), fill="black", font=font, anchor="mt")
    draw.text(((left + right) / 2, height - 18), x_label + (", log scale" if logx else ""),
              fill="black", font=font, anchor="mm")
    draw.text((14, (top + bottom) / 2), "hit", fill="black", font=font, anchor="lm")
    draw.text((10, (top + bottom) / 2 + 14), "ratio", fill="black", font=font, anchor="lm")
    if title:
        draw.text(((left + right) / 2, 16), title, fill="black", font=font, anchor="mm")

    # one line per policy, legend on the right
    for p in reversed(policies):  # the first policy (vmcache) drawn last, on top
        colour = COLOURS.get(p, _FALLBACK)
        points = [(fx(b), fy(cell[(b, p)].hit_ratio)) for b in budgets if (b, p) in cell]
        if len(points) > 1:
            draw.line(points, fill=colour, width=3)
        for x, y in points:
            draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=colour)
    for n, p in enumerate(policies):
        colour = COLOURS.get(p, _FALLBACK)
        ly = top + 10 + 22 * n
        draw.line([(right + 20, ly), (right + 50, ly)], fill=colour, width=3)
        draw.ellipse([right + 31, ly - 4, right + 39, ly + 4], fill=colour)
        draw.text((right + 58, ly), p, fill="black", font=font, anchor="lm")

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
