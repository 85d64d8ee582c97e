"""MkDocs hooks (mkdocs.yml ``hooks``): files the documentation build generates.

``assets/benchmarks/latest.svg``: the chart of the latest benchmark table in
benchmarks/README.md, drawn by benchmarks/chart.py at every build, so the chart on
the Performance page never disagrees with the table printed beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.chart import readme_chart  # noqa: E402

CHART = "assets/benchmarks/latest.svg"


def on_files(files, config):
    chart = readme_chart(ROOT / "benchmarks" / "README.md")
    files.append(File.generated(config, CHART, content=chart))
    return files
