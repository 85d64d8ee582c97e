"""Benchmark tables as SVG bar charts, with no plotting library.

A chart is groups of bars: one group per table row (a workload at a concurrency),
one bar per server (a series), the bar's height its infer/s. ``bar_chart`` writes
the SVG text; two sources feed it:

- a run's own cells (``chart_from_cells``): ``python -m benchmarks.peers --chart
  PATH`` writes the chart of the run it just made;
- a Markdown table (``markdown_table_series``): every column whose header ends in
  ``infer/s`` is a series, the first two columns name the group. The docs build
  (``scripts/mkdocs_hooks.py``) charts the first such table of benchmarks/README.md this way,
  so the chart on the Performance page is always the table beside it.

Usage:
    python -m benchmarks.chart [--readme benchmarks/README.md] [--out chart.svg]
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

# Colour-blind-safe (Okabe-Ito), one per series in order.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")
_WIDTH = 760
_PLOT_TOP = 56
_PLOT_HEIGHT = 240
_LEFT = 64
_RIGHT = 16


@dataclass(frozen=True)
class Series:
    """One server's values, one per group (None: not measured)."""

    name: str
    values: Sequence[float | None]


def _nice_step(maximum: float, ticks: int = 5) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) for an axis up to ``maximum``."""
    raw = maximum / ticks if maximum > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.3g}"


def bar_chart(title: str, groups: Sequence[str], series: Sequence[Series], unit: str) -> str:
    """The SVG text of a grouped bar chart."""
    if not groups or not series:
        raise ValueError("a chart needs at least one group and one series")
    for one in series:
        if len(one.values) != len(groups):
            raise ValueError(
                f"series {one.name!r} has {len(one.values)} values for {len(groups)} groups"
            )
    top = max((v for s in series for v in s.values if v is not None), default=0.0)
    step = _nice_step(top)
    axis_top = step * max(1, math.ceil(top / step))
    plot_width = _WIDTH - _LEFT - _RIGHT
    group_width = plot_width / len(groups)
    bar_width = min(48.0, group_width * 0.8 / len(series))
    bottom = _PLOT_TOP + _PLOT_HEIGHT
    legend_y = bottom + 48
    height = legend_y + 20 * math.ceil(len(series) / 3) + 8

    def y(value: float) -> float:
        return bottom - value / axis_top * _PLOT_HEIGHT

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_WIDTH} {height}" '
        f'width="{_WIDTH}" height="{height}" font-family="sans-serif" font-size="12" '
        f'role="img" aria-label="{escape(title)}">',
        f'<rect width="{_WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{_WIDTH / 2}" y="24" text-anchor="middle" font-size="15" '
        f'font-weight="bold">{escape(title)}</text>',
        f'<text x="16" y="{_PLOT_TOP + _PLOT_HEIGHT / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {_PLOT_TOP + _PLOT_HEIGHT / 2})">{escape(unit)}</text>',
    ]
    tick = 0.0
    while tick <= axis_top + step / 2:
        parts.append(
            f'<line x1="{_LEFT}" y1="{y(tick):.1f}" x2="{_WIDTH - _RIGHT}" y2="{y(tick):.1f}" '
            'stroke="#dddddd"/>'
        )
        parts.append(
            f'<text x="{_LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" '
            f'fill="#555555">{_number(tick)}</text>'
        )
        tick += step
    for g, group in enumerate(groups):
        left = _LEFT + g * group_width + (group_width - bar_width * len(series)) / 2
        for s, one in enumerate(series):
            value = one.values[g]
            x = left + s * bar_width
            if value is None:
                continue
            parts.append(
                f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{bar_width - 2:.1f}" '
                f'height="{bottom - y(value):.1f}" fill="{COLOURS[s % len(COLOURS)]}">'
                f"<title>{escape(f'{one.name}, {group}: {_number(value)} {unit}')}</title></rect>"
            )
            parts.append(
                f'<text x="{x + (bar_width - 2) / 2:.1f}" y="{y(value) - 4:.1f}" '
                f'text-anchor="middle" font-size="10" fill="#333333">{_number(value)}</text>'
            )
        parts.append(
            f'<text x="{_LEFT + (g + 0.5) * group_width:.1f}" y="{bottom + 18}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
    parts.append(
        f'<line x1="{_LEFT}" y1="{bottom}" x2="{_WIDTH - _RIGHT}" y2="{bottom}" stroke="#555555"/>'
    )
    for s, one in enumerate(series):
        x = _LEFT + (s % 3) * (plot_width / 3)
        row_y = legend_y + 20 * (s // 3)
        parts.append(
            f'<rect x="{x:.1f}" y="{row_y - 10}" width="12" height="12" '
            f'fill="{COLOURS[s % len(COLOURS)]}"/>'
        )
        parts.append(f'<text x="{x + 18:.1f}" y="{row_y}">{escape(one.name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def chart_from_cells(targets, workloads, concurrencies, cells) -> str:
    """The chart of a benchmarks.matrix run: infer/s per workload and concurrency."""
    groups = [(w.name, c) for w in workloads for c in concurrencies]
    series = []
    for target in targets:
        values: list[float | None] = []
        for name, concurrency in groups:
            cell = cells.get((name, concurrency, target.label))
            values.append(cell.throughput if cell is not None and cell.requests else None)
        series.append(Series(target.label, values))
    labels = [f"{name} c={c}" for name, c in groups]
    return bar_chart("Inferences per second, one run", labels, series, "infer/s")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _value(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def markdown_table_series(text: str) -> tuple[list[str], list[Series]] | None:
    """Groups and series of the first Markdown table in ``text`` with at least two
    columns whose header ends in ``infer/s`` (None if there is none)."""
    lines = text.splitlines()
    for at, line in enumerate(lines[:-1]):
        if not line.startswith("|") or not re.fullmatch(r"[|\s:-]+", lines[at + 1]):
            continue
        header = _cells(line)
        columns = [i for i, name in enumerate(header) if name.endswith("infer/s")]
        if len(columns) < 2 or (at > 0 and lines[at - 1].startswith("|")):
            continue
        rows = []
        for row_line in lines[at + 2 :]:
            if not row_line.startswith("|"):
                break
            rows.append(_cells(row_line))
        groups = [f"{row[0]} c={row[1]}" for row in rows]
        series = [
            Series(header[i].removesuffix("infer/s").strip(), [_value(row[i]) for row in rows])
            for i in columns
        ]
        return groups, series
    return None


def readme_chart(readme: Path) -> str:
    """The chart of the first table of infer/s columns in a benchmarks README."""
    found = markdown_table_series(readme.read_text())
    if found is None:
        raise ValueError(f"{readme}: no table with two or more 'infer/s' columns")
    groups, series = found
    return bar_chart(
        "Inferences per second (latest run in benchmarks/README.md)", groups, series, "infer/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=Path(__file__).with_name("README.md"))
    parser.add_argument("--out", type=Path, default=Path("chart.svg"))
    args = parser.parse_args()
    args.out.write_text(readme_chart(args.readme))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
