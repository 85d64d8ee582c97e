"""The built documentation site is self-contained: opened from disk (file://) in a
headless Chromium with every network request refused, both Mermaid diagrams of the
Architecture page render to SVG and search finds pages.

The site is built with ``mkdocs build --strict`` (the ``docs`` extra). Without a
Chromium on PATH (``chromium``, ``chromium-browser``, ``google-chrome``) the browser
checks skip, naming what is missing; the build and the check that no page loads a
script, a stylesheet or a font from another host run wherever MkDocs is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serverproc import ROOT

pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install -e '.[docs]')")
pytest.importorskip("material", reason="mkdocs-material is not installed (the docs extra)")

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Material draws each diagram into a closed shadow root, which no DOM dump shows: this
# probe, put first into the test's copy of the page, marks each shadow root's host
# with the number of <svg> elements written into it.
SVG_PROBE = """<script>
(() => {
  const inner = Object.getOwnPropertyDescriptor(ShadowRoot.prototype, "innerHTML");
  Object.defineProperty(ShadowRoot.prototype, "innerHTML", {
    get() { return inner.get.call(this); },
    set(value) {
      inner.set.call(this, value);
      this.host.setAttribute("data-test-svgs", String(this.querySelectorAll("svg").length));
    },
  });
})();
</script>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    return out


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(f"no headless Chromium on PATH (looked for {', '.join(BROWSERS)})")


def _dump_dom(page: Path, query: str = "") -> str:
    """The page's DOM once its scripts have run, loaded from disk with the network off:
    every host resolves to nothing and every proxied request goes to a closed port."""
    run = subprocess.run(
        [
            _browser(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--proxy-server=127.0.0.1:9",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.as_uri() + query,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_pages_load_nothing_from_other_hosts(site: Path):
    """Scripts, stylesheets, fonts and images come from the site itself."""
    remote = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"')
    for page in sorted(site.glob("*.html")):
        text = page.read_text()
        loads = [tag for tag in remote.findall(text) if 'rel="preconnect"' not in tag]
        # <link rel="canonical"> and the like are not loads; only stylesheets and icons are.
        loads = [
            tag
            for tag in loads
            if not tag.startswith("<link") or "stylesheet" in tag or "icon" in tag
        ]
        assert not loads, f"{page.name} loads from another host: {loads}"


def test_links_open_pages_from_disk(site: Path):
    """Nav links name .html files, not directories (which file:// shows as listings)."""
    index = (site / "index.html").read_text()
    assert 'href="quickstart.html"' in index
    assert not re.search(r'href="quickstart/"', index)
    # Every link between pages, and every asset, names a file that is there (404.html
    # is for a web server, which serves it for any path: its links are absolute).
    for page in sorted(set(site.glob("*.html")) - {site / "404.html"}):
        for href in re.findall(r'(?:href|src)="([^"#?]+)', page.read_text()):
            if re.match(r"[a-z]+:", href) or href.startswith("//"):
                continue
            assert (page.parent / href).is_file(), f"{page.name} links to {href}, no such file"


def test_diagrams_render_offline(site: Path):
    page = site / "architecture.html"
    text = page.read_text()
    assert text.count('class="mermaid"') == 2
    probed = site / "architecture-probe.html"
    probed.write_text(text.replace("<head>", "<head>" + SVG_PROBE, 1))
    dom = _dump_dom(probed)
    svgs = re.findall(r'<div class="mermaid" data-test-svgs="(\d+)"', dom)
    assert len(svgs) == 2 and all(int(n) >= 1 for n in svgs), (
        "both Mermaid diagrams render to SVG offline",
        svgs,
    )
    assert '<pre class="mermaid"' not in dom


def test_search_works_offline(site: Path):
    dom = _dump_dom(site / "index.html", "?q=metrics")
    assert re.search(r'md-search-result__meta">\d+ matching documents?<', dom), (
        "search answered offline"
    )
    assert 'href="observability.html' in dom.split("md-search-result", 1)[1]
