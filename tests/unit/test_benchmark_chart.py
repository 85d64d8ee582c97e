"""benchmarks/chart.py: Markdown benchmark tables and runs drawn as SVG bar charts."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from benchmarks.chart import (
    Series,
    bar_chart,
    chart_from_cells,
    markdown_table_series,
    readme_chart,
)
from tests.serverproc import ROOT

TABLE = """Some text.

| workload | c | Triton infer/s | trionserve infer/s | x Triton |
| --- | ---: | ---: | ---: | ---: |
| HTTP | 1 | 4,000 | 2,000 | 0.50x |
| gRPC | 16 | 1,000 | - | - |
"""


def _bars(svg: str) -> dict[str, float]:
    """Bar heights by their tooltip (series, group: value)."""
    root = ET.fromstring(svg)
    bars = {}
    for rect in root.iter("{http://www.w3.org/2000/svg}rect"):
        title = rect.find("{http://www.w3.org/2000/svg}title")
        if title is not None:
            bars[title.text] = float(rect.get("height"))
    return bars


def test_markdown_table_series_reads_infer_columns():
    groups, series = markdown_table_series(TABLE)
    assert groups == ["HTTP c=1", "gRPC c=16"]
    assert [s.name for s in series] == ["Triton", "trionserve"]
    assert series[0].values == [4000.0, 1000.0]
    assert series[1].values == [2000.0, None]  # '-': not measured, no bar


def test_bars_are_proportional_and_missing_values_drawn_as_nothing():
    groups, series = markdown_table_series(TABLE)
    bars = _bars(bar_chart("t", groups, series, "infer/s"))
    assert len(bars) == 3
    http_triton = bars["Triton, HTTP c=1: 4,000 infer/s"]
    assert bars["trionserve, HTTP c=1: 2,000 infer/s"] == pytest.approx(http_triton / 2, abs=0.2)
    assert bars["Triton, gRPC c=16: 1,000 infer/s"] == pytest.approx(http_triton / 4, abs=0.2)


def test_text_is_escaped():
    svg = bar_chart("a < b & c", ["<g>"], [Series("x&y", [1.0])], "u")
    ET.fromstring(svg)  # well-formed
    assert "a &lt; b &amp; c" in svg


def test_a_table_without_two_infer_columns_is_not_charted():
    assert markdown_table_series("| a | b infer/s |\n| --- | --- |\n| x | 1 |\n") is None


def test_the_readme_has_a_table_to_chart():
    """The docs build charts benchmarks/README.md (scripts/mkdocs_hooks.py): its
    first table of infer/s columns must parse into bars."""
    svg = readme_chart(ROOT / "benchmarks" / "README.md")
    assert len(_bars(svg)) >= 2
    assert all(re.search(r"\d", title) for title in _bars(svg))


def test_a_run_is_charted_from_its_cells():
    """benchmarks.peers --chart: one group per workload and concurrency, one bar per
    server that served it."""
    from types import SimpleNamespace

    from benchmarks.matrix import Cell

    targets = [SimpleNamespace(label="trionserve"), SimpleNamespace(label="triton")]
    workloads = [SimpleNamespace(name="simple grpc")]
    cells = {
        ("simple grpc", 1, "trionserve"): Cell(requests=300, seconds=1.0),
        ("simple grpc", 1, "triton"): Cell(requests=600, seconds=1.0),
        ("simple grpc", 4, "trionserve"): Cell(requests=900, seconds=1.0),
    }
    bars = _bars(chart_from_cells(targets, workloads, [1, 4], cells))
    assert set(bars) == {
        "trionserve, simple grpc c=1: 300 infer/s",
        "triton, simple grpc c=1: 600 infer/s",
        "trionserve, simple grpc c=4: 900 infer/s",
    }
    assert bars["triton, simple grpc c=1: 600 infer/s"] == pytest.approx(
        2 * bars["trionserve, simple grpc c=1: 300 infer/s"], abs=0.2
    )
