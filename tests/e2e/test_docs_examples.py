"""The documentation's examples run: every ```python block preceded by
``<!-- docs-test: run -->`` in README.md and docs/*.md is executed against a real
trionserve serving the example repository, and every ```bash block preceded by
``<!-- docs-test: shell -->`` is run by bash (failing on the first command that
fails), so the docs cannot drift from the server.

The examples are written for the default ports (``localhost:8000`` HTTP,
``localhost:8001`` gRPC, ``localhost:8002`` metrics); the test's server listens on
free loopback ports and each block is run with those addresses substituted. The
server runs in EXPLICIT mode with every model loaded, so the examples that load and
unload models run too. Blocks run in document order, each in a fresh namespace.

The Grafana dashboard in docs/assets is checked the same way: every metric it
queries is documented on the Observability page and exported by the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.serverproc import ROOT, ServerProcess

MARKER = "<!-- docs-test: run -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\n```python\n(.*?)\n```", re.DOTALL)
SHELL_MARKER = "<!-- docs-test: shell -->"
_SHELL_BLOCK = re.compile(re.escape(SHELL_MARKER) + r"\n```bash\n(.*?)\n```", re.DOTALL)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DASHBOARD = ROOT / "docs" / "assets" / "grafana" / "trionserve-dashboard.json"


def runnable_blocks(pattern: re.Pattern = _BLOCK) -> list[tuple[str, str]]:
    """(page:line, source) of every block marked runnable, in document order."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start(1)) + 1
            blocks.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = runnable_blocks()
SHELL_BLOCKS = runnable_blocks(_SHELL_BLOCK)


def test_markers_are_all_found():
    """A marker that is not directly followed by a ```python block is a mistake
    (the block would silently go untested)."""
    for page in PAGES:
        text = page.read_text()
        assert text.count(MARKER) == len(_BLOCK.findall(text)), page
        assert text.count(SHELL_MARKER) == len(_SHELL_BLOCK.findall(text)), page
    assert len(BLOCKS) >= 8 and len(SHELL_BLOCKS) >= 2


@pytest.fixture(scope="module")
def docs_server():
    proc = ServerProcess(
        args=[
            "--model-control-mode=explicit",
            "--load-model=*",
            "--metrics-address=127.0.0.1",
            "--metrics-interval-ms=100",
            "--metrics-config=histogram_latencies=true",
        ]
    )
    try:
        proc.wait_ready(path="/v2/health/ready")
        yield proc
        code = proc.stop()
        assert code == 0, f"trionserve exited with {code}:\n{proc.output()}"
    finally:
        proc.close()


def _localize(source: str, proc: ServerProcess) -> str:
    for default, port in (
        ("8000", proc.http_port),
        ("8001", proc.grpc_port),
        ("8002", proc.metrics_port),
    ):
        source = source.replace(f"localhost:{default}", f"127.0.0.1:{port}")
    return source


@pytest.mark.parametrize("where, source", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_example_runs(docs_server, where, source, monkeypatch):
    monkeypatch.chdir(ROOT)  # examples name examples/model_repository relative to it
    code = compile(_localize(source, docs_server), where, "exec")
    exec(code, {"__name__": "__docs_example__"})


@pytest.mark.parametrize("where, source", SHELL_BLOCKS, ids=[where for where, _ in SHELL_BLOCKS])
def test_shell_example_runs(docs_server, where, source):
    for command in re.findall(r"(?:^|&&|\|\||;)\s*([A-Za-z][\w.-]*)", source, re.MULTILINE):
        if command not in ("python", "echo") and shutil.which(command) is None:
            pytest.skip(f"{command} is not installed")
    # `python` is the interpreter running the tests, as in an activated environment.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    script = f"set -euo pipefail\n{_localize(source, docs_server)}\n"
    result = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"


def _dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = set()
    for expr in exprs:
        names.update(re.findall(r"\b((?:nv|process)_[a-z_]+)", expr))
    # A histogram is queried through its _bucket series.
    return {name.removesuffix("_bucket") for name in names}


def test_dashboard_queries_documented_and_exported_metrics(docs_server):
    used = _dashboard_metrics()
    documented = set(
        re.findall(r"`((?:nv|process)_[a-z_]+)`", (ROOT / "docs/observability.md").read_text())
    )
    assert used <= documented, f"undocumented: {sorted(used - documented)}"

    def families() -> set[str]:
        url = f"http://127.0.0.1:{docs_server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        found = set(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
        return found if "nv_cpu_utilization" in found else set()

    exported = wait_for(families, "the CPU metrics' second sample")
    # GPU families need a GPU and NVML; cache families a model with the cache on.
    # Those are checked against the code that writes them instead.
    code = "".join(p.read_text() for p in (ROOT / "trionserve/observability").glob("*.py"))
    for name in sorted(used - exported):
        assert name.startswith(("nv_gpu_", "nv_cache_")), f"not exported: {name}"
        assert f'"{name}"' in code, f"no family named {name} in the code"
