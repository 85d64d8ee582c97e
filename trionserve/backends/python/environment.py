"""``EXECUTION_ENV_PATH``: a Python model's own environment, as in Triton.

The model's config names a packed environment (a ``conda-pack`` or any tar
archive, ``.tar.gz`` / ``.tgz`` / ``.tar``) or an unpacked environment directory,
usually as ``$$TRITON_MODEL_DIRECTORY/env.tar.gz``. Its stubs then run with that
environment's ``bin/python3``, with its ``bin`` first on PATH and its ``lib`` on
LD_LIBRARY_PATH (what activating it does). An archive is unpacked once into a
cache directory keyed by the archive's path, size and modification time.

The environment must have Python 3.11 or newer and numpy, which the stub needs;
trionserve itself is made importable in the stub without the rest of the
server's packages.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trionserve.core.errors import Unavailable

MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"
_ARCHIVES = (".tar.gz", ".tgz", ".tar")
_PROBE = (
    "import sys\n"
    "if sys.version_info < (3, 11):\n"
    "    sys.exit('Python %d.%d; the stub needs 3.11 or newer' % sys.version_info[:2])\n"
    "import numpy\n"
)


@dataclass(frozen=True, slots=True)
class ExecutionEnvironment:
    root: Path
    python: Path

    def variables(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this environment activated."""
        env = dict(base)
        env["PATH"] = os.pathsep.join(filter(None, [str(self.root / "bin"), base.get("PATH")]))
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(self.root / "lib"), base.get("LD_LIBRARY_PATH")])
        )
        env.pop("PYTHONHOME", None)
        env.pop("PYTHONPATH", None)
        return env


def resolve(value: str, model_dir: Path, model: str) -> ExecutionEnvironment:
    """The environment ``EXECUTION_ENV_PATH`` names, unpacked and checked (blocking)."""
    where = f"model '{model}': EXECUTION_ENV_PATH '{value}'"
    path = Path(value.replace(MODEL_DIRECTORY, str(model_dir)))
    if not path.is_absolute():
        path = model_dir / path
    if path.is_dir():
        root = path
    elif path.is_file() and path.name.endswith(_ARCHIVES):
        root = _unpacked(path, where)
    elif path.exists():
        raise Unavailable(f"{where}: expected a directory or a .tar.gz / .tgz / .tar archive")
    else:
        raise Unavailable(f"{where}: {path} does not exist")
    python = next(
        (root / "bin" / name for name in ("python3", "python") if (root / "bin" / name).exists()),
        None,
    )
    if python is None:
        raise Unavailable(f"{where}: the environment has no bin/python3")
    environment = ExecutionEnvironment(root, python)
    try:
        probe = subprocess.run(
            [str(python), "-c", _PROBE],
            env=environment.variables(dict(os.environ)),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{where}: cannot run its Python: {exc}") from None
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["it exited with an error"])[-1]
        raise Unavailable(f"{where}: its Python cannot run the stub: {reason}")
    return environment


def _unpacked(archive: Path, where: str) -> Path:
    """The archive unpacked into the cache (once per archive version)."""
    stat = archive.stat()
    key = hashlib.sha256(
        f"{archive.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / "trionserve-envs"
    root = cache / key
    if (root / ".unpacked").exists():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache))
    try:
        with tarfile.open(archive) as tar:
            # "tar" keeps the archive inside the directory but allows the absolute
            # interpreter links that environments have.
            tar.extractall(staging, filter="tar")
        (staging / ".unpacked").touch()
        try:
            staging.rename(root)
        except OSError:
            if not (root / ".unpacked").exists():
                raise
            # Another load unpacked the same archive first: use that one.
    except (OSError, tarfile.TarError) as exc:
        raise Unavailable(f"{where}: cannot unpack it: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def package_shim() -> str:
    """A directory holding only a link to the trionserve package, for the stub's
    sys.path under another environment (the server's other packages stay out)."""
    import trionserve

    package = Path(trionserve.__file__).resolve().parent
    key = hashlib.sha256(str(package).encode()).hexdigest()[:12]
    shim = Path(tempfile.gettempdir()) / f"trionserve-stubpath-{key}"
    link = shim / "trionserve"
    if not link.exists():
        shim.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(package, target_is_directory=True)
        except FileExistsError:
            pass
    return str(shim)
