"""Every benchmark module still starts: ``python -m benchmarks.NAME --help`` (and
each investigation's) imports the module and its dependencies, builds its parser
and prints its usage, run in-process as ``python -m`` runs it."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def runnable_modules() -> list[str]:
    """Each module under benchmarks/ that a user runs with ``python -m``: a module
    (or a package's ``__main__.py``) with a ``__main__`` guard and an argparse
    command line. (The peers' own server scripts, run by benchmarks.peers inside
    each peer's environment, take positional ports and no ``--help``.)"""
    names = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        text = path.read_text()
        if 'if __name__ == "__main__":' not in text or "argparse" not in text:
            continue
        parts = list(path.relative_to(BENCHMARKS.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            parts.pop()
        names.append(".".join(parts))
    return names


MODULES = runnable_modules()


def test_the_benchmarks_a_user_runs_are_found():
    for name in ("peers", "served_vs_direct", "transports", "python_backend", "openai_stream"):
        assert f"benchmarks.{name}" in MODULES
    assert "benchmarks.investigations.ipc_floor" in MODULES
    assert "benchmarks.loadgen" not in MODULES  # a library: nothing to run


# A module already imported by another test is run anew, as python -m would.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
@pytest.mark.parametrize("module", MODULES)
def test_help(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert out.startswith("usage: "), out
